// bench_shrink: what train_params::on_replica_failure = shrink costs a step when nothing fails:
// each step's fence (one barrier) and its host copy of the state the step changes
// (detail::step_rollback), on a network with ResNet-50's 161 parameter tensors (SGD with
// momentum: 2 x 25.6 M floats kept per replica, about 205 MB) trained on the thread group. Two
// trainers over the same communicator and workload, one with replica_failure::stop, one with
// shrink, take turns step by step (5 steps each per repetition); the medians and their ratio
// are printed.
// SPDX-License-Identifier: Apache-2.0
//
//     bench_shrink [--quick] [--reps N] [--replicas R] [--step-ms MS] [--csv F]
//
// --step-ms: the backward's calibrated compute per step (default 200 ms).
#include "csv.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "median.hpp"
#include "resnet_shaped.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using namespace lockstep;
using bench_nets::resnet_shaped;
using bench_nets::workload;
using steady = std::chrono::steady_clock;

namespace {

using bench_stats::median;

} // namespace

int main(int argc, char** argv) {
    int reps = 5;
    int replicas = 2;
    double step_ms = 200;
    const std::string csv_path = bench_csv::take_option(argc, argv);
    for (int i = 1; i < argc; ++i) {
        const auto arg = [&] { return i + 1 < argc ? argv[++i] : (std::exit(2), argv[0]); };
        if (std::strcmp(argv[i], "--quick") == 0) {
            reps = 1;
            step_ms = 50;
        } else if (std::strcmp(argv[i], "--reps") == 0) {
            reps = std::atoi(arg());
        } else if (std::strcmp(argv[i], "--replicas") == 0) {
            replicas = std::atoi(arg());
        } else if (std::strcmp(argv[i], "--step-ms") == 0) {
            step_ms = std::atof(arg());
        } else {
            std::fprintf(stderr, "usage: bench_shrink [--quick] [--reps N] [--replicas R] "
                                 "[--step-ms MS] [--csv F]\n");
            return 2;
        }
    }
    std::vector<double> stop_ms, shrink_ms;
    std::size_t kept_bytes = 0;
    thread_group(replicas).run([&](thread_communicator& comm) {
        using net = resnet_shaped<replica_context<float, thread_communicator>>;
        using trainer = data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>,
                                      thread_communicator>;
        auto work = std::make_unique<workload>();
        const auto factory = [&](auto& ctx) { return net(ctx, *work); };
        const optim::sgd_params sgd{.lr = 1e-4, .momentum = 0.9};
        trainer stop(comm, factory, sgd);
        trainer shrink(comm, factory, sgd, {.on_replica_failure = replica_failure::shrink});
        const auto timed_step = [&](trainer& dp) {
            const auto t0 = steady::now();
            (void)dp.step(static_cast<std::size_t>(comm.size()),
                          [](net& n, const shard_range&, auto& ctx) {
                              n.backward(ctx);
                              return 0.0;
                          });
            return std::chrono::duration<double, std::milli>(steady::now() - t0).count();
        };
        bench_nets::calibrate(*work, comm, step_ms, [&](int n) {
            std::vector<double> v;
            for (int i = 0; i < n; ++i)
                v.push_back(timed_step(stop));
            return median(v);
        });
        for (int i = 0; i < 5 * reps; ++i) { // one step each, in turn
            const double a = timed_step(stop);
            const double b = timed_step(shrink);
            if (comm.rank() == 0) {
                stop_ms.push_back(a);
                shrink_ms.push_back(b);
            }
        }
        if (comm.rank() == 0)
            kept_bytes = 2 * shrink.parameters().size() * sizeof(float); // values + momentum
    });
    const double a = median(stop_ms);
    const double b = median(shrink_ms);
    std::printf("bench_shrink: %d thread replicas, ResNet-50-shaped network, SGD with momentum, "
                "%.0f MB kept per replica per step, %d steps each, in turn (medians)\n",
                replicas, static_cast<double>(kept_bytes) / 1e6, 5 * reps);
    std::printf("  step, on_replica_failure = stop    %8.1f ms\n", a);
    std::printf("  step, on_replica_failure = shrink  %8.1f ms  (%.3fx)\n", b, b / a);
    bench_csv::writer csv(csv_path, {"replicas", "kept_mb", "stop_ms", "shrink_ms", "ratio"});
    csv.row({replicas, static_cast<double>(kept_bytes) / 1e6, a, b, b / a});
    return 0;
}

// bench_reproducible: the step of a network with ResNet-50's 161 parameter tensors (25.6 M
// floats) trained with reduce::reproducible<C> (chunks of C samples, anchored fixed-point sums,
// replica-count-independent bits) and reduce::sharded<> (ZeRO stage 1: reduce-scatter, sharded
// optimizer state, all_gather) beside reduce::bucketed<> (one all_reduce per bucket), on 2
// thread replicas, or under `mpiexec -n 2` (bench_reproducible_mpi). SPDX-License-Identifier:
// Apache-2.0
//
//     bench_reproducible [--quick] [--reps N] [--csv FILE]
//     mpiexec -n 2 bench_reproducible_mpi [--quick] [--reps N] [--csv FILE]
//
// The network's "backward" adds to every gradient once per call and marks each tensor ready
// (what accumulating weight gradients costs; no other compute), so the rows isolate what the
// reduction policy costs: the bucketed step calls it once per replica and all_reduces 4 bytes
// per parameter; the reproducible step calls it once per chunk and keeps every chunk but the
// last, each tensor as it is marked ready. Over MPI it sends each chunk's values of every block
// of elements to the block's owner (an all_to_all per chunk index: 4 bytes per parameter and
// chunk), which sums them in fixed point anchored at each element's largest exponent and rounds
// once, and all-gathers the blocks (4 bytes per parameter); on thread replicas one all_combine
// has each block's owner read every replica's chunks where they lie and store the sums into
// every replica's gradient. A bucketed trainer with 4 micro-batches calls the backward as often
// as reproducible<8> does (4 times per replica), so "/ bucketed, same calls" is what the policy
// costs beyond the calls. The last row reports stragglers (train_params::report_stragglers_every)
// after every step, a hundred times as often as K = 100.
// Global batch 64; SGD with momentum. The six trainers live side by side and take turns, one
// step each per round, so a slow spell of the shared machine hits every row alike: a row's time
// is the median over rounds of one step between barriers, its ratios the medians over rounds of
// its step over the bucketed step (with as many calls) of the same round.
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "median.hpp"
#include "resnet50.hpp"
#if LOCKSTEP_BENCH_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

using namespace lockstep;

namespace {

constexpr std::size_t global_batch = 64;

/// ResNet-50's tensors in the registry; backward fills every gradient (a value that depends on
/// the chunk, so the sums are not trivial).
template <class Context>
struct resnet_shaped {
    std::vector<typename Context::handle> params;
    explicit resnet_shaped(Context& ctx) {
        for (const tensor_info& t : bench_nets::resnet50_tensors())
            params.push_back(ctx.registry().add(t.name, t.shape));
    }
    double train(const shard_range& r, Context& ctx) {
        const float g = 1e-4f * static_cast<float>(r.begin + 1) * static_cast<float>(r.scale);
        for (std::size_t t = params.size(); t-- > 0;) {
            const std::span<float> grad = params[t].grad();
            for (float& x : grad)
                x += g;
            ctx.mark_ready(params[t]);
        }
        return 0.0;
    }
};

using bench_stats::median;

struct row {
    std::string name;
    double ms = 0;
    double ratio = 0; ///< median over rounds of this step / the bucketed step of the round
    /// The same against the bucketed trainer that calls the step function as often per replica
    /// (4 micro-batches for 4 chunks): what the policy costs beyond the calls themselves.
    double same_calls = 0;
};

/// One trainer of the bench network with policy Reduce, as a function that takes one step.
template <class Reduce, class Comm>
std::function<void()> make_trainer(Comm& comm, int micro_batches = 1, std::int64_t stragglers = 0) {
    using net = resnet_shaped<replica_context<float, Comm>>;
    using trainer = data_parallel<net, optim::sgd<float, typename Comm::system_type>,
                                  sync::synchronous, Reduce, Comm>;
    auto dp = std::make_shared<trainer>(
        comm, [](auto& ctx) { return net(ctx); }, optim::sgd_params{.lr = 1e-3, .momentum = 0.9},
        train_params{.micro_batches = micro_batches, .report_stragglers_every = stragglers});
    return [dp] {
        dp->step(global_batch,
                 [](net& n, const shard_range& s, auto& ctx) { return n.train(s, ctx); });
    };
}

template <class Comm>
std::vector<row> run_all(Comm& comm, int reps) {
    struct trainer {
        std::string name;
        std::function<void()> step;
        std::size_t anchor; ///< the bucketed trainer with as many calls per replica
    };
    std::vector<trainer> trainers;
    trainers.push_back({"bucketed<>", make_trainer<reduce::bucketed<>>(comm), 0});
    trainers.push_back({"sharded<> (ZeRO stage 1)", make_trainer<reduce::sharded<>>(comm), 0});
    trainers.push_back({"reproducible<32> (1 chunk per replica)",
                        make_trainer<reduce::reproducible<32>>(comm), 0});
    trainers.push_back(
        {"reproducible<8> (4 chunks per replica)", make_trainer<reduce::reproducible<8>>(comm), 4});
    trainers.push_back({"bucketed<>, 4 micro-batches (4 calls per replica)",
                        make_trainer<reduce::bucketed<>>(comm, 4), 4});
    trainers.push_back({"bucketed<>, a straggler report every step",
                        make_trainer<reduce::bucketed<>>(comm, 1, 1), 0});
    std::vector<std::vector<double>> ms(trainers.size());
    for (int r = -1; r < reps; ++r) // round -1 warms every trainer up
        for (std::size_t k = 0; k < trainers.size(); ++k) {
            comm.barrier();
            const auto t0 = std::chrono::steady_clock::now();
            trainers[k].step();
            comm.barrier();
            if (r >= 0)
                ms[k].push_back(
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count());
        }
    std::vector<row> rows;
    const auto paired = [&](std::size_t k, std::size_t anchor) {
        std::vector<double> ratios;
        for (std::size_t r = 0; r < ms[k].size(); ++r)
            ratios.push_back(ms[k][r] / ms[anchor][r]);
        return median(ratios);
    };
    for (std::size_t k = 0; k < trainers.size(); ++k)
        rows.push_back(
            {trainers[k].name, median(ms[k]), paired(k, 0), paired(k, trainers[k].anchor)});
    return rows;
}

void report(const std::vector<row>& rows, const char* backend, const std::string& csv) {
    std::printf("%s, 2 replicas, global batch %zu, ResNet-50's 161 tensors (25.6 M floats)\n",
                backend, global_batch);
    std::printf("%-50s %10s %12s %24s\n", "reduce policy", "step ms", "/ bucketed",
                "/ bucketed, same calls");
    for (const row& r : rows)
        std::printf("%-50s %10.2f %12.3f %24.3f\n", r.name.c_str(), r.ms, r.ratio, r.same_calls);
    if (csv.empty())
        return;
    if (std::FILE* f = std::fopen(csv.c_str(), "w")) {
        std::fprintf(f, "bench,backend,policy,step_ms,ratio_to_bucketed,ratio_to_same_calls\n");
        for (const row& r : rows)
            std::fprintf(f, "reproducible,%s,\"%s\",%.6f,%.6f,%.6f\n", backend, r.name.c_str(),
                         r.ms, r.ratio, r.same_calls);
        std::fclose(f);
    }
}

} // namespace

int main(int argc, char** argv) {
#if LOCKSTEP_BENCH_MPI
    mpi_environment env(argc, argv);
#endif
    int reps = 10;
    std::string csv;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0)
            reps = 3;
        else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = std::max(1, std::atoi(argv[++i]));
        else if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc)
            csv = argv[++i];
        else {
            std::fprintf(stderr, "usage: %s [--quick] [--reps N] [--csv FILE]\n", argv[0]);
            return 2;
        }
    }
#if LOCKSTEP_BENCH_MPI
    mpi_communicator comm(MPI_COMM_WORLD);
    const auto rows = run_all(comm, reps);
    if (comm.rank() == 0)
        report(rows, "mpi", csv);
#else
    thread_group group(2);
    std::vector<row> rows;
    group.run([&](thread_communicator& comm) {
        auto mine = run_all(comm, reps);
        if (comm.rank() == 0)
            rows = std::move(mine);
    });
    report(rows, "thread_group", csv);
#endif
    return 0;
}

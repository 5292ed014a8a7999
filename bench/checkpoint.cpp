// bench_checkpoint: what a checkpoint costs the training loop of a network with ResNet-50's 161
// parameter tensors (SGD with momentum: a shard of 2 x 25.6 M floats, about 205 MB per replica),
// trained on the thread group: the blocking save's stall (save_checkpoint), beside the
// background save's (save_checkpoint_async): the snapshot's stall (the call) and the steps that
// run while the writers encode and write (until a step reports the commit), each as a ratio of
// a normal step measured in the same run. SPDX-License-Identifier: Apache-2.0
//
//     bench_checkpoint [--quick] [--reps N] [--replicas R] [--step-ms MS] [--dir D] [--csv F]
//
// --step-ms: the backward's calibrated compute per step (default 200 ms; the SGD update and the
// checks come on top); --dir: where the checkpoints are written (default: the current
// directory; the files are removed at the end). The backward is calibrated in place (a step
// takes --step-ms); each repetition runs 5 normal steps, a blocking save, then twice: 2 steps, a
// background save (save_options::background_share 0.5, the default, then 1: no pauses), steps
// until one reports the commit, wait_checkpoint. Medians over the repetitions are printed.
#include "csv.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/async_checkpoint.hpp"
#include "median.hpp"
#include "resnet_shaped.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

using namespace lockstep;
using bench_nets::resnet_shaped;
using bench_nets::workload;
using steady = std::chrono::steady_clock;

namespace {

struct options {
    int reps = 5;
    int replicas = 1;
    double step_ms = 200;
    std::filesystem::path dir = ".";
    std::string csv;
};

double ms_since(steady::time_point t0) {
    return std::chrono::duration<double, std::milli>(steady::now() - t0).count();
}

using bench_stats::median;

/// One background save, measured on replica 0 (ms from the call).
struct background {
    double snapshot = 0;      ///< the call's stall
    double during_median = 0; ///< the steps until one reports the commit
    double during_mean = 0;
    int steps = 0;             ///< how many
    double half_written = 0;   ///< replica 0's writer: half its shard written
    double shard_written = 0;  ///< its shard written and fsynced
    double marker_renamed = 0; ///< the commit marker renamed (the commit point)
    double reported = 0;       ///< the step reporting the commit returned
};

/// What one repetition measured on replica 0 (ms).
struct sample {
    double step = 0;     ///< a normal step (median of 5)
    double blocking = 0; ///< save_checkpoint
    background paced;    ///< save_options::background_share = 0.5 (the default)
    background unpaced;  ///< background_share = 1
};

} // namespace

int main(int argc, char** argv) {
    options opt;
    opt.csv = bench_csv::take_option(argc, argv);
    for (int i = 1; i < argc; ++i) {
        const auto arg = [&] { return i + 1 < argc ? argv[++i] : (std::exit(2), argv[0]); };
        if (std::strcmp(argv[i], "--quick") == 0) {
            opt.reps = 1;
            opt.step_ms = 50;
        } else if (std::strcmp(argv[i], "--reps") == 0) {
            opt.reps = std::atoi(arg());
        } else if (std::strcmp(argv[i], "--replicas") == 0) {
            opt.replicas = std::atoi(arg());
        } else if (std::strcmp(argv[i], "--step-ms") == 0) {
            opt.step_ms = std::atof(arg());
        } else if (std::strcmp(argv[i], "--dir") == 0) {
            opt.dir = arg();
        } else {
            std::fprintf(stderr, "usage: bench_checkpoint [--quick] [--reps N] [--replicas R] "
                                 "[--step-ms MS] [--dir D] [--csv F]\n");
            return 2;
        }
    }
    const std::filesystem::path dir =
        opt.dir / ("bench_checkpoint." + std::to_string(static_cast<long>(::getpid())));
    std::filesystem::create_directories(dir);
    std::vector<sample> samples(static_cast<std::size_t>(opt.reps));
    std::size_t shard_bytes = 0;

    thread_group(opt.replicas).run([&](thread_communicator& comm) {
        auto work = std::make_unique<workload>();
        const auto factory = [&](auto& ctx) {
            return resnet_shaped<std::remove_reference_t<decltype(ctx)>>(ctx, *work);
        };
        data_parallel<resnet_shaped<replica_context<float, thread_communicator>>, optim::sgd<float>,
                      sync::synchronous, reduce::bucketed<>, thread_communicator>
            dp(comm, factory, optim::sgd_params{.lr = 1e-4, .momentum = 0.9});
        const auto step = [&] {
            const auto t0 = steady::now();
            const step_result r = dp.step(static_cast<std::size_t>(comm.size()),
                                          [](auto& net, const shard_range&, auto& ctx) {
                                              net.backward(ctx);
                                              return 0.0;
                                          });
            return std::pair{ms_since(t0), r.checkpoint};
        };
        const auto median_step = [&](int n) {
            std::vector<double> v;
            for (int i = 0; i < n; ++i)
                v.push_back(step().first);
            return median(v);
        };
        // Calibrated in place: the backward's units scaled until a step takes --step-ms.
        bench_nets::calibrate(*work, comm, opt.step_ms, median_step);
        const auto save_in_background = [&](background& b, double share, const char* name) {
            step();
            step();
            comm.barrier();
            const auto t0 = steady::now();
            // Replica 0's stages, timed on its writer thread (read after the wait).
            save_checkpoint_async(dp, dir / name,
                                  {.on_stage =
                                       [&b, t0](std::string_view stage, int replica) {
                                           if (replica != 0)
                                               return;
                                           if (stage == "shard.partial")
                                               b.half_written = ms_since(t0);
                                           else if (stage == "shard.written")
                                               b.shard_written = ms_since(t0);
                                           else if (stage == "manifest.renamed")
                                               b.marker_renamed = ms_since(t0);
                                       },
                                   .background_share = share});
            b.snapshot = ms_since(t0);
            std::vector<double> during;
            for (int i = 0; i < 400; ++i) {
                const auto [ms, event] = step();
                during.push_back(ms);
                if (event != checkpoint_event::none)
                    break;
            }
            b.reported = ms_since(t0);
            b.during_median = median(during);
            double sum = 0;
            for (double d : during)
                sum += d;
            b.during_mean = sum / static_cast<double>(during.size());
            b.steps = static_cast<int>(during.size());
            (void)wait_checkpoint(dp);
        };
        for (sample& kept : samples) {
            sample s; // every replica measures its own; replica 0's are kept
            s.step = median_step(5);
            comm.barrier();
            const auto t0 = steady::now();
            save_checkpoint(dp, dir / "blocking.ckpt");
            s.blocking = ms_since(t0);
            save_in_background(s.paced, 0.5, "paced.ckpt");
            save_in_background(s.unpaced, 1.0, "unpaced.ckpt");
            if (comm.rank() == 0)
                kept = s;
        }
        dp.finish();
        if (comm.rank() == 0)
            for (const auto& e : std::filesystem::directory_iterator(dir))
                if (e.path().string().find(".shard0") != std::string::npos)
                    shard_bytes = std::filesystem::file_size(e.path());
    });
    std::filesystem::remove_all(dir);

    const auto med = [&](auto get) {
        std::vector<double> v;
        for (const sample& s : samples)
            v.push_back(get(s));
        return median(v);
    };
    const double step = med([](const sample& s) { return s.step; });
    std::printf("bench_checkpoint: ResNet-50-shaped network, SGD + momentum, %d thread replica(s), "
                "shard %.1f MB, %d repetitions (medians), checkpoints in %s\n",
                opt.replicas, static_cast<double>(shard_bytes) * 1e-6, opt.reps,
                opt.dir.string().c_str());
    std::printf("%-56s %10s %8s\n", "", "ms", "x step");
    const auto line = [&](const std::string& what, double ms) {
        std::printf("%-56s %10.1f %8.2f\n", what.c_str(), ms, ms / step);
    };
    line("normal step", step);
    line("blocking save (save_checkpoint): stall", med([](const sample& s) { return s.blocking; }));
    bench_csv::writer csv(opt.csv, {"replicas", "shard_mb", "step_ms", "blocking_ms", "share",
                                    "snapshot_ms", "during_median_ms", "during_mean_ms",
                                    "steps_during", "shard_written_ms", "reported_ms"});
    for (const bool paced : {true, false}) {
        const auto of = [paced](const sample& s) -> const background& {
            return paced ? s.paced : s.unpaced;
        };
        const std::string name = std::string("background, share ") + (paced ? "0.5" : "1.0") + ": ";
        const double snapshot = med([&](const sample& s) { return of(s).snapshot; });
        const double during = med([&](const sample& s) { return of(s).during_median; });
        const double mean = med([&](const sample& s) { return of(s).during_mean; });
        const double steps = med([&](const sample& s) { return double(of(s).steps); });
        const double written = med([&](const sample& s) { return of(s).shard_written; });
        const double reported = med([&](const sample& s) { return of(s).reported; });
        line(name + "snapshot stall", snapshot);
        line(name + "steps during the write, median", during);
        line(name + "steps during the write, mean", mean);
        line(name + "shard fsynced (from the call)", written);
        line(name + "commit reported (from the call)", reported);
        std::printf("%-56s %10.0f\n", (name + "steps during the write").c_str(), steps);
        csv.row({std::to_string(opt.replicas),
                 std::to_string(static_cast<double>(shard_bytes) * 1e-6), std::to_string(step),
                 std::to_string(med([](const sample& s) { return s.blocking; })),
                 paced ? "0.5" : "1", std::to_string(snapshot), std::to_string(during),
                 std::to_string(mean), std::to_string(steps), std::to_string(written),
                 std::to_string(reported)});
    }
    return 0;
}

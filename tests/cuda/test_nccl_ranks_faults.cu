// Failures of one NCCL rank process mid-step (the rank launcher, --ranks 2 and 3): a rank whose
// step function throws, and a rank SIGKILLed inside its step. Every survivor must end with a
// lockstep::error (errc::peer_failure, or errc::timeout after its communicator's timeout:
// LOCKSTEP_TIMEOUT) within that timeout, never hang, and the flight recorder files the survivors
// write name the culprit (scripts/trace_merge.py: "culprit: replica R"); with
// on_replica_failure = shrink the survivors instead continue without it (ncclCommRevoke, a new
// communicator from the NCCL id the first survivor shares) to the bits of an undisturbed run. Each
// case is its own CTest test ([throw], [kill], [shrink]); the kill and shrink cases end with one
// rank fewer. Every case needs a GPU (tagged [gpu]). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/file_coordinator.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "gpu_test_net.hpp"
#include "gpu_train_runner.hpp"
#include "nccl_rank_support.hpp"
#include "support/rank_shared_dir.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#ifndef LOCKSTEP_SOURCE_DIR
#error "LOCKSTEP_SOURCE_DIR (the project's source directory, for scripts/trace_merge.py) is needed"
#endif

namespace {

using namespace lockstep;
namespace tn = lockstep_test::net;
namespace launcher = lockstep_test::ranks;
using lockstep_test::nccl_ranks::hash_bits;
using lockstep_test::nccl_ranks::rank0_values;
using lockstep_test::nccl_ranks::rank_communicator;

enum class fault { throws, sigkill };

using launcher::shared_dir;

/// LOCKSTEP_TRACE_DIR (the flight recorder files) set to `dir` in this rank while it lives.
class trace_dir_env {
public:
    explicit trace_dir_env(const std::string& dir) {
        ::setenv("LOCKSTEP_TRACE_DIR", dir.c_str(), 1);
    }
    trace_dir_env(const trace_dir_env&) = delete;
    trace_dir_env& operator=(const trace_dir_env&) = delete;
    ~trace_dir_env() { ::unsetenv("LOCKSTEP_TRACE_DIR"); }
};

/// The output of scripts/trace_merge.py over dir (its exit status checked). The source tree is
/// the environment's LOCKSTEP_SOURCE_DIR where set (scripts/gpu_check's bundle carries the
/// script), else the one this test was built from.
std::string merge_report(const std::string& dir) {
    const char* env = std::getenv("LOCKSTEP_SOURCE_DIR"); // NOLINT(concurrency-mt-unsafe)
    const std::string root = env != nullptr && *env != '\0' ? env : LOCKSTEP_SOURCE_DIR;
    const std::string cmd = "python3 \"" + root + "/scripts/trace_merge.py\" \"" + dir + "\" 2>&1";
    std::FILE* p = ::popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    std::string out;
    char buf[512];
    while (std::fgets(buf, sizeof buf, p) != nullptr)
        out += buf;
    const int status = ::pclose(p);
    INFO(out);
    CHECK(status == 0);
    return out;
}

/// How this rank's run ended.
struct outcome {
    bool failed = false;
    errc code = errc::internal;
    std::string what;
    std::chrono::duration<double> elapsed{}; ///< from the start of step 1 (or of the run)
    int steps_done = 0;
};

/// Trains bn::global over small buckets (overlap automatic: NCCL's side-stream split), reading
/// every step's result. In step 1 the culprit's step function waits 300 ms (so the other ranks
/// have enqueued their whole step and wait for its result) and then throws, or tells the
/// launcher and SIGKILLs itself. The trainer aborts the communicator of a step that throws.
outcome run_until_fault(nccl_communicator& comm, int culprit, fault kind) {
    using net_t = tn::test_net<nccl_communicator, bn::global>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    lockstep_test::gpu_train::small_buckets, nccl_communicator>;
    constexpr std::size_t batch = 12;
    constexpr int steps = 5;
    const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
    const int me = comm.rank();
    outcome out;
    auto start = std::chrono::steady_clock::now();
    try {
        trainer_t trainer(
            comm, [&](auto& ctx) { return net_t(ctx, cap); },
            {.lr = lockstep_test::gpu_train::lr, .momentum = lockstep_test::gpu_train::momentum},
            {.read_result = true});
        const auto fn = [&](net_t& n, shard_range sr, auto& ctx) {
            if (ctx.step() == 1 && me == culprit) {
                std::this_thread::sleep_for(std::chrono::milliseconds(300));
                if (kind == fault::sigkill) {
                    launcher::planned_exit();
                    std::fflush(nullptr);
                    std::raise(SIGKILL);
                }
                lockstep::fail(errc::internal, me, "fault test", "rank ", me,
                               " throws inside step 1");
            }
            n.train(sr, ctx);
        };
        for (int s = 0; s < steps; ++s) {
            if (s == 1)
                start = std::chrono::steady_clock::now();
            (void)trainer.step(batch, fn);
            ++out.steps_done;
        }
        trainer.finish();
    } catch (const error& e) {
        out.failed = true;
        out.code = e.code();
        out.what = e.what();
    }
    comm.abort(); // a no-op after the trainer's abort; ends a survivor's communicator at once
    out.elapsed = std::chrono::steady_clock::now() - start;
    return out;
}

/// The fault case: the last rank is the culprit (rank 0 survives and reads the recorder files).
void check_fault(fault kind) {
    shared_dir dir("lockstep_rank_trace");
    const trace_dir_env trace(dir.path());
    auto comm = rank_communicator();
    const int me = comm.rank();
    const int culprit = comm.size() - 1;
    const double timeout_s = std::chrono::duration<double>(comm.options().timeout).count();
    const outcome out = run_until_fault(comm, culprit, kind);
    REQUIRE((me != culprit || kind == fault::throws)); // a killed culprit never gets here

    INFO("rank " << me << " of " << comm.size() << ", culprit " << culprit << ", after "
                 << out.elapsed.count() << " s (timeout " << timeout_s << " s): " << out.what);
    REQUIRE(out.failed);
    CHECK(out.steps_done == 1); // step 0 completed everywhere, step 1 on none
    if (me == culprit) {
        CHECK(out.code == errc::internal);
        CHECK(out.what.find("throws inside step 1") != std::string::npos);
    } else {
        CHECK((out.code == errc::peer_failure || out.code == errc::timeout));
        // The survivor's wait dumped its ring and says where.
        CHECK(out.what.find("[flight recorder: " + dir.path()) != std::string::npos);
        // Never a hang: the error came within the communicator's timeout of step 1's start
        // (plus the 300 ms the culprit waited and the abort), far below the launcher's case
        // timeout.
        CHECK(out.elapsed.count() < timeout_s + 5.0);
    }

    // Every rank still alive has written its file (or never will); rank 0 merges them.
    REQUIRE(launcher::agree(true, "flight recorder files written"));
    if (me == 0) {
        const std::string report = merge_report(dir.path());
        INFO(report);
        CHECK(report.find("culprit: replica " + std::to_string(culprit) + " (missing") !=
              std::string::npos);
        for (int r = 0; r < comm.size(); ++r)
            if (r != culprit)
                CHECK(report.find("replica " + std::to_string(r) + ": ") != std::string::npos);
    }
}

/// One run with on_replica_failure = shrink: reduce::reproducible<2> + bn::ghost<2>, `steps`
/// steps of 12 samples, the survivors agreeing through a file_coordinator over `dir`. With
/// culprit >= 0, that rank (by its first rank) waits 300 ms inside step `kill_step` (the others
/// wait for it in the exchange), tells the launcher and SIGKILLs itself.
struct shrink_log {
    std::vector<std::uint64_t> params; ///< hash_bits of the parameters after each step
    std::vector<double> losses;
    std::vector<int> lost; ///< step_result::lost of each step
    int size_after = 0;
};
shrink_log run_shrinking(const std::string& dir, int culprit, int kill_step) {
    using net_t = tn::test_net<nccl_communicator, bn::ghost<2>>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    reduce::reproducible<2>, nccl_communicator>;
    constexpr std::size_t batch = 12;
    constexpr int steps = 5;
    nccl_options options;
    options.survivors = file_coordinator(dir);
    auto comm = rank_communicator(options);
    const int me = comm.rank();
    train_params tp;
    tp.on_replica_failure = replica_failure::shrink;
    tp.min_replicas = 1;
    shrink_log log;
    {
        trainer_t trainer(
            comm, [&](auto& ctx) { return net_t(ctx, batch); },
            {.lr = lockstep_test::gpu_train::lr, .momentum = lockstep_test::gpu_train::momentum},
            tp);
        const auto fn = [&](net_t& n, shard_range sr, auto& ctx) {
            if (me == culprit && ctx.step() == kill_step) {
                std::this_thread::sleep_for(std::chrono::milliseconds(300));
                launcher::planned_exit();
                std::fflush(nullptr);
                std::raise(SIGKILL);
            }
            n.train(sr, ctx);
        };
        for (int s = 0; s < steps; ++s) {
            const step_result r = trainer.step(batch, fn);
            log.losses.push_back(r.loss);
            log.lost.push_back(r.lost);
            log.params.push_back(hash_bits(lockstep_test::gpu_train::to_host(
                std::span<const float>(trainer.parameters()), comm.system())));
        }
        trainer.finish();
    }
    log.size_after = comm.size();
    return log;
}

} // namespace

TEST_CASE("NCCL ranks: a rank throwing mid-step ends as an error on every rank within the "
          "timeout, and the flight recorder names it",
          "[train][nccl][ranks][fault][throw][gpu]") {
    check_fault(fault::throws);
}

// Declared last: afterwards the process runs with one rank fewer.
TEST_CASE("NCCL ranks: a rank SIGKILLed mid-step ends as an error on every survivor within the "
          "timeout, and the flight recorder names it",
          "[train][nccl][ranks][fault][kill][gpu]") {
    check_fault(fault::sigkill);
}

// Declared last too: afterwards the process runs with one rank fewer. reduce::reproducible's
// bits do not depend on the replica count, and the data order is keyed by the global sample
// index, so the survivors of a rank lost in step 2 (found by the timeout or NCCL's remote error,
// left out by the file_coordinator's decision after one more timeout, a new communicator made
// from the id the first survivor shares, step 2 computed again on fewer ranks) end every step with
// the parameter bits and losses of the undisturbed run, and all survivors hold rank 0's.
TEST_CASE("NCCL ranks: with on_replica_failure = shrink the survivors of a rank SIGKILLed "
          "mid-step continue to the bits of an undisturbed run",
          "[train][nccl][ranks][fault][shrink][gpu]") {
    shared_dir dir("lockstep_rank_shrink");
    const int me = launcher::rank();
    const int ranks = launcher::size();
    const shrink_log calm = run_shrinking(dir.path() + "/calm", -1, -1);
    CHECK(calm.size_after == ranks);
    CHECK(calm.lost == std::vector<int>(calm.lost.size(), 0));
    REQUIRE(launcher::agree(true, "undisturbed run done"));
    const int culprit = ranks - 1;
    const shrink_log hit = run_shrinking(dir.path() + "/hit", culprit, 2);
    REQUIRE(me != culprit); // a killed culprit never gets here
    INFO("rank " << me << " of " << ranks << ", culprit " << culprit);
    CHECK(hit.size_after == ranks - 1);
    CHECK(hit.lost == std::vector<int>{0, 0, 1, 0, 0});
    CHECK(hit.params == calm.params);
    CHECK(hit.losses == calm.losses);
    std::vector<std::uint64_t> mine = hit.params;
    mine.push_back(hash_bits(hit.losses));
    CHECK(mine == rank0_values(mine));
}

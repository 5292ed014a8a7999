// data_parallel over nccl_communicator with one process per rank (the rank launcher, --ranks 2
// and 3; on one GPU the ranks are separate NCCL hosts over its socket transport), on the GPU
// trainer tests' network (gpu_test_net.hpp: three BN layers, user kernels): overlap on the
// side-stream split with bn::global and bn::group<2> layers; ranks issuing BN and bucket
// collectives in different host orders; every reduce policy against the host thread group with
// equal bits on every rank; reduce::reproducible with bn::ghost bit for bit against GPU thread
// groups of 1 and N replicas; a step captured in a CUDA graph; the straggler report naming a rank
// whose device is slow. Every case needs a GPU ([gpu]).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "device_delay.cuh"
#include "gpu_test_net.hpp"
#include "gpu_train_runner.hpp"
#include "nccl_rank_support.hpp"
#include "support/shared_gpu_group.cuh"

#include <catch2/catch.hpp>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

namespace {

using namespace lockstep;
using namespace lockstep_test::gpu_train;
using lockstep::testing::shared_gpu_communicator;
using lockstep::testing::shared_gpu_group;
using lockstep_test::nccl_ranks::aborting_on_failure;
using lockstep_test::nccl_ranks::hash_bits;
using lockstep_test::nccl_ranks::rank0_values;
using lockstep_test::nccl_ranks::rank_communicator;
using lockstep_test::nccl_ranks::rank_device;
namespace tn = lockstep_test::net;

/// gpu_train::train with the trainer's train_params given (read_result stays on, so every step
/// reads its loss); `overlaps`, when given, receives trainer.overlaps().
template <class Sync, class Reduce, class BN, class Comm>
run_log train_with(Comm& comm, int steps, std::size_t batch, train_params tp, tn::knobs k = {},
                   bool* overlaps = nullptr) {
    using net_t = tn::test_net<Comm, BN>;
    using system_type = typename Comm::system_type;
    using trainer_t = data_parallel<net_t, optim::sgd<float, system_type>, Sync, Reduce, Comm>;
    const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
    tp.read_result = true;
    run_log log;
    trainer_t trainer(
        comm, [&](auto& ctx) { return net_t(ctx, cap, k); }, {.lr = lr, .momentum = momentum},
        std::move(tp));
    if (overlaps != nullptr)
        *overlaps = trainer.overlaps();
    log.buckets = trainer.buckets().size();
    for (int s = 0; s < steps; ++s) {
        const step_result r =
            trainer.step(batch, [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); });
        log.losses.push_back(r.loss);
        log.params.push_back(to_host(std::span<const float>(trainer.parameters()), comm.system()));
    }
    trainer.finish();
    log.params.push_back(to_host(std::span<const float>(trainer.parameters()), comm.system()));
    return log;
}

/// This rank's run on a fresh communicator of every rank; its errors abort the communicator.
template <class F>
run_log on_ranks(F f) {
    auto comm = rank_communicator();
    return aborting_on_failure(comm, [&] { return f(comm); });
}

/// Checks that every rank holds rank 0's bits: parameters after every step and the losses,
/// compared by hash through the launcher (not through the communicator under test).
void check_bits_equal_rank0(const run_log& log) {
    std::vector<std::uint64_t> mine;
    for (const auto& p : log.params)
        mine.push_back(hash_bits(p));
    mine.push_back(hash_bits(log.losses));
    const std::vector<std::uint64_t> first = rank0_values(mine);
    INFO("rank " << lockstep_test::ranks::rank()
                 << " against rank 0: hashes of the parameters "
                    "after every step, then of the losses");
    CHECK(mine == first);
}

/// Checks this rank's log against the host thread group's replica of the same rank within tol
/// (absolute) on every parameter after every step and every loss.
void check_against_host(const run_log& gpu, const run_log& host, double tol) {
    REQUIRE(gpu.params.size() == host.params.size());
    for (std::size_t s = 0; s < gpu.params.size(); ++s) {
        INFO("rank " << lockstep_test::ranks::rank() << " after step " << s);
        CHECK(max_abs_diff(gpu.params[s], host.params[s]) <= tol);
    }
    REQUIRE(gpu.losses.size() == host.losses.size());
    for (std::size_t s = 0; s < gpu.losses.size(); ++s)
        CHECK(std::abs(gpu.losses[s] - host.losses[s]) <= tol);
}

int rank_count() {
    return lockstep_test::ranks::size();
}
std::size_t my_rank() {
    return static_cast<std::size_t>(lockstep_test::ranks::rank());
}

} // namespace

// Overlap always: buckets on the side-stream split (its own NCCL communicator) while the BN
// layers' collectives run on the compute stream's communicator. Tolerances as the GPU trainer
// cases (gpu_train_runner.hpp's combination): against the host thread group of as many replicas
// 2e-5 absolute after 4 steps (summation order, FMA contraction); bn::global also against the
// double reference, 1e-4 relative to (1 + |value|) (float rounding through three BN layers).
// bn::group<2> on 3 ranks: groups {0, 1} and {2} (a group of one).
TEMPLATE_TEST_CASE("NCCL ranks: a synchronous trainer overlapping on the side-stream split with "
                   "three BN layers equals the host thread group",
                   "[train][nccl][ranks][bn][gpu]", bn::global, bn::group<2>) {
    using BN = TestType;
    constexpr int steps = 4;
    constexpr std::size_t batch = 13; // uneven shards
    bool overlaps = false;
    const run_log mine = on_ranks([&](nccl_communicator& comm) {
        return train_with<sync::synchronous, small_buckets, BN>(
            comm, steps, batch, {.overlap = overlap_mode::always}, {}, &overlaps);
    });
    CHECK(overlaps);
    CHECK(mine.buckets >= 6);
    check_bits_equal_rank0(mine);
    const auto host = on_threads(rank_count(), [](thread_communicator& comm) {
        return train<sync::synchronous, small_buckets, BN>(comm, steps, batch);
    });
    check_against_host(mine, host[my_rank()], 2e-5);
    if constexpr (std::is_same_v<BN, bn::global>) {
        const auto [want, losses] = reference_run(steps, batch);
        for (int s = 0; s < steps; ++s) {
            INFO("step " << s);
            CHECK(std::abs(mine.losses[s] - losses[s]) <= 1e-4 * (1 + std::abs(losses[s])));
            check_against(mine.params[s], want[s], 1e-4);
        }
    }
}

// The odd ranks mark no gradient ready (knobs::skip_marks): they issue every bucket collective
// (side-stream split) after all BN backward collectives (compute stream), while the even ranks
// interleave them. NCCL_LAUNCH_ORDER_IMPLICIT launches each process's kernels in its own host
// order, which then differs between ranks: a BN collective waits on one rank for a peer whose
// device runs a bucket collective first, which waits in turn. The first GPU run (2026-12-04,
// H200, 2 ranks) deadlocked here, as NCCL documents for communicators used in different orders:
// lockstep does not yet reorder the launches, so the marks must be the same on every replica
// (docs/overlap.md). Until it does, the promise is that the step fails loudly, never hangs: every
// rank's step ends in lockstep::error (its wait's timeout, 3 s here, or the peer's abort) well
// within 30 s, and the error names the likely cause (detail::with_mark_order_hint). Every rank
// marking alike trains (the first case of this file checks the values).
TEST_CASE("NCCL ranks: ranks issuing BN and bucket collectives in different host orders fail "
          "with an error on every rank, never hang",
          "[train][nccl][ranks][order][gpu]") {
    constexpr int steps = 3;
    constexpr std::size_t batch = 12;
    const train_params tp{.overlap = overlap_mode::always};
    auto comm = rank_communicator({.timeout = std::chrono::seconds(3)});
    const auto start = std::chrono::steady_clock::now();
    bool threw = false;
    std::string what;
    try {
        aborting_on_failure(comm, [&] {
            const tn::knobs k{.skip_marks = comm.rank() % 2 == 1};
            return train_with<sync::synchronous, small_buckets, bn::global>(comm, steps, batch, tp,
                                                                            k);
        });
    } catch (const lockstep::error& e) {
        threw = true;
        what = e.what();
        CHECK((e.code() == errc::timeout || e.code() == errc::peer_failure));
        CHECK(what.find("mark_ready at the same program points") != std::string::npos);
    }
    const auto took = std::chrono::steady_clock::now() - start;
    INFO("rank " << my_rank() << ": " << what);
    CHECK(threw);
    CHECK(took < std::chrono::seconds(30));
}

namespace {
using reproducible_ghost_case =
    combination<sync::synchronous, reduce::reproducible<3>, bn::ghost<3>, 5>;
using sharded_global_case = combination<sync::synchronous, reduce::sharded<32, 16>, bn::global, 5>;
} // namespace

// Every reduce policy on the NCCL ranks against the host thread group of as many replicas, with
// the tolerances of gpu_train_runner.hpp's combination (2e-5 absolute after 4 steps; the
// bfloat16 wire 2e-3: a gradient element may round to the other neighbouring bfloat16 when host
// and device differ in its last float bits); on every rank the same bits as on rank 0.
TEMPLATE_TEST_CASE("NCCL ranks: every reduce policy equals the host thread group, with the same "
                   "bits on every rank",
                   "[train][nccl][ranks][thread][gpu]", per_tensor_case, bucketed_case,
                   sharded_global_case, bf16_case, reproducible_ghost_case) {
    using S = typename TestType::sync_policy;
    using R = typename TestType::reduce_policy;
    using B = typename TestType::bn_policy;
    constexpr int steps = 4;
    constexpr std::size_t batch = 11;
    const run_log mine =
        on_ranks([](nccl_communicator& comm) { return train<S, R, B>(comm, steps, batch); });
    check_bits_equal_rank0(mine);
    const auto host = on_threads(
        rank_count(), [](thread_communicator& comm) { return train<S, R, B>(comm, steps, batch); });
    check_against_host(mine, host[my_rank()], TestType::tolerance());
}

// reduce::reproducible sums exactly, so its bits depend neither on the replica count nor on the
// order NCCL folds in (3 ranks fold in another order than rank order): the ranks must equal
// bit for bit GPU thread groups (shared_gpu_group: the same device kernels, threads of this
// process) of 1 replica and of as many replicas as ranks, on this rank's device.
TEST_CASE("NCCL ranks: reduce::reproducible with bn::ghost gives the bits of 1 and N replicas of a "
          "GPU thread group",
          "[train][nccl][ranks][reproducible][gpu]") {
    constexpr int steps = 3;
    constexpr std::size_t batch = 12;
    using R = reduce::reproducible<2>;
    using B = bn::ghost<2>;
    const run_log mine = on_ranks(
        [](nccl_communicator& comm) { return train<sync::synchronous, R, B>(comm, steps, batch); });
    check_bits_equal_rank0(mine);
    const auto threads = [&](int replicas) {
        shared_gpu_group group(replicas, {.device = rank_device()});
        return run_logged(group, [](shared_gpu_communicator& comm) {
            return train<sync::synchronous, R, B>(comm, steps, batch);
        });
    };
    const auto one = threads(1);
    const auto same_count = threads(rank_count());
    require_clean(one);
    require_clean(same_count);
    INFO("rank " << my_rank());
    CHECK(mine.params == one[0].params);
    CHECK(mine.params == same_count[my_rank()].params);
}

namespace {
/// One warm-up step (NCCL connects; the layers, the buckets and the overlap split allocate and
/// split; the momentum buffer starts), then 3 steps: uncaptured, or one step captured in a CUDA
/// graph on the communicator's stream (thread-local capture mode: a capture-unsafe call of this
/// thread fails the capture; NCCL's own threads are left alone) and launched 3 times, each
/// launch counted (count_replay). The same batch every step (fixed_data): a launch replays the
/// captured step's host arguments.
run_log graph_run(nccl_communicator& comm, bool capture, overlap_mode overlap) {
    using net_t = tn::test_net<nccl_communicator, bn::global>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    small_buckets, nccl_communicator>;
    constexpr std::size_t batch = 12;
    const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
    trainer_t trainer(comm,
                      [&](auto& ctx) { return net_t(ctx, cap, tn::knobs{.fixed_data = true}); },
                      {.lr = lr, .momentum = momentum}, {.read_result = false, .overlap = overlap});
    const auto fn = [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); };
    (void)trainer.step(batch, fn);
    (void)trainer.read_result();
    if (!capture) {
        for (int s = 0; s < 3; ++s)
            (void)trainer.step(batch, fn);
        (void)trainer.read_result();
    } else {
        const cudaStream_t stream = comm.system().stream();
        LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        cudaGraph_t graph = nullptr;
        try {
            (void)trainer.step(batch, fn);
        } catch (...) {
            (void)cudaStreamEndCapture(stream, &graph);
            if (graph != nullptr)
                (void)cudaGraphDestroy(graph);
            throw;
        }
        LOCKSTEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int s = 0; s < 3; ++s) {
            LOCKSTEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
            (void)trainer.count_replay();
        }
        (void)trainer.read_result();
        LOCKSTEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
        LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    LOCKSTEP_REQUIRE(trainer.steps() == 4, errc::internal, comm.rank(), "graph_run",
                     "steps() = ", trainer.steps(), " after 4 steps (or 1 and 3 counted launches)");
    run_log log;
    log.params.push_back(to_host(std::span<const float>(trainer.parameters()), comm.system()));
    return log;
}
} // namespace

// The captured step replays the same kernels and collectives on the same data as the plain
// steps: equal within test_trainer_gpu's graph tolerance (1e-6 absolute: NCCL may pick another
// protocol inside a graph), and the same bits on every rank.
TEST_CASE("NCCL ranks: a synchronous step with bn::global captured in a CUDA graph on every rank "
          "and replayed 3 times equals 3 steps",
          "[train][nccl][ranks][graph][gpu]") {
    const overlap_mode overlap = GENERATE(overlap_mode::never, overlap_mode::always);
    INFO("overlap " << (overlap == overlap_mode::never ? "never" : "always"));
    const run_log plain =
        on_ranks([&](nccl_communicator& comm) { return graph_run(comm, false, overlap); });
    const run_log graph =
        on_ranks([&](nccl_communicator& comm) { return graph_run(comm, true, overlap); });
    REQUIRE(graph.params.size() == 1);
    REQUIRE(plain.params.size() == 1);
    CHECK(max_abs_diff(graph.params[0], plain.params[0]) <= 1e-6);
    check_bits_equal_rank0(graph);
}

// report_stragglers_every on NCCL ranks: the last rank's stream is held 50 ms in every step by
// a kernel (a slow GPU; its host is as fast as the others'). The report after 6 steps (window
// steps 3..5, timed with CUDA events on each rank's stream) names it with its lag within 20 %,
// the same report on every rank. The buckets overlap on the side-stream split:
// with bn::local the fast ranks' compute streams meet the slow one only where they wait for the
// side stream's buckets, a wait the timing must not count as their own work; with bn::global
// they meet it earlier, in the first BN collective. On one GPU the ranks' contexts time-slice
// it: a rank's own work may wait for another's time slice, milliseconds beside the delay.
TEMPLATE_TEST_CASE("NCCL ranks: the straggler report names the rank whose device is slow",
                   "[train][nccl][ranks][straggler][gpu]", bn::local, bn::global) {
    using net_t = tn::test_net<nccl_communicator, TestType>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    small_buckets, nccl_communicator>;
    constexpr std::chrono::milliseconds delay{50};
    constexpr std::size_t batch = 12;
    const int slow = rank_count() - 1;
    auto comm = rank_communicator();
    const std::optional<straggler_report> rep = aborting_on_failure(comm, [&] {
        const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
        trainer_t trainer(comm, [&](auto& ctx) { return net_t(ctx, cap); },
                          {.lr = lr, .momentum = momentum},
                          {.overlap = overlap_mode::always, .report_stragglers_every = 3});
        for (int s = 0; s < 6; ++s)
            (void)trainer.step(batch, [&](net_t& n, shard_range sr, auto& ctx) {
                if (comm.rank() == slow)
                    lockstep_test::device_delay(ctx.system().stream(), delay);
                n.train(sr, ctx);
            });
        trainer.finish();
        return trainer.straggler();
    });
    REQUIRE(rep);
    CHECK(rep->first_step == 3);
    CHECK(rep->last_step == 5);
    REQUIRE(rep->own_seconds.size() == static_cast<std::size_t>(rank_count()));
    INFO("rank " << my_rank() << ": own seconds per step " << rep->own_seconds[0] << ", ..., "
                 << rep->own_seconds.back());
    CHECK(rep->slowest == slow);
    CHECK(rep->lag_seconds == Approx(std::chrono::duration<double>(delay).count()).epsilon(0.2));
    std::vector<std::uint64_t> mine;
    for (const double x : rep->own_seconds)
        mine.push_back(std::bit_cast<std::uint64_t>(x));
    CHECK(mine == rank0_values(mine));
}

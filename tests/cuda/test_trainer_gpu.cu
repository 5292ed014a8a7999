// data_parallel on GPUs with the user's own device kernels (gpu_test_net.hpp): three bn::global
// layers and small buckets over NCCL against one replica and a double reference; every reducer
// and local SGD against the host thread group; the visitor path against the registry path; a
// replica failing mid-step; the host synchronisations per step; a step captured in a CUDA graph.
// Every case needs a GPU (tagged [gpu]); those about several replicas two or more ([multi_gpu]).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "cuda_test_support.hpp"
#include "gpu_test_net.hpp"
#include "gpu_train_runner.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace {

using namespace lockstep;
using namespace lockstep_test::gpu_train;
namespace tn = lockstep_test::net;

/// Runs f(comm) -> run_log on one replica per device of `devices` (all when empty) and returns
/// the logs by rank; a replica's lockstep::error is recorded in its log.
template <class F>
std::vector<run_log> on_gpus(F f, std::vector<int> devices = {},
                             std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    gpu_group group = devices.empty() ? gpu_group({.timeout = timeout})
                                      : gpu_group(std::move(devices), {.timeout = timeout});
    return run_logged(group, f);
}

} // namespace

// The network and the reference the GPU cases rely on, checked where no GPU is needed: the same
// functors on the host thread group (1 and 3 replicas) against the double reference, 1e-4
// relative to (1 + |value|).
TEST_CASE("the GPU tests' network on the host thread group equals its double reference",
          "[train][thread]") {
    constexpr int steps = 4;
    constexpr std::size_t batch = 13;
    const auto [want, losses] = reference_run(steps, batch);
    for (const int replicas : {1, 3}) {
        const auto logs = on_threads(replicas, [](thread_communicator& comm) {
            return train<sync::synchronous, small_buckets, bn::global>(comm, steps, batch);
        });
        check_bitwise_replicas(logs);
        CHECK(logs[0].buckets >= 6);
        for (int s = 0; s < steps; ++s) {
            INFO(replicas << " replicas, step " << s);
            CHECK(std::abs(logs[0].losses[s] - losses[s]) <= 1e-4 * (1 + std::abs(losses[s])));
            check_against(logs[0].params[s], want[s], 1e-4);
        }
    }
}

namespace {
constexpr int bn3_steps = 4;
constexpr std::size_t bn3_batch = 13; // uneven shards
/// Three bn::global layers with user kernels and small buckets on one replica per device of
/// `devices` (all when empty).
std::vector<run_log> bn3_run(std::vector<int> devices = {}) {
    return on_gpus(
        [](nccl_communicator& comm) {
            return train<sync::synchronous, small_buckets, bn::global>(comm, bn3_steps, bn3_batch);
        },
        std::move(devices));
}
} // namespace

// (a) Tolerance against the double reference: float rounding of the forward/backward chain
// through three BN layers, 1e-4 relative to (1 + |value|).
TEST_CASE("GPU trainer: three bn::global layers, user kernels, small buckets: one replica equals "
          "the double reference",
          "[train][nccl][bn][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const auto one = bn3_run({0});
    require_clean(one);
    CHECK(one[0].buckets >= 6);
    const auto [want, losses] = reference_run(bn3_steps, bn3_batch);
    for (int s = 0; s < bn3_steps; ++s) {
        INFO("step " << s);
        CHECK(std::abs(one[0].losses[s] - losses[s]) <= 1e-4 * (1 + std::abs(losses[s])));
        check_against(one[0].params[s], want[s], 1e-4);
    }
}

// (a) Tolerances: N replicas against one replica with the whole batch: the same float kernels
// on shards; BN's merged statistics and the NCCL sums differ only in summation order: 1e-5
// absolute on O(1) parameters after 4 steps. Against the double reference as above.
TEST_CASE("GPU trainer: three bn::global layers, user kernels, small buckets: N replicas equal "
          "one and the double reference",
          "[train][nccl][bn][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    const auto many = bn3_run();
    const auto one = bn3_run({0});
    require_clean(many);
    require_clean(one);
    REQUIRE(many.size() >= 2);
    check_bitwise_replicas(many);
    CHECK(many[0].buckets >= 6);

    const auto [want, losses] = reference_run(bn3_steps, bn3_batch);
    for (int s = 0; s < bn3_steps; ++s) {
        INFO("step " << s);
        CHECK(max_abs_diff(many[0].params[s], one[0].params[s]) <= 1e-5);
        CHECK(std::abs(many[0].losses[s] - one[0].losses[s]) <= 1e-5);
        CHECK(std::abs(many[0].losses[s] - losses[s]) <= 1e-4 * (1 + std::abs(losses[s])));
        check_against(many[0].params[s], want[s], 1e-4);
    }
}

TEMPLATE_TEST_CASE("GPU trainer: every reducer and local SGD over NCCL equal the host thread group",
                   "[train][nccl][thread][gpu]", per_tensor_case, bucketed_case, ps_case, bf16_case,
                   local_sgd_case) {
    if (lockstep_test::skip_without_gpu())
        return;
    using S = typename TestType::sync_policy;
    using R = typename TestType::reduce_policy;
    using B = typename TestType::bn_policy;
    constexpr int steps = 4;
    constexpr std::size_t batch = 11;
    const auto gpu =
        on_gpus([](nccl_communicator& comm) { return train<S, R, B>(comm, steps, batch); });
    require_clean(gpu);
    const auto host = on_threads(static_cast<int>(gpu.size()), [](thread_communicator& comm) {
        return train<S, R, B>(comm, steps, batch);
    });
    for (std::size_t r = 0; r < gpu.size(); ++r) {
        REQUIRE(gpu[r].params.size() == host[r].params.size());
        for (std::size_t s = 0; s < gpu[r].params.size(); ++s) {
            INFO("replica " << r << " after step " << s);
            CHECK(max_abs_diff(gpu[r].params[s], host[r].params[s]) <= TestType::tolerance());
        }
        for (std::size_t s = 0; s < gpu[r].losses.size(); ++s)
            CHECK(std::abs(gpu[r].losses[s] - host[r].losses[s]) <= TestType::tolerance());
    }
    if constexpr (std::is_same_v<S, sync::synchronous>)
        check_bitwise_replicas(gpu);
}

TEST_CASE("GPU trainer: the visitor path over the network's own device buffers equals the "
          "registry path bit for bit",
          "[train][nccl][visitor][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const auto registry = on_gpus([](nccl_communicator& comm) {
        return train<sync::synchronous, small_buckets, bn::global, false>(comm, 4, 10);
    });
    const auto visitor = on_gpus([](nccl_communicator& comm) {
        return train<sync::synchronous, small_buckets, bn::global, true>(comm, 4, 10);
    });
    require_clean(registry);
    require_clean(visitor);
    for (std::size_t r = 0; r < registry.size(); ++r) {
        CHECK(visitor[r].params == registry[r].params);
        CHECK(visitor[r].losses == registry[r].losses);
    }
}

namespace {
/// Replica `thrower` of one replica per device of `devices` (all when empty) throws after bn1's
/// forward in step 1: the logs, and whether every replica ended within the 20 s timeout.
std::pair<std::vector<run_log>, bool> throwing_run(int thrower, std::vector<int> devices = {}) {
    const auto timeout = std::chrono::seconds(20);
    const auto start = std::chrono::steady_clock::now();
    auto logs = on_gpus(
        [&](nccl_communicator& comm) {
            return train<sync::synchronous, small_buckets, bn::global>(
                comm, 4, 12, tn::knobs{.throw_at_step = 1, .throw_rank = thrower});
        },
        std::move(devices), timeout);
    return {std::move(logs), std::chrono::steady_clock::now() - start < timeout};
}

/// The thrower's log holds its own failure.
void check_thrower(const run_log& log) {
    INFO("the thrower: " << log.error);
    REQUIRE(log.failed);
    CHECK(log.code == errc::internal);
    CHECK(log.error.find("failure injected after bn1's forward in step 1") != std::string::npos);
}
} // namespace

TEST_CASE("GPU trainer: a replica throwing mid-step (after a BN forward) ends with its own error",
          "[train][nccl][failure][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const auto [logs, in_time] = throwing_run(0, {0});
    CHECK(in_time);
    REQUIRE(logs.size() == 1);
    check_thrower(logs[0]);
}

TEST_CASE("GPU trainer: a replica throwing mid-step (after a BN forward) ends as an error on "
          "every replica, never a hang",
          "[train][nccl][failure][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    constexpr int thrower = 1;
    const auto [logs, in_time] = throwing_run(thrower);
    CHECK(in_time);
    REQUIRE(logs.size() >= 2);
    for (std::size_t r = 0; r < logs.size(); ++r) {
        if (static_cast<int>(r) == thrower) {
            check_thrower(logs[r]);
            continue;
        }
        INFO("replica " << r << ": " << logs[r].error);
        REQUIRE(logs[r].failed);
        CHECK(logs[r].code == errc::peer_failure);
    }
}

TEST_CASE("GPU trainer: a step with three bn::global layers waits on the host once with "
          "read_result, never without",
          "[train][nccl][sync][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    for (const bool read_each : {true, false}) {
        const auto logs = on_gpus([&](nccl_communicator& comm) {
            return train<sync::synchronous, small_buckets, bn::global>(comm, 3, 12, {}, read_each);
        });
        require_clean(logs);
        INFO("read_result = " << read_each);
        for (const auto& l : logs)
            // The first step adds each BN layer's settings check (one host wait per layer).
            CHECK(l.syncs == std::vector<std::uint64_t>{read_each ? 4u : 3u, read_each ? 1u : 0u,
                                                        read_each ? 1u : 0u});
    }
}

namespace {
/// One warm-up step (it allocates the layers' workspaces and makes the momentum buffer's first
/// step), then 3 steps: uncaptured, or one step captured in a CUDA graph on the communicator's
/// stream and launched 3 times, each launch counted (count_replay). The data is the same batch
/// every step (fixed_data), since a captured step replays its host-side arguments.
run_log graph_run(nccl_communicator& comm, bool capture) {
    using net_t = tn::test_net<nccl_communicator, bn::global>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    small_buckets, nccl_communicator>;
    constexpr std::size_t batch = 12;
    const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
    trainer_t trainer(comm,
                      [&](auto& ctx) { return net_t(ctx, cap, tn::knobs{.fixed_data = true}); },
                      {.lr = lr, .momentum = momentum}, {.read_result = false});
    const auto fn = [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); };
    (void)trainer.step(batch, fn);
    (void)trainer.read_result();
    run_log log;
    if (!capture) {
        for (int s = 0; s < 3; ++s)
            (void)trainer.step(batch, fn);
        comm.synchronize();
    } else {
        const cudaStream_t stream = comm.system().stream();
        LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
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
        comm.synchronize();
        LOCKSTEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
        LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    LOCKSTEP_REQUIRE(trainer.steps() == 4, errc::internal, comm.rank(), "graph_run",
                     "steps() = ", trainer.steps(), " after 4 steps (or 1 and 3 counted launches)");
    log.params.push_back(to_host(std::span<const float>(trainer.parameters()), comm.system()));
    return log;
}
} // namespace

// The captured step replays the same kernels and collectives on the same data as the uncaptured
// steps: equal up to NCCL choosing another protocol inside a graph (1e-6 absolute).
TEST_CASE("GPU trainer: a synchronous step with bn::global captured in a CUDA graph and replayed "
          "3 times equals 3 steps",
          "[train][nccl][graph][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const auto plain = on_gpus([](nccl_communicator& comm) { return graph_run(comm, false); });
    const auto graph = on_gpus([](nccl_communicator& comm) { return graph_run(comm, true); });
    require_clean(plain);
    require_clean(graph);
    for (std::size_t r = 0; r < plain.size(); ++r)
        CHECK(max_abs_diff(graph[r].params.back(), plain[r].params.back()) <= 1e-6);
}

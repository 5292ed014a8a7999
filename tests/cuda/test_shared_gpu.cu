// Several replicas on ONE GPU (tests/support/shared_gpu_group.cuh: threads with their own streams,
// device collectives in the thread group's rank order): the communicator against the collective
// suite and bit for bit against lockstep::thread_group; then the GPU trainer cases of
// test_trainer_gpu.cu with 2-4 replicas where NCCL could run only one: three bn::global layers
// against one replica and a double reference, every reducer, local SGD, bn::group, the sharded
// and reproducible policies against the host thread group, a throwing replica, the host
// synchronisations and collectives per step; test_bn_nccl.cu's 16-bit batch norm in NHWC and NCHW;
// one step of every replica captured as one CUDA graph; save_checkpoint_async's side-stream
// snapshot. Every case needs a GPU (tagged [gpu]). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"
#include "lockstep/train/async_checkpoint.hpp"
#include "lockstep/train/checkpoint.hpp"

#include "bn_gpu_cases.hpp"
#include "comm/collective_suite.hpp"
#include "cuda_test_support.hpp"
#include "gpu_train_runner.hpp"
#include "support/counting_communicator.hpp"
#include "support/shared_gpu_group.cuh"

#include <catch2/catch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

// The test communicator folds arithmetic types only; the suite's half/bfloat16 checks are for
// lockstep's own communicators.
namespace lockstep::testing {
template <>
inline constexpr bool float16_collectives<shared_gpu_communicator> = false;
} // namespace lockstep::testing

namespace {

using namespace lockstep;
using namespace lockstep_test::gpu_train;
using lockstep::testing::shared_gpu_communicator;
using lockstep::testing::shared_gpu_group;
using lockstep_test::bn_gpu::format_case;
namespace tn = lockstep_test::net;

/// Trainer runs on `replicas` replicas sharing device 0; logs by rank.
template <class F>
std::vector<run_log> on_shared_gpu(int replicas, F f,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    shared_gpu_group group(replicas, {.timeout = timeout});
    return run_logged(group, f);
}

/// One replica's results of the collectives compared with the thread group: all_reduce out of
/// place and in place, reduce to root 1 and an uneven reduce_scatter, each for sum, max, min.
template <class T>
struct collective_results {
    std::vector<std::vector<T>> out;
};

template <class T, class Comm>
collective_results<T> run_collectives(Comm& comm) {
    constexpr std::size_t count = 10007; // over the thread group's 4 KiB stash: its chunked path
    const int n = comm.size(), me = comm.rank();
    std::vector<T> mine(count);
    for (std::size_t i = 0; i < count; ++i)
        mine[i] = lockstep::testing::input_value<T>(me, i);
    std::vector<std::size_t> counts(static_cast<std::size_t>(n));
    std::size_t total = 0;
    for (int r = 0; r < n; ++r) {
        counts[static_cast<std::size_t>(r)] = r == 1 ? 0 : 1000 + 37 * static_cast<std::size_t>(r);
        total += counts[static_cast<std::size_t>(r)];
    }
    const auto sys = comm.system();
    using S = typename Comm::system_type;
    const auto upload = [&](const std::vector<T>& h) {
        buffer<T, S> b(h.size(), sys);
        copy(std::span<const T>(h), host_system{}, b.span(), sys);
        return b;
    };
    const auto download = [&](const buffer<T, S>& b) {
        return to_host(std::span<const T>(b.span()), sys);
    };
    collective_results<T> res;
    for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
        auto send = upload(mine);
        buffer<T, S> recv(count, sys);
        comm.all_reduce(std::span<const T>(send.span()), recv.span(), op);
        res.out.push_back(download(recv));
        comm.all_reduce(std::span<const T>(send.span()), send.span(), op); // in place
        res.out.push_back(download(send));
        auto root_send = upload(mine);
        buffer<T, S> root_recv(me == 1 % n ? count : 0, sys);
        comm.reduce(std::span<const T>(root_send.span()), root_recv.span(), op, 1 % n);
        res.out.push_back(download(root_recv));
        auto scatter = upload(std::vector<T>(mine.begin(), mine.begin() + total));
        buffer<T, S> part(counts[static_cast<std::size_t>(me)], sys);
        comm.reduce_scatter(std::span<const T>(scatter.span()), part.span(),
                            std::span<const std::size_t>(counts), op);
        res.out.push_back(download(part));
    }
    return res;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

} // namespace

TEST_CASE("shared_gpu_group refuses a size it cannot run", "[comm][shared_gpu]") {
    CHECK_THROWS_AS(shared_gpu_group(0), lockstep::error);
    CHECK_THROWS_AS(shared_gpu_group(17), lockstep::error);
}

// The suite's float and double sums are the rank-order references bit for bit
// (suite_options::rank_order_sums), everything else exact; 5 replicas reach the fold past the
// thread group's unrolled four sources.
TEST_CASE("shared_gpu_group passes the collective suite on one GPU", "[comm][shared_gpu][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const int n = GENERATE(1, 2, 3, 4, 5);
    CAPTURE(n);
    shared_gpu_group group(n);
    std::vector<lockstep::testing::suite_report> reports(static_cast<std::size_t>(n));
    group.run([&](shared_gpu_communicator& comm) {
        reports[static_cast<std::size_t>(comm.rank())] =
            lockstep::testing::run_collective_suite(comm);
    });
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.rank >= 0);
        CHECK(r.failed == 0);
        CHECK(r.checks > 200);
    }
}

TEMPLATE_TEST_CASE("shared_gpu_communicator's reductions equal lockstep::thread_group's bit for "
                   "bit on the same per-replica inputs",
                   "[comm][shared_gpu][thread][gpu]", float, double) {
    if (lockstep_test::skip_without_gpu())
        return;
    using T = TestType;
    const int n = GENERATE(2, 3, 4, 5);
    CAPTURE(n);
    std::vector<collective_results<T>> gpu(static_cast<std::size_t>(n)),
        host(static_cast<std::size_t>(n));
    shared_gpu_group(n).run([&](shared_gpu_communicator& comm) {
        gpu[static_cast<std::size_t>(comm.rank())] = run_collectives<T>(comm);
    });
    thread_group(n).run([&](thread_communicator& comm) {
        host[static_cast<std::size_t>(comm.rank())] = run_collectives<T>(comm);
    });
    for (int r = 0; r < n; ++r) {
        const auto& g = gpu[static_cast<std::size_t>(r)].out;
        const auto& h = host[static_cast<std::size_t>(r)].out;
        REQUIRE(g.size() == h.size());
        for (std::size_t k = 0; k < g.size(); ++k) {
            INFO("replica " << r << ", result " << k << " (op " << k / 4 << ", call " << k % 4
                            << ")");
            CHECK(same_bits(g[k], h[k]));
        }
    }
}

TEST_CASE("a shared_gpu_group replica that throws releases its peers with errc::peer_failure",
          "[comm][shared_gpu][failure][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    std::vector<errc> codes(3, errc::internal);
    std::vector<bool> threw(3, false);
    const auto start = std::chrono::steady_clock::now();
    try {
        shared_gpu_group(3, {.timeout = std::chrono::seconds(20)})
            .run([&](shared_gpu_communicator& comm) {
                const auto r = static_cast<std::size_t>(comm.rank());
                try {
                    buffer<float, cuda_system> b(64, comm.system());
                    comm.all_reduce(std::span<const float>(b.span()), b.span(), reduce_op::sum);
                    if (comm.rank() == 2)
                        fail(errc::invalid_argument, comm.rank(), "test", "injected");
                    comm.all_reduce(std::span<const float>(b.span()), b.span(), reduce_op::sum);
                    comm.synchronize();
                } catch (const error& e) {
                    threw[r] = true;
                    codes[r] = e.code();
                    throw;
                }
            });
        FAIL("run() returned although a replica threw");
    } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument); // the root cause, not a peer's failure
    }
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
    CHECK(threw == std::vector<bool>{true, true, true});
    CHECK(codes ==
          std::vector<errc>{errc::peer_failure, errc::peer_failure, errc::invalid_argument});
}

// The trainer cases. Tolerances as in test_trainer_gpu.cu: N replicas against one replica with
// the whole batch differ in BN's merged statistics and the summation order (1e-5 absolute after
// 4 steps); against the double reference, float rounding through three BN layers (1e-4 relative
// to 1 + |value|).
TEST_CASE("shared GPU trainer: three bn::global layers, user kernels, interleaved buckets: 2-4 "
          "replicas equal one and the double reference",
          "[train][shared_gpu][bn][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    constexpr int steps = 4;
    constexpr std::size_t batch = 13; // uneven shards
    const auto run = [](shared_gpu_communicator& comm) {
        return train<sync::synchronous, small_buckets, bn::global>(comm, steps, batch);
    };
    const auto one = on_shared_gpu(1, run);
    require_clean(one);
    const auto [want, losses] = reference_run(steps, batch);
    for (const int replicas : {2, 3, 4}) {
        const auto many = on_shared_gpu(replicas, run);
        require_clean(many);
        check_bitwise_replicas(many);
        CHECK(many[0].buckets >= 6);
        for (int s = 0; s < steps; ++s) {
            INFO(replicas << " replicas, step " << s);
            CHECK(max_abs_diff(many[0].params[s], one[0].params[s]) <= 1e-5);
            CHECK(std::abs(many[0].losses[s] - one[0].losses[s]) <= 1e-5);
            CHECK(std::abs(many[0].losses[s] - losses[s]) <= 1e-4 * (1 + std::abs(losses[s])));
            check_against(many[0].params[s], want[s], 1e-4);
        }
    }
}

namespace {
using group_case = combination<sync::synchronous, small_buckets, bn::group<2>, 5>;
using sharded_case = combination<sync::synchronous, reduce::sharded<32, 16>, bn::global, 5>;
using reproducible_case = combination<sync::synchronous, reduce::reproducible<3>, bn::ghost<3>, 5>;
} // namespace

// 4 replicas (bn::group<2>: two groups of two); tolerances of combination (gpu_train_runner.hpp).
TEMPLATE_TEST_CASE("shared GPU trainer: every reducer, local SGD, bn::group, sharded and "
                   "reproducible on 4 replicas of one GPU equal the host thread group",
                   "[train][shared_gpu][thread][gpu]", per_tensor_case, bucketed_case, ps_case,
                   bf16_case, local_sgd_case, group_case, sharded_case, reproducible_case) {
    if (lockstep_test::skip_without_gpu())
        return;
    using S = typename TestType::sync_policy;
    using R = typename TestType::reduce_policy;
    using B = typename TestType::bn_policy;
    constexpr int replicas = 4;
    constexpr int steps = 4;
    constexpr std::size_t batch = 11;
    const auto gpu = on_shared_gpu(
        replicas, [](shared_gpu_communicator& comm) { return train<S, R, B>(comm, steps, batch); });
    require_clean(gpu);
    const auto host = on_threads(
        replicas, [](thread_communicator& comm) { return train<S, R, B>(comm, steps, batch); });
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

TEST_CASE("shared GPU trainer: reduce::reproducible gives the same bits on 1, 2 and 4 replicas",
          "[train][shared_gpu][reproducible][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const auto run = [](shared_gpu_communicator& comm) {
        return train<sync::synchronous, reduce::reproducible<2>, bn::ghost<2>>(comm, 3, 12);
    };
    const auto one = on_shared_gpu(1, run);
    require_clean(one);
    for (const int replicas : {2, 4}) {
        const auto many = on_shared_gpu(replicas, run);
        require_clean(many);
        for (std::size_t r = 0; r < many.size(); ++r) {
            INFO(replicas << " replicas, replica " << r);
            CHECK(many[r].params == one[0].params);
        }
    }
}

TEST_CASE("shared GPU trainer: verify_every passes a healthy run and names one flipped bit in "
          "device memory on every replica",
          "[train][shared_gpu][verify][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    using net_t = tn::test_net<shared_gpu_communicator, bn::global>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    small_buckets, shared_gpu_communicator>;
    constexpr int odd = 2;
    constexpr std::size_t batch = 12;
    const auto logs = on_shared_gpu(3, [&](shared_gpu_communicator& comm) {
        const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
        trainer_t trainer(comm, [&](auto& ctx) { return net_t(ctx, cap); },
                          {.lr = lr, .momentum = momentum}, {.verify_every = 1});
        const auto fn = [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); };
        (void)trainer.step(batch, fn); // checked: every replica agrees
        (void)trainer.step(batch, fn);
        if (comm.rank() == odd) {
            // One bit of parameter 4, in device memory, on one replica.
            auto values = trainer.registry().values();
            float v = 0;
            LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(comm.system().stream()));
            LOCKSTEP_CUDA_CHECK(
                cudaMemcpy(&v, values.data() + 4, sizeof v, cudaMemcpyDeviceToHost));
            v = std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) ^ (1u << 15));
            LOCKSTEP_CUDA_CHECK(
                cudaMemcpy(values.data() + 4, &v, sizeof v, cudaMemcpyHostToDevice));
        }
        (void)trainer.step(batch, fn); // checked: replica `odd` differs
        return run_log{};
    });
    for (std::size_t r = 0; r < logs.size(); ++r) {
        INFO("replica " << r << ": " << logs[r].error);
        REQUIRE(logs[r].failed);
        CHECK(logs[r].code == errc::divergence);
        CHECK(logs[r].error.find("after step 3 replica 2 holds other values than replicas 0, 1: "
                                 "first in tensor 'param.") != std::string::npos);
        CHECK(logs[r].error.find("(bits 0x") != std::string::npos);
    }
}

TEST_CASE("shared GPU trainer: a replica throwing mid-step (after a BN forward) ends as an error "
          "on every replica, never a hang",
          "[train][shared_gpu][failure][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    constexpr int thrower = 1;
    const auto timeout = std::chrono::seconds(20);
    const auto start = std::chrono::steady_clock::now();
    const auto logs = on_shared_gpu(
        3,
        [&](shared_gpu_communicator& comm) {
            return train<sync::synchronous, small_buckets, bn::global>(
                comm, 4, 12, tn::knobs{.throw_at_step = 1, .throw_rank = thrower});
        },
        timeout);
    CHECK(std::chrono::steady_clock::now() - start < timeout);
    for (std::size_t r = 0; r < logs.size(); ++r) {
        INFO("replica " << r << ": " << logs[r].error);
        REQUIRE(logs[r].failed);
        if (static_cast<int>(r) == thrower) {
            CHECK(logs[r].code == errc::internal);
            CHECK(logs[r].error.find("failure injected after bn1's forward in step 1") !=
                  std::string::npos);
        } else {
            CHECK(logs[r].code == errc::peer_failure);
        }
    }
}

namespace {
/// Collectives per step of a synchronous step with three bn::global layers, counted by
/// counting_communicator around Comm (steps after the first: the first also agrees on the
/// setup).
template <class Comm>
std::vector<int> collectives_per_step(Comm& inner) {
    using comm_t = lockstep::testing::counting_communicator<Comm>;
    using net_t = tn::test_net<comm_t, bn::global>;
    using system_type = typename Comm::system_type;
    using trainer_t = data_parallel<net_t, optim::sgd<float, system_type>, sync::synchronous,
                                    small_buckets, comm_t>;
    comm_t comm(inner);
    constexpr std::size_t batch = 12;
    const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
    trainer_t trainer(comm, [&](auto& ctx) { return net_t(ctx, cap); },
                      {.lr = lr, .momentum = momentum}, {.read_result = true});
    std::vector<int> counts;
    for (int s = 0; s < 3; ++s) {
        comm.reset();
        (void)trainer.step(batch, [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); });
        counts.push_back(comm.counts().collectives());
    }
    return counts;
}
} // namespace

// The device path must not add host waits (1 per step with read_result, else 0: what the host
// thread group counts on the same path) nor collectives (the thread group's count per step).
TEST_CASE("shared GPU trainer: a step with three bn::global layers waits on the host once with "
          "read_result, never without, and makes the thread group's collectives",
          "[train][shared_gpu][sync][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    for (const bool read_each : {true, false}) {
        const auto logs = on_shared_gpu(3, [&](shared_gpu_communicator& comm) {
            return train<sync::synchronous, small_buckets, bn::global>(comm, 3, 12, {}, read_each);
        });
        require_clean(logs);
        const auto host = on_threads(3, [&](thread_communicator& comm) {
            return train<sync::synchronous, small_buckets, bn::global>(comm, 3, 12, {}, read_each);
        });
        INFO("read_result = " << read_each);
        for (std::size_t r = 0; r < logs.size(); ++r) {
            // The first step adds each BN layer's settings check (one host wait per layer).
            CHECK(logs[r].syncs == std::vector<std::uint64_t>{read_each ? 4u : 3u,
                                                              read_each ? 1u : 0u,
                                                              read_each ? 1u : 0u});
            CHECK(logs[r].syncs == host[r].syncs);
        }
    }
    std::vector<std::vector<int>> gpu(3), host(3);
    shared_gpu_group(3).run([&](shared_gpu_communicator& comm) {
        gpu[static_cast<std::size_t>(comm.rank())] = collectives_per_step(comm);
    });
    thread_group(3).run([&](thread_communicator& comm) {
        host[static_cast<std::size_t>(comm.rank())] = collectives_per_step(comm);
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO("replica " << r);
        CHECK(gpu[r] == host[r]);
        CHECK(gpu[r][1] > 0);
    }
}

// bn::global's statistics over 3 replicas of one GPU; tolerances: bn_gpu_cases.hpp.
TEMPLATE_TEST_CASE("shared GPU: batch_norm<bn::global> with native 16-bit storage on 3 replicas "
                   "matches a float reference",
                   "[nn][bn][shared_gpu][gpu]", (format_case<__half, nn::nhwc>),
                   (format_case<__half, nn::nchw>), (format_case<__nv_bfloat16, nn::nhwc>),
                   (format_case<__nv_bfloat16, nn::nchw>)) {
    if (lockstep_test::skip_without_gpu())
        return;
    shared_gpu_group group(3);
    lockstep_test::bn_gpu::check_16bit_layer<typename TestType::storage, typename TestType::layout>(
        group);
}

namespace {
/// A host barrier for the graph case's hand-offs outside the communicator (whose own collectives
/// would record events the capture cannot wait for): a replica that fails marks it, and a wait
/// past the timeout or after a failure throws instead of hanging.
class hand_off {
public:
    explicit hand_off(int n) : n_(n) {}
    void fail() {
        const std::lock_guard lock(mutex_);
        failed_ = true;
        cv_.notify_all();
    }
    void arrive_and_wait(int replica) {
        std::unique_lock lock(mutex_);
        const std::uint64_t gen = generation_;
        if (!failed_ && ++arrived_ == n_) {
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        const bool in_time = cv_.wait_for(lock, std::chrono::seconds(60),
                                          [&] { return generation_ != gen || failed_; });
        if (generation_ != gen)
            return;
        failed_ = true;
        cv_.notify_all();
        lockstep::fail(in_time ? errc::peer_failure : errc::timeout, replica, "graph hand-off",
                       in_time ? "another replica failed" : "timed out");
    }

private:
    std::mutex mutex_;
    std::condition_variable cv_;
    int n_;
    int arrived_ = 0;
    std::uint64_t generation_ = 0;
    bool failed_ = false;
};

/// One warm-up step, then 3 steps: uncaptured, or every replica's step captured into ONE graph
/// and replayed 3 times. Replica 0 begins the capture on its stream and records `fork`; every
/// other stream waits for `fork`, which joins it to the capture, so the collectives' events
/// between the replicas' streams stay inside one capture; after the step replica 0's stream
/// waits for every other stream's `join` event and replica 0 ends the capture and launches the
/// graph (all replicas' work) 3 times. fixed_data: a replay repeats the step's host arguments.
run_log shared_graph_run(shared_gpu_communicator& comm, bool capture, hand_off& h, cuda_event& fork,
                         std::vector<cuda_event>& join) {
    using net_t = tn::test_net<shared_gpu_communicator, bn::global>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    small_buckets, shared_gpu_communicator>;
    constexpr std::size_t batch = 12;
    const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
    // The buckets are reduced inline: a communication thread cannot enqueue into a capture
    // (data_parallel::step refuses it), and this communicator's overlap would use one.
    trainer_t trainer(
        comm, [&](auto& ctx) { return net_t(ctx, cap, tn::knobs{.fixed_data = true}); },
        {.lr = lr, .momentum = momentum}, {.read_result = false, .overlap = overlap_mode::never});
    const auto fn = [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); };
    (void)trainer.step(batch, fn);
    (void)trainer.read_result();
    comm.synchronize();
    const cuda_system sys = comm.system();
    const int me = comm.rank();
    if (!capture) {
        for (int s = 0; s < 3; ++s)
            (void)trainer.step(batch, fn);
        comm.synchronize();
    } else {
        h.arrive_and_wait(me);
        cudaGraph_t graph = nullptr;
        if (me == 0) {
            LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(sys.stream(), cudaStreamCaptureModeRelaxed));
            fork.record(sys);
        }
        try {
            h.arrive_and_wait(me);
            if (me != 0)
                fork.make_wait(sys); // joins the capture
            h.arrive_and_wait(me);
            (void)trainer.step(batch, fn);
            if (me != 0)
                join[static_cast<std::size_t>(me)].record(sys);
            h.arrive_and_wait(me);
            if (me == 0) {
                for (int r = 1; r < comm.size(); ++r)
                    join[static_cast<std::size_t>(r)].make_wait(sys);
                LOCKSTEP_CUDA_CHECK(cudaStreamEndCapture(sys.stream(), &graph));
            }
        } catch (...) {
            if (me == 0) {
                (void)cudaStreamEndCapture(sys.stream(), &graph);
                if (graph != nullptr)
                    (void)cudaGraphDestroy(graph);
            }
            throw;
        }
        if (me == 0) {
            cudaGraphExec_t exec = nullptr;
            LOCKSTEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            for (int s = 0; s < 3; ++s)
                LOCKSTEP_CUDA_CHECK(cudaGraphLaunch(exec, sys.stream()));
            comm.synchronize();
            LOCKSTEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
            LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
        }
        h.arrive_and_wait(me);
        // Every replica's captured step ran in each of the 3 launches: each trainer counts them.
        for (int s = 0; s < 3; ++s)
            (void)trainer.count_replay();
    }
    LOCKSTEP_REQUIRE(trainer.steps() == 4, errc::internal, me, "shared_graph_run",
                     "steps() = ", trainer.steps(), " after 4 steps (or 1 and 3 counted launches)");
    run_log log;
    log.params.push_back(to_host(std::span<const float>(trainer.parameters()), sys));
    return log;
}
} // namespace

// The graph replays the same kernels and collectives on the same data as the uncaptured steps,
// and this communicator's reductions fold the replicas in rank order whatever the timing (no
// NCCL, whose protocol may change inside a graph: test_trainer_gpu's tolerance does not apply):
// the same bits.
TEST_CASE("shared GPU trainer: one synchronous step of 3 replicas captured as ONE CUDA graph and "
          "replayed 3 times equals 3 steps",
          "[train][shared_gpu][graph][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    constexpr int replicas = 3;
    const auto run = [&](bool capture) {
        hand_off h(replicas);
        cuda_event fork(0);
        std::vector<cuda_event> join;
        for (int r = 0; r < replicas; ++r)
            join.emplace_back(0);
        return on_shared_gpu(replicas, [&](shared_gpu_communicator& comm) {
            try {
                return shared_graph_run(comm, capture, h, fork, join);
            } catch (...) {
                h.fail();
                throw;
            }
        });
    };
    const auto plain = run(false);
    const auto graph = run(true);
    require_clean(plain);
    require_clean(graph);
    for (std::size_t r = 0; r < plain.size(); ++r) {
        INFO("replica " << r);
        CHECK(same_bits(graph[r].params.back(), plain[r].params.back()));
    }
}

TEST_CASE("shared GPU trainer: save_checkpoint_async copies on a side stream the state of its "
          "step, which loads and resumes as the trainer ran on",
          "[train][checkpoint][shared_gpu][gpu]") {
    // 2 replicas, bn::global and momentum: 3 steps, a blocking save and an asynchronous one at the
    // same boundary, then 3 steps enqueued at once (their kernels wait for the side stream's
    // copies, the host for nothing), then wait_checkpoint. Both checkpoints load to the
    // parameters after step 3, and the trainer resumed from the asynchronous one reaches the
    // first trainer's parameters after step 6 bit for bit (momentum and BN statistics were
    // copied at step 3 too). A snapshot that let step 4 run first would differ.
    if (lockstep_test::skip_without_gpu())
        return;
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() /
                         ("lockstep_gpu_ckpt_" + std::to_string(static_cast<long>(::getpid())));
    fs::remove_all(dir);
    fs::create_directories(dir);
    constexpr std::size_t batch = 24;
    const auto logs = on_shared_gpu(2, [&](shared_gpu_communicator& comm) {
        using net_t = tn::test_net<shared_gpu_communicator, bn::global>;
        using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                        small_buckets, shared_gpu_communicator>;
        const auto make = [&] {
            return std::make_unique<trainer_t>(
                comm, [](auto& ctx) { return net_t(ctx, batch / 2 + 1, tn::knobs{}); },
                optim::sgd_params{.lr = lr, .momentum = momentum});
        };
        const auto fn = [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); };
        const auto params = [&](trainer_t& t) {
            return to_host(std::span<const float>(t.parameters()), comm.system());
        };
        run_log log;
        auto a = make();
        for (int s = 0; s < 3; ++s)
            (void)a->step(batch, fn);
        log.params.push_back(params(*a));
        save_checkpoint(*a, dir / "blocking");
        save_checkpoint_async(*a, dir / "async");
        for (int s = 0; s < 3; ++s)
            (void)a->step(batch, fn);
        log.losses.push_back(wait_checkpoint(*a) == checkpoint_event::committed ? 1.0 : 0.0);
        log.params.push_back(params(*a));
        for (const char* name : {"blocking", "async"}) {
            auto b = make();
            load_checkpoint(*b, dir / name);
            log.params.push_back(params(*b));
            for (int s = 0; s < 3; ++s)
                (void)b->step(batch, fn);
            log.params.push_back(params(*b));
        }
        return log;
    });
    fs::remove_all(dir);
    require_clean(logs);
    for (const run_log& l : logs) {
        REQUIRE(l.params.size() == 6);
        CHECK(l.losses == std::vector<double>{1.0});
        CHECK(l.params[2] == l.params[0]); // loaded from the blocking save: step 3
        CHECK(l.params[4] == l.params[0]); // from the asynchronous one: step 3, not later
        CHECK(l.params[3] == l.params[1]); // resumed: step 6, as the first trainer
        CHECK(l.params[5] == l.params[1]);
        CHECK(l.params[1] != l.params[0]);
    }
}

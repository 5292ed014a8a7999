// data_parallel over nccl_communicator: the synchronous trainer (bucketed reduction, SGD on
// cuda_system) instantiated with NCCL, and on machines with GPUs a few steps on one device and
// over every visible device (two or more: [multi_gpu]) checked against a double-precision
// single-replica reference. The step function runs its own device kernel and adds its loss on
// the device. Skipped without a GPU.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "cuda_test_support.hpp"
#include "device_delay.cuh"
#include "gpu_linear_net.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace {

using lockstep::cuda_system;
using lockstep::host_system;
using lockstep::nccl_communicator;

namespace lin = lockstep_test::linear;
using lin::inputs;
using lin::lr;
using lin::steps;
constexpr std::size_t global_batch = 8;
using linear_net = lin::net<nccl_communicator>;
using context_type = linear_net::context_type;

using trainer_type = lockstep::data_parallel<linear_net, lockstep::optim::sgd<float, cuda_system>,
                                             lockstep::sync::synchronous,
                                             lockstep::reduce::bucketed<>, nccl_communicator>;

/// LAMB with the optimizer state sharded over the replicas (reduce::sharded; 8-byte buckets cut
/// the 5 parameters into pieces that span shards), and the unsharded trainer it must equal.
template <class Reduce>
using lamb_trainer =
    lockstep::data_parallel<linear_net, lockstep::optim::lamb<float, cuda_system>,
                            lockstep::sync::synchronous, Reduce, nccl_communicator>;

std::vector<float> to_host(std::span<const float> device, const cuda_system& sys) {
    std::vector<float> h(device.size());
    lockstep::copy(device, sys, std::span<float>(h), host_system{});
    return h;
}

} // namespace

namespace {

/// Every replica's parameters after `steps` SGD steps of trainer_type over comms, one host
/// thread per replica (Catch2 assertions stay on the main thread).
std::vector<std::vector<float>> run_sgd(std::vector<nccl_communicator>& comms) {
    std::vector<std::vector<float>> params(comms.size());
    lockstep_test::run_replicas(comms, [&](nccl_communicator& comm) {
        trainer_type trainer(comm, [](context_type& ctx) { return linear_net(ctx); }, {.lr = lr});
        for (int k = 0; k < steps; ++k)
            (void)trainer.step(global_batch, [](linear_net& net, lockstep::shard_range sr,
                                                context_type& ctx) { lin::step(net, sr, ctx); });
        params[static_cast<std::size_t>(comm.rank())] =
            to_host(trainer.parameters(), comm.system());
    });
    return params;
}

/// One communicator, on device 0.
std::vector<nccl_communicator> device_0() {
    const int zero = 0;
    return nccl_communicator::init_all(std::span<const int>(&zero, 1));
}

} // namespace

// Full-batch descent in double within float rounding of 3 steps on O(1) values: 1e-5.
TEST_CASE("data_parallel trains over nccl_communicator: one replica matches the reference",
          "[train][nccl][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    auto comms = device_0();
    const auto params = run_sgd(comms);
    const std::vector<double> ref = lin::reference_parameters(global_batch);
    REQUIRE(params[0].size() == ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i)
        CHECK(std::abs(static_cast<double>(params[0][i]) - ref[i]) <= 1e-5);
}

TEST_CASE("data_parallel trains over nccl_communicator: replicas agree with the reference",
          "[train][nccl][cuda][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    auto comms = lockstep_test::all_devices();
    const auto params = run_sgd(comms);
    REQUIRE(params.size() >= 2);
    // Replicas hold identical bits (the reduced gradient is the same everywhere), and match
    // full-batch descent in double within float rounding of 3 steps on O(1) values.
    const std::vector<double> ref = lin::reference_parameters(global_batch);
    for (std::size_t r = 0; r < params.size(); ++r) {
        REQUIRE(params[r].size() == ref.size());
        for (std::size_t i = 0; i < ref.size(); ++i) {
            CHECK(params[r][i] == params[0][i]);
            CHECK(std::abs(static_cast<double>(params[r][i]) - ref[i]) <= 1e-5);
        }
    }
}

namespace {

/// Every replica's parameters after `steps` steps of lamb_trainer<Reduce> over comms.
template <class Reduce>
std::vector<std::vector<float>> run_lamb(std::vector<nccl_communicator>& comms) {
    std::vector<std::vector<float>> params(comms.size());
    std::vector<std::exception_ptr> errors(comms.size());
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < comms.size(); ++r)
        threads.emplace_back([&, r] {
            try {
                lamb_trainer<Reduce> trainer(comms[r],
                                             [](context_type& ctx) { return linear_net(ctx); },
                                             {.lr = 1e-2}, {.max_grad_norm = 0.05});
                for (int k = 0; k < steps; ++k)
                    (void)trainer.step(global_batch,
                                       [](linear_net& net, lockstep::shard_range sr,
                                          context_type& ctx) { lin::step(net, sr, ctx); });
                params[r] = to_host(trainer.parameters(), comms[r].system());
            } catch (...) {
                errors[r] = std::current_exception();
            }
        });
    for (auto& t : threads)
        t.join();
    for (auto& e : errors)
        if (e)
            std::rethrow_exception(e);
    return params;
}

} // namespace

TEST_CASE("reduce::sharded over nccl_communicator equals the unsharded trainer",
          "[train][nccl][cuda][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    auto comms = lockstep_test::all_devices();
    const auto sharded = run_lamb<lockstep::reduce::sharded<8, 8>>(comms);
    const auto whole = run_lamb<lockstep::reduce::bucketed<8, 8>>(comms);
    REQUIRE(comms.size() >= 2); // one shard per replica: with one, nothing is sharded
    for (std::size_t r = 0; r < comms.size(); ++r) {
        REQUIRE(sharded[r].size() == inputs + 1);
        for (std::size_t i = 0; i <= inputs; ++i) {
            CHECK(sharded[r][i] == sharded[0][i]);
            CHECK(std::abs(sharded[r][i] - whole[0][i]) <= 1e-5f * std::abs(whole[0][i]) + 1e-7f);
        }
    }
}

namespace {

/// Every replica's straggler() after each of `steps` steps of trainer_type over comms with
/// report_stragglers_every = 3, replica `slow` delayed by `delay` in every step: on its device
/// (a kernel on its stream) or on the host (a sleep before it enqueues the step's work).
std::vector<std::vector<std::optional<lockstep::straggler_report>>>
run_straggler(std::vector<nccl_communicator>& comms, std::size_t slow, bool on_device,
              std::chrono::milliseconds delay, int steps_run) {
    std::vector<std::vector<std::optional<lockstep::straggler_report>>> seen(comms.size());
    lockstep_test::run_replicas(comms, [&](nccl_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        trainer_type trainer(comm, [](context_type& ctx) { return linear_net(ctx); }, {.lr = lr},
                             {.report_stragglers_every = 3});
        for (int k = 0; k < steps_run; ++k) {
            (void)trainer.step(global_batch,
                               [&](linear_net& net, lockstep::shard_range sr, context_type& ctx) {
                                   if (r == slow && on_device)
                                       lockstep_test::device_delay(ctx.system().stream(), delay);
                                   else if (r == slow)
                                       std::this_thread::sleep_for(delay);
                                   lin::step(net, sr, ctx);
                               });
            seen[r].push_back(trainer.straggler());
        }
        trainer.finish();
    });
    return seen;
}

} // namespace

// The device timing of report_stragglers_every (CUDA events around every collective on the
// replica's stream): the last replica is delayed by 50 ms per step, on its device or on the
// host; the report after 6 steps (window steps 3..5) gives it 50 ms per step within 20 % (the
// linear network's own work is microseconds), names it and its lag (several GPUs), the same on
// every replica. One GPU: the one replica's own time is the delay (its lag is 0).
TEST_CASE("report_stragglers_every over nccl_communicator times each replica on its device",
          "[train][nccl][cuda][gpu][straggler]") {
    if (lockstep_test::skip_without_gpu())
        return;
    auto comms = lockstep_test::all_devices();
    const std::size_t n = comms.size();
    constexpr std::chrono::milliseconds delay{50};
    const double seconds = std::chrono::duration<double>(delay).count();
    for (const bool on_device : {true, false}) {
        CAPTURE(on_device, n);
        const auto seen = run_straggler(comms, n - 1, on_device, delay, 6);
        for (const auto& mine : seen) {
            REQUIRE(mine.size() == 6);
            CHECK(!mine[0]);
            CHECK(!mine[1]);
            REQUIRE(mine[5]);
            const lockstep::straggler_report& rep = *mine[5];
            CHECK(rep.first_step == 3);
            CHECK(rep.last_step == 5);
            REQUIRE(rep.own_seconds.size() == n);
            CHECK(rep.own_seconds[n - 1] == Approx(seconds).epsilon(0.2));
            CHECK(rep.slowest == static_cast<int>(n - 1));
            if (n > 1)
                CHECK(rep.lag_seconds == Approx(seconds).epsilon(0.2));
            CHECK(rep.own_seconds == seen[0][5]->own_seconds);
        }
    }
}

TEST_CASE("a step captured in a CUDA graph is refused with report_stragglers_every",
          "[train][nccl][cuda][gpu][straggler]") {
    if (lockstep_test::skip_without_gpu())
        return;
    // Rank 0 of a clique of one: the first of all_devices() would wait for peers destroyed
    // with the rest of its clique.
    auto comms = device_0();
    std::string message;
    lockstep_test::run_replicas(comms, [&](nccl_communicator& comm) {
        trainer_type trainer(comm, [](context_type& ctx) { return linear_net(ctx); }, {.lr = lr},
                             {.report_stragglers_every = 3});
        const auto fn = [](linear_net& net, lockstep::shard_range sr, context_type& ctx) {
            lin::step(net, sr, ctx);
        };
        (void)trainer.step(global_batch, fn); // the plain step a capture needs first
        cudaStream_t stream = comm.system().stream();
        LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        try {
            (void)trainer.step(global_batch, fn);
        } catch (const lockstep::error& e) {
            message = e.what();
        }
        cudaGraph_t graph = nullptr;
        (void)cudaStreamEndCapture(stream, &graph);
        if (graph != nullptr)
            (void)cudaGraphDestroy(graph);
        (void)cudaGetLastError();
    });
    CHECK_THAT(message, Catch::Contains("report_stragglers_every = 3"));
    CHECK_THAT(message, Catch::Contains("not captured in a CUDA graph"));
}

// data_parallel over nccl_communicator: the synchronous trainer (bucketed reduction, SGD on
// cuda_system) instantiated with NCCL, and on machines with GPUs a few steps over every visible
// device checked against a double-precision single-replica reference. The step function runs
// its own device kernel and adds its loss on the device. Skipped without a GPU.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <numeric>
#include <span>
#include <thread>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace {

using lockstep::cuda_system;
using lockstep::host_system;
using lockstep::nccl_communicator;

constexpr std::size_t inputs = 4;
constexpr std::size_t global_batch = 8;
constexpr int steps = 3;
constexpr double lr = 0.1;

/// Sample s of the run (run-wide index): inputs x_j and target t.
LOCKSTEP_HOST_DEVICE double input(std::uint64_t s, std::size_t j) {
    return std::sin(0.37 * static_cast<double>(s) + 1.3 * static_cast<double>(j));
}
LOCKSTEP_HOST_DEVICE double target(std::uint64_t s) {
    return std::cos(0.21 * static_cast<double>(s));
}

using context_type = lockstep::replica_context<float, nccl_communicator>;

/// A linear model y = w . x + b in the registry (device memory after finalize), loss
/// 0.5 (y - t)^2 per sample; gradients and loss are computed by linear_grad_fn on the device.
struct linear_net {
    context_type::handle w, b;
    explicit linear_net(context_type& ctx) {
        auto& reg = ctx.registry();
        w = reg.add("fc.weight", {inputs});
        b = reg.add("fc.bias", {1});
        for (std::size_t j = 0; j < inputs; ++j)
            w.value()[j] = 0.1f * static_cast<float>(j + 1);
        b.value()[0] = 0.0f;
    }
};

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

/// Task j < inputs: the gradient of w_j over the shard, task `inputs`: of b, task inputs + 1:
/// the loss, added into the trainer's loss slot. Each task sums the shard's samples in order.
struct linear_grad_fn {
    const float* w;
    const float* b;
    float* gw;
    float* gb;
    double* loss_slot;
    std::size_t begin, end;
    std::uint64_t offset;
    double scale;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t task) const {
        double sum = 0;
        for (std::size_t p = begin; p < end; ++p) {
            const std::uint64_t s = offset + p;
            double y = b[0];
            for (std::size_t j = 0; j < inputs; ++j)
                y += static_cast<double>(w[j]) * input(s, j);
            const double e = y - target(s);
            sum += task < inputs ? e * input(s, task) : task == inputs ? e : 0.5 * e * e;
        }
        // One micro-batch per step: the trainer zeroed the gradients, so assigning accumulates.
        if (task < inputs)
            gw[task] = static_cast<float>(sum * scale);
        else if (task == inputs)
            gb[0] = static_cast<float>(sum * scale);
        else if (loss_slot != nullptr)
            *loss_slot += sum * scale;
    }
};

/// The step function: one kernel on the replica's stream; the loss stays on the device.
void linear_step(linear_net& net, lockstep::shard_range r, context_type& ctx) {
    thrust::for_each(ctx.system().policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(inputs + 2),
                     linear_grad_fn{net.w.value().data(), net.b.value().data(), net.w.grad().data(),
                                    net.b.grad().data(), ctx.loss_slot(), r.begin, r.end,
                                    r.sample_offset, r.scale});
}

/// Full-batch gradient descent in double on one replica: the independent reference.
std::vector<double> reference_parameters() {
    std::vector<double> v(inputs + 1, 0.0);
    for (std::size_t j = 0; j < inputs; ++j)
        v[j] = static_cast<double>(0.1f * static_cast<float>(j + 1));
    for (int k = 0; k < steps; ++k) {
        std::vector<double> g(inputs + 1, 0.0);
        for (std::size_t p = 0; p < global_batch; ++p) {
            const std::uint64_t s = static_cast<std::uint64_t>(k) * global_batch + p;
            double y = v[inputs];
            for (std::size_t j = 0; j < inputs; ++j)
                y += v[j] * input(s, j);
            const double e = (y - target(s)) / static_cast<double>(global_batch);
            for (std::size_t j = 0; j < inputs; ++j)
                g[j] += e * input(s, j);
            g[inputs] += e;
        }
        for (std::size_t i = 0; i < v.size(); ++i)
            v[i] -= lr * g[i];
    }
    return v;
}

} // namespace

TEST_CASE("data_parallel trains over nccl_communicator: replicas agree with the reference",
          "[train][nccl][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    std::vector<int> devices(static_cast<std::size_t>(lockstep::cuda_device_count()));
    std::iota(devices.begin(), devices.end(), 0);
    auto comms = nccl_communicator::init_all(devices);

    // One host thread per replica; Catch2 assertions stay on the main thread.
    std::vector<std::vector<float>> params(comms.size());
    std::vector<std::exception_ptr> errors(comms.size());
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < comms.size(); ++r)
        threads.emplace_back([&, r] {
            try {
                trainer_type trainer(comms[r], [](context_type& ctx) { return linear_net(ctx); },
                                     {.lr = lr});
                for (int k = 0; k < steps; ++k)
                    (void)trainer.step(global_batch,
                                       [](linear_net& net, lockstep::shard_range sr,
                                          context_type& ctx) { linear_step(net, sr, ctx); });
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

    // Replicas hold identical bits (the reduced gradient is the same everywhere), and match
    // full-batch descent in double within float rounding of 3 steps on O(1) values.
    const std::vector<double> ref = reference_parameters();
    for (std::size_t r = 0; r < comms.size(); ++r) {
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
                                          context_type& ctx) { linear_step(net, sr, ctx); });
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
          "[train][nccl][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    std::vector<int> devices(static_cast<std::size_t>(lockstep::cuda_device_count()));
    std::iota(devices.begin(), devices.end(), 0);
    auto comms = nccl_communicator::init_all(devices);
    const auto sharded = run_lamb<lockstep::reduce::sharded<8, 8>>(comms);
    const auto whole = run_lamb<lockstep::reduce::bucketed<8, 8>>(comms);
    for (std::size_t r = 0; r < comms.size(); ++r) {
        REQUIRE(sharded[r].size() == inputs + 1);
        for (std::size_t i = 0; i <= inputs; ++i) {
            CHECK(sharded[r][i] == sharded[0][i]);
            CHECK(std::abs(sharded[r][i] - whole[0][i]) <= 1e-5f * std::abs(whole[0][i]) + 1e-7f);
        }
    }
}

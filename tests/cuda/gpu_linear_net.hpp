// The linear model of the GPU trainer tests over any communicator: y = w . x + b in the registry,
// loss 0.5 (y - t)^2 per sample, its gradient computed by one __host__ __device__ functor on the
// replica's system, and its double-precision full-batch reference. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep_test::linear {

inline constexpr std::size_t inputs = 4; ///< features of a sample
inline constexpr int steps = 3;          ///< steps of a test run
inline constexpr double lr = 0.1;        ///< SGD learning rate of a test run

/// Sample s of the run (run-wide index): inputs x_j and target t.
LOCKSTEP_HOST_DEVICE inline double input(std::uint64_t s, std::size_t j) {
    return std::sin(0.37 * static_cast<double>(s) + 1.3 * static_cast<double>(j));
}
LOCKSTEP_HOST_DEVICE inline double target(std::uint64_t s) {
    return std::cos(0.21 * static_cast<double>(s));
}

/// The model's parameters in the registry (device memory after finalize on a CUDA system):
/// w_j = 0.1 (j + 1), b = 0.
template <class Comm>
struct net {
    using context_type = lockstep::replica_context<float, Comm>;
    typename context_type::handle w, b;
    explicit net(context_type& ctx) {
        auto& reg = ctx.registry();
        w = reg.add("fc.weight", {inputs});
        b = reg.add("fc.bias", {1});
        for (std::size_t j = 0; j < inputs; ++j)
            w.value()[j] = 0.1f * static_cast<float>(j + 1);
        b.value()[0] = 0.0f;
    }
};

/// Task j < inputs: the gradient of w_j over the shard, task `inputs`: of b, task inputs + 1:
/// the loss, added into the trainer's loss slot. Each task sums the shard's samples in order.
struct grad_fn {
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
template <class Comm>
void step(net<Comm>& n, lockstep::shard_range r, typename net<Comm>::context_type& ctx) {
    thrust::for_each(ctx.system().policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(inputs + 2),
                     grad_fn{n.w.value().data(), n.b.value().data(), n.w.grad().data(),
                             n.b.grad().data(), ctx.loss_slot(), r.begin, r.end, r.sample_offset,
                             r.scale});
}

/// Full-batch gradient descent in double on one replica (`steps` steps of `global_batch`
/// samples, learning rate `lr`): the independent reference.
inline std::vector<double> reference_parameters(std::size_t global_batch) {
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

} // namespace lockstep_test::linear

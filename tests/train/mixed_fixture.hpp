// tests/train/mixed_fixture.hpp: the mixed precision tests' problem (linear least squares on 48
// fixed samples) and its network computing in half, bfloat16 or float. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/train/compute_copy.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/rng.hpp"
#include "lockstep/train/shard.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

namespace lockstep_test {

using namespace lockstep;

// ---------------------------------------------------------------------------------------------
// The problem: linear least squares, W (O x I) fitted to N fixed samples, full-batch gradient
// descent (every step's global batch is the whole data set, so a skipped step only delays the
// run). Replicas get different shards of it.

constexpr std::size_t n_samples = 48, n_in = 6, n_out = 2;
constexpr double lr = 0.1;

double x_of(std::size_t s, std::size_t k) {
    return rng_stream{0x5EED, 1}.normal(s, k);
}
double t_of(std::size_t s, std::size_t o) {
    double y = 0.1 * rng_stream{0x5EED, 3}.normal(s, o);
    for (std::size_t k = 0; k < n_in; ++k)
        y += rng_stream{0x5EED, 2}.normal(o, k) * x_of(s, k);
    return y;
}

/// Rounds a float through Compute (the identity for float).
template <class Compute>
float through(float v) {
    if constexpr (std::is_same_v<Compute, float>)
        return v;
    else
        return static_cast<float>(Compute(v));
}

/// y = W x computed in Compute (half, bfloat16 or float): weights and inputs stored in
/// Compute, products accumulated in float, the output stored in Compute; the backward seed r *
/// scale * S and the weight gradient stored in Compute, accumulated into the float gradient.
/// Initial weights depend on the rank (the trainer's broadcast makes them agree). `poison`: this
/// replica's gradient gets an infinity (an overflow) in this step; `poison_loss`: its loss is a
/// NaN (the gradient stays finite).
template <class Compute, class Comm = thread_communicator>
struct linreg {
    using ctx_type = replica_context<float, Comm>;
    static constexpr bool low = !std::is_same_v<Compute, float>;
    using copy_type = compute_copy<std::conditional_t<low, Compute, lockstep::half>, float>;

    explicit linreg(ctx_type& ctx) : copy(n_out * n_in, ctx.system()) {
        w = ctx.registry().add("w", {n_out, n_in});
        ctx.registry().finalize();
        const rng_stream init{77 + static_cast<std::uint64_t>(ctx.rank()), 0};
        for (std::size_t i = 0; i < n_out * n_in; ++i)
            w.value()[i] = static_cast<float>(0.3 * init.normal(0, i));
    }

    double train(const shard_range& r, ctx_type& ctx) {
        auto& reg = ctx.registry();
        if constexpr (low)
            copy.refresh(std::span<const float>(reg.values()), ctx.step());
        const double S = ctx.loss_scale();
        scales_seen.push_back(S);
        auto w_at = [&](std::size_t i) {
            if constexpr (low)
                return static_cast<float>(copy.values()[i]);
            else
                return reg.values()[i];
        };
        std::vector<float> g(n_out * n_in, 0.0f);
        double loss = 0;
        for (std::size_t p = r.begin; p < r.end; ++p) {
            const std::size_t s = r.sample_index(p) % n_samples;
            float x[n_in];
            for (std::size_t k = 0; k < n_in; ++k)
                x[k] = through<Compute>(static_cast<float>(x_of(s, k)));
            for (std::size_t o = 0; o < n_out; ++o) {
                float y = 0;
                for (std::size_t k = 0; k < n_in; ++k)
                    y += w_at(o * n_in + k) * x[k];
                const float res = through<Compute>(y) - static_cast<float>(t_of(s, o));
                loss += 0.5 * double(res) * double(res) * r.scale;
                const float seed = through<Compute>(static_cast<float>(res * r.scale * weight * S));
                for (std::size_t k = 0; k < n_in; ++k)
                    g[o * n_in + k] += seed * x[k];
            }
        }
        if (poison)
            g[0] = std::numeric_limits<float>::infinity();
        if constexpr (low) {
            for (std::size_t i = 0; i < g.size(); ++i)
                copy.grads()[i] = Compute(g[i]);
            copy.accumulate_into(reg.grads());
        } else {
            for (std::size_t i = 0; i < g.size(); ++i)
                reg.grads()[i] += g[i];
        }
        return poison_loss ? std::numeric_limits<double>::quiet_NaN() : loss;
    }

    typename ctx_type::handle w;
    copy_type copy;
    bool poison = false;
    bool poison_loss = false;
    double weight = 1.0; ///< the loss is weight * (1/2N) sum ||W x - t||^2
    std::vector<double> scales_seen;
};

} // namespace lockstep_test

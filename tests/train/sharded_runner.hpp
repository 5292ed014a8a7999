// tests/train/sharded_runner.hpp: the cases of the reduce::sharded tests (optimizers, a network
// with fewer parameters than replicas) shared by the thread and MPI tests.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "mlp_fixture.hpp"
#include "optimizer_cases.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/sgd.hpp"

#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

namespace lockstep_test {

/// Relative error bound against the unsharded trainer (normwise per tensor): the 1e-5 (float)
/// / 1e-10 (double) of the equivalence tests.
template <class T>
constexpr double sharded_tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-10;

/// A linear model with `inputs` + 1 parameters ("w" {inputs}, "b" {1}) and a squared loss:
/// with inputs = 2 (3 parameters) on 4 replicas one shard is empty and "w" spans two shards.
/// Every weight k has its own feature, target coefficient and start value, so each one trains
/// (a weight that stayed 0 would hide a shard that is never gathered).
/// requires: inputs >= 1.
template <class T, class Comm>
class tiny_net {
public:
    using ctx_type = replica_context<T, Comm>;
    explicit tiny_net(ctx_type& ctx, std::size_t inputs = 2) : inputs_(inputs) {
        auto& reg = ctx.registry();
        w_ = reg.add("w", {inputs});
        b_ = reg.add("b", {1});
        reg.finalize();
        for (std::size_t k = 0; k < inputs; ++k)
            w_.value()[k] = T(k == 0 ? 0.5 : k == 1 ? -0.25 : 0.125 * double(k));
        b_.value()[0] = T(0.1);
    }
    tiny_net(const tiny_net&) = delete;
    tiny_net& operator=(const tiny_net&) = delete;

    double train(const shard_range& r, ctx_type& ctx) {
        double loss = 0;
        std::vector<double> x(inputs_);
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const std::uint64_t g = r.sample_index(i);
            double y = 0.5 + 0.1 * feature(g, inputs_ + 1);
            double e = double(b_.value()[0]);
            for (std::size_t k = 0; k < inputs_; ++k) {
                x[k] = feature(g, k);
                y += coefficient(k) * x[k];
                e += double(w_.value()[k]) * x[k];
            }
            e -= y;
            loss += 0.5 * e * e * r.scale;
            for (std::size_t k = 0; k < inputs_; ++k)
                w_.grad()[k] += T(e * x[k] * r.scale);
            b_.grad()[0] += T(e * r.scale);
        }
        ctx.mark_ready(b_);
        ctx.mark_ready(w_);
        return loss;
    }

private:
    static double coefficient(std::size_t k) {
        return k == 0 ? 2.0 : k == 1 ? -1.0 : 0.3 * static_cast<double>(k);
    }

    std::size_t inputs_;
    typename parameter_registry<T, typename Comm::system_type>::handle w_, b_;
};

/// True when a and b hold the same bits.
template <class T>
bool same_bits(std::span<const T> a, std::span<const T> b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

} // namespace lockstep_test

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
/// requires: 1 <= inputs <= 2.
template <class T, class Comm>
class tiny_net {
public:
    using ctx_type = replica_context<T, Comm>;
    explicit tiny_net(ctx_type& ctx, std::size_t inputs = 2) : inputs_(inputs) {
        auto& reg = ctx.registry();
        w_ = reg.add("w", {inputs});
        b_ = reg.add("b", {1});
        reg.finalize();
        w_.value()[0] = T(0.5);
        if (inputs > 1)
            w_.value()[1] = T(-0.25);
        b_.value()[0] = T(0.1);
    }
    tiny_net(const tiny_net&) = delete;
    tiny_net& operator=(const tiny_net&) = delete;

    double train(const shard_range& r, ctx_type& ctx) {
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const std::uint64_t g = r.sample_index(i);
            const double x0 = feature(g, 0), x1 = inputs_ > 1 ? feature(g, 1) : 0.0;
            const double y = 2.0 * x0 - x1 + 0.5 + 0.1 * feature(g, 2);
            double e = double(w_.value()[0]) * x0 + double(b_.value()[0]) - y;
            if (inputs_ > 1)
                e += double(w_.value()[1]) * x1;
            loss += 0.5 * e * e * r.scale;
            w_.grad()[0] += T(e * x0 * r.scale);
            if (inputs_ > 1)
                w_.grad()[1] += T(e * x1 * r.scale);
            b_.grad()[0] += T(e * r.scale);
        }
        ctx.mark_ready(b_);
        ctx.mark_ready(w_);
        return loss;
    }

private:
    std::size_t inputs_;
    typename parameter_registry<T, typename Comm::system_type>::handle w_, b_;
};

/// True when a and b hold the same bits.
template <class T>
bool same_bits(std::span<const T> a, std::span<const T> b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

} // namespace lockstep_test

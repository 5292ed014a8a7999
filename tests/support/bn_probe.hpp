// tests/support/bn_probe.hpp: bn_probe<Policy, Feature>, a network of one batch-norm layer over
// raw features and a linear read-out, for tests of how a policy's running statistics come out of
// a trainer. Test support, not public API. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

namespace lockstep_test {

/// x -> batch norm (Policy) -> loss = sum of w_k y_k over the samples, times range.scale, where
/// x[s][k] = Feature(global sample index, k). The layer normalises the raw features, so its batch
/// statistics, and so its running statistics, depend on the samples alone, not on the parameters.
/// for_each_state exposes the running statistics unless `Exposed` is false.
template <class Policy, double (*Feature)(std::uint64_t, std::size_t), bool Exposed = true>
struct bn_probe {
    static constexpr std::size_t channels = 3;
    using bn_policies = std::tuple<Policy>;
    using ctx_type = lockstep::replica_context<double, lockstep::thread_communicator>;
    using bn_type = lockstep::nn::batch_norm<double, Policy, lockstep::nn::nc>;

    explicit bn_probe(ctx_type& ctx) {
        auto& reg = ctx.registry();
        gamma = reg.add("bn.weight", {channels});
        beta = reg.add("bn.bias", {channels});
        w = reg.add("w", {channels});
        reg.finalize();
        bn.emplace(ctx.comm(), channels,
                   typename bn_type::parameter_spans{gamma.value(), beta.value(), gamma.grad(),
                                                     beta.grad()});
        for (std::size_t k = 0; k < channels; ++k)
            w.value()[k] = 0.5 + double(k);
    }

    double train(const lockstep::shard_range& r, ctx_type& ctx) {
        const std::size_t n = r.size();
        std::vector<double> x(n * channels), y(n * channels), dy(n * channels), dx(n * channels);
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t k = 0; k < channels; ++k)
                x[s * channels + k] = Feature(r.sample_index(r.begin + s), k);
        bn->forward_train(ctx, std::span<const double>(x), lockstep::nn::tensor_shape{n, channels},
                          std::span<double>(y));
        double loss = 0;
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t k = 0; k < channels; ++k) {
                loss += w.value()[k] * y[s * channels + k] * r.scale;
                w.grad()[k] += y[s * channels + k] * r.scale;
                dy[s * channels + k] = w.value()[k] * r.scale;
            }
        bn->backward(ctx, std::span<const double>(dy), std::span<double>(dx));
        return loss;
    }

    template <class F>
    requires Exposed void for_each_state(F&& f) {
        f("bn.running_mean", bn->running_mean());
        f("bn.running_var", bn->running_var());
    }

    typename ctx_type::handle gamma, beta, w;
    std::optional<bn_type> bn;
};

} // namespace lockstep_test

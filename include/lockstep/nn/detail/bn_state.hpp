// lockstep/nn/detail/bn_state.hpp: the per-channel storage of a batch-norm layer (parameters,
// running statistics, coefficients, scratch) on its system. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/system/buffer.hpp"

#include <cstddef>
#include <span>
#include <vector>

#include <thrust/fill.h>

namespace lockstep::nn::detail {

/// Fills s with v using sys's Thrust policy (s lives in sys's memory).
template <class Acc, class System>
void fill(const System& sys, std::span<Acc> s, Acc v) {
    if (!s.empty())
        thrust::fill(sys.policy(), s.data(), s.data() + s.size(), v);
}

/// Copies s (in sys's memory) to a host vector.
template <class Acc, class System>
std::vector<Acc> to_host(const System& sys, std::span<const Acc> s) {
    std::vector<Acc> h(s.size());
    if constexpr (System::is_host) {
        for (std::size_t i = 0; i < s.size(); ++i)
            h[i] = s[i];
    } else {
        lockstep::copy(s, sys, std::span<Acc>(h), host_system{});
    }
    return h;
}

/// Grows b to at least n elements (contents are not kept).
template <class U, class System>
std::span<U> ensure(buffer<U, System>& b, std::size_t n, const System& sys) {
    if (b.size() < n)
        b = buffer<U, System>(n, sys);
    return b.span().first(n);
}

/// The buffers of one batch-norm layer with C channels. Parameters either live here or in
/// caller-provided spans (e.g. a trainer's flat parameter registry).
template <class Acc, class System>
struct bn_state {
    bn_state(std::size_t c, const System& s)
        : channels(c), sys(s), own(4 * c, s), stats(2 * c, s), coef(6 * c, s),
          sums(2 * (2 * c + 1), s), packed(2 + 2 * c, s), local(c, s), merged(c, s) {}

    std::size_t channels;
    System sys;
    buffer<Acc, System> own;    ///< gamma, beta, dgamma, dbeta when the layer owns them
    buffer<Acc, System> stats;  ///< running_mean, running_var
    buffer<Acc, System> coef;   ///< mean, invstd, scale, k, a, b
    buffer<Acc, System> sums;   ///< local (sum dy, sum dy*xmu, status), then combined
    buffer<Acc, System> packed; ///< this replica's {status, count, (mean, m2) per channel}
    buffer<Acc, System> gathered;
    buffer<kernels::moments<Acc>, System> local;
    buffer<kernels::moments<Acc>, System> merged;
    buffer<kernels::moments<Acc>, System> moments_workspace;
    buffer<Acc, System> backward_workspace;

    std::span<Acc> gamma, beta, dgamma, dbeta; ///< views of own or of the caller's spans

    std::span<Acc> coefficient(std::size_t i) {
        return coef.span().subspan(i * channels, channels);
    }
    std::span<Acc> running_mean() { return stats.span().first(channels); }
    std::span<Acc> running_var() { return stats.span().subspan(channels, channels); }
};

} // namespace lockstep::nn::detail

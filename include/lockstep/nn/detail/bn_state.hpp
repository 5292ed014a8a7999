// lockstep/nn/detail/bn_state.hpp: the per-channel storage of a batch-norm layer (parameters,
// running statistics, coefficients, exchange blocks, scratch) on its system, every buffer named.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/system/buffer.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

#include <thrust/count.h>
#include <thrust/fill.h>

namespace lockstep::nn::detail {

/// Fills s with v using sys's Thrust policy (s lives in sys's memory).
template <class Acc, class System>
void fill(const System& sys, std::span<Acc> s, Acc v) {
    if (!s.empty())
        kernels::with_policy_for(sys, s.size(), [&](auto policy) {
            thrust::fill(policy, s.data(), s.data() + s.size(), v);
        });
}

/// True for a value other than +0 or -0 (NaN included).
struct is_nonzero_fn {
    template <class Acc>
    LOCKSTEP_HOST_DEVICE bool operator()(Acc v) const {
        return !(v == Acc(0));
    }
};

/// The number of values of s other than zero (s lives in sys's memory; the count is read on
/// the host, so on a device this waits for the system's stream).
template <class Acc, class System>
std::size_t count_nonzero(const System& sys, std::span<const Acc> s) {
    if (s.empty())
        return 0;
    return static_cast<std::size_t>(kernels::with_policy_for(sys, s.size(), [&](auto policy) {
        return thrust::count_if(policy, s.data(), s.data() + s.size(), is_nonzero_fn{});
    }));
}

/// Grows b to at least n elements (contents are not kept).
template <class U, class System>
std::span<U> ensure(buffer<U, System>& b, std::size_t n, const System& sys) {
    if (b.size() < n)
        b = buffer<U, System>(n, sys);
    return b.span().first(n);
}

/// dst[i] = src[i], unless skip is non-null and *skip == 0 (read on the device).
template <class Acc>
struct copy_if_fn {
    const Acc* src;
    Acc* dst;
    const int* skip;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        if (skip == nullptr || *skip != 0)
            dst[i] = src[i];
    }
};

/// The buffers of one batch-norm layer with C channels. Parameters either live here or in
/// caller-provided spans (e.g. a trainer's flat parameter registry).
template <class Acc, class System>
struct bn_state {
    bn_state(std::size_t c, const System& s)
        : channels(c), sys(s), own(4 * c, s), running(2 * c, s), forward(3 * c, s), eval(2 * c, s),
          block(kernels::packed_moments::size(c), s), sums(2 * (2 * c + 1), s), scalars(1, s),
          error(1, s) {}

    std::size_t channels;
    System sys;
    buffer<Acc, System> own;        ///< gamma, beta, dgamma, dbeta when the layer owns them
    buffer<Acc, System> running;    ///< running_mean, running_var
    buffer<Acc, System> forward;    ///< batch mean, invstd, scale = gamma * invstd (last forward)
    buffer<Acc, System> eval;       ///< running mean, scale (last forward_eval)
    buffer<Acc, System> block;      ///< this replica's statistics block (kernels::packed_moments)
    buffer<Acc, System> gathered;   ///< every replica's block (communicating policies)
    buffer<Acc, System> sums;       ///< backward: local (sum dy, sum dy*xmu, status), then combined
    buffer<double, System> scalars; ///< the normalization count
    buffer<kernels::layer_error_record, System> error; ///< the layer's own error record
    buffer<std::byte, System> workspace; ///< the kernels' workspace (see batch_norm::workspace)

    std::span<Acc> gamma, beta, dgamma, dbeta; ///< views of own or of the caller's spans

    std::span<Acc> running_mean() { return running.span().first(channels); }
    std::span<Acc> running_var() { return running.span().subspan(channels, channels); }
    std::span<Acc> batch_mean() { return forward.span().first(channels); }
    std::span<Acc> batch_invstd() { return forward.span().subspan(channels, channels); }
    std::span<Acc> batch_scale() { return forward.span().subspan(2 * channels, channels); }
    std::span<Acc> eval_mean() { return eval.span().first(channels); }
    std::span<Acc> eval_scale() { return eval.span().subspan(channels, channels); }
    std::span<Acc> local_sums() { return sums.span().first(2 * channels + 1); }
    std::span<Acc> combined_sums() { return sums.span().subspan(2 * channels + 1); }
    double* normalization_count() { return scalars.data(); }
    /// The layer's own error record, used outside a trainer's step.
    kernels::layer_error_record* own_error() { return error.data(); }
};

} // namespace lockstep::nn::detail

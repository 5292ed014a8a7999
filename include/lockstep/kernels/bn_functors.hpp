// lockstep/kernels/bn_functors.hpp: the batch-norm arithmetic as host/device functors, shared by
// the generic Thrust kernels and the host fast path. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>

namespace lockstep::kernels {

/// y = (x - mean) * scale + beta with scale = gamma * invstd. Subtracting the mean first keeps
/// y accurate when |mean| >> std (x * scale + shift would cancel catastrophically).
template <class Acc>
LOCKSTEP_HOST_DEVICE inline Acc normalize_value(Acc x, Acc mean, Acc scale, Acc beta) {
    return (x - mean) * scale + beta;
}

/// The backward reductions of one value: sum_dy += dy, sum_dy_xmu += dy * (x - mean).
template <class Acc>
LOCKSTEP_HOST_DEVICE inline void backward_accumulate(Acc& sum_dy, Acc& sum_dy_xmu, Acc dy, Acc x,
                                                     Acc mean) {
    sum_dy += dy;
    sum_dy_xmu += dy * (x - mean);
}

/// dx = k * (dy - a - (x - mean) * b) with the per-channel coefficients k = gamma * invstd,
/// a = sum_dy / M, b = invstd^2 * sum_dy_xmu / M; this is
/// gamma * invstd / M * (M * dy - sum_dy - xhat * sum_dy_xhat).
template <class Acc>
LOCKSTEP_HOST_DEVICE inline Acc input_gradient(Acc dy, Acc x, Acc mean, Acc k, Acc a, Acc b) {
    return k * (dy - a - (x - mean) * b);
}

/// One channel's normalization coefficients: y = normalize_value(x, mean, scale, beta).
template <class Acc>
struct channel_coefficients {
    Acc mean;
    Acc scale;
};

/// The coefficients of arrays written earlier (kernels::normalize's): channel c's are
/// (mean[c], scale[c]). A coefficient source of the CUDA normalize kernels, as are
/// eval_coefficients_fn and finish_statistics_fn, which also write them (finishes).
template <class Acc>
struct coefficient_arrays {
    static constexpr bool finishes = false;
    const Acc* mean;
    const Acc* scale;
    LOCKSTEP_HOST_DEVICE channel_coefficients<Acc> coefficients(std::size_t c) const {
        return {mean[c], scale[c]};
    }
};

/// Per-channel coefficients of the backward pass, read by the dx kernels.
template <class Acc>
struct backward_coefficients {
    const Acc* mean; ///< batch mean the forward pass normalized with
    const Acc* k;    ///< gamma * invstd
    const Acc* a;    ///< sum_dy / M
    const Acc* b;    ///< invstd^2 * sum_dy_xmu / M
};

/// Task t = c * parts + p: Welford moments of partition p of channel c (generic path).
template <class T, class Acc>
struct partial_moments_fn {
    const T* x;
    channel_geometry g;
    std::size_t parts;
    moments<Acc>* partials;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t c = t / parts;
        const std::size_t p = t % parts;
        const std::size_t n = g.per_channel();
        const std::size_t begin = n * p / parts;
        const std::size_t end = n * (p + 1) / parts;
        moments<Acc> m;
        for (std::size_t k = begin; k < end; ++k)
            welford_update(m, static_cast<Acc>(x[g.offset(c, k)]));
        partials[t] = m;
    }
};

/// Channel c: Chan-merges its `parts` partials in partition order.
template <class Acc>
struct merge_partials_fn {
    const moments<Acc>* partials;
    std::size_t parts;
    moments<Acc>* out;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        const chan_merge merge;
        moments<Acc> m;
        for (std::size_t p = 0; p < parts; ++p)
            m = merge(m, partials[c * parts + p]);
        out[c] = m;
    }
};

/// Channel c, inference: coefficients from the running statistics.
template <class Acc>
struct eval_coefficients_fn {
    static constexpr bool finishes = true;
    const Acc* running_mean;
    const Acc* running_var;
    const Acc* gamma;
    Acc eps;
    Acc* mean;
    Acc* scale;

    /// Channel c's coefficients, as operator() writes them.
    LOCKSTEP_HOST_DEVICE channel_coefficients<Acc> coefficients(std::size_t c) const {
        return {running_mean[c], gamma[c] * inverse_sqrt(running_var[c] + eps)};
    }
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        const channel_coefficients<Acc> k = coefficients(c);
        mean[c] = k.mean;
        scale[c] = k.scale;
    }
    /// The values operator() reads over every channel (for_each_index's work estimate).
    std::size_t elements(std::size_t channels) const noexcept { return channels; }
};

/// Value i: y[i] = normalize_value(x[i]) with its channel's coefficients (generic path).
template <class T, class Acc>
struct normalize_fn {
    const T* x;
    T* y;
    channel_geometry g;
    const Acc* mean;
    const Acc* scale;
    const Acc* beta;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        const std::size_t c = g.channel_of(i);
        y[i] = static_cast<T>(normalize_value(static_cast<Acc>(x[i]), mean[c], scale[c], beta[c]));
    }
};

/// Task t = c * parts + p: sums (dy, dy * (x - mean)) over partition p of channel c into
/// partials[2 t], partials[2 t + 1] (generic path).
template <class T, class Acc>
struct partial_backward_fn {
    const T* dy;
    const T* x;
    channel_geometry g;
    std::size_t parts;
    const Acc* mean;
    Acc* partials;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t c = t / parts;
        const std::size_t p = t % parts;
        const std::size_t n = g.per_channel();
        const Acc mu = mean[c];
        Acc sdy = 0;
        Acc sdyx = 0;
        for (std::size_t k = n * p / parts; k < n * (p + 1) / parts; ++k) {
            const std::size_t i = g.offset(c, k);
            backward_accumulate(sdy, sdyx, static_cast<Acc>(dy[i]), static_cast<Acc>(x[i]), mu);
        }
        partials[2 * t] = sdy;
        partials[2 * t + 1] = sdyx;
    }
};

/// Channel c: sums its partials in partition order into sums[c] (sum dy) and
/// sums[channels + c] (sum dy * (x - mean)).
template <class Acc>
struct merge_backward_fn {
    const Acc* partials;
    std::size_t parts;
    std::size_t channels;
    Acc* sums;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        Acc sdy = 0;
        Acc sdyx = 0;
        for (std::size_t p = 0; p < parts; ++p) {
            sdy += partials[2 * (c * parts + p)];
            sdyx += partials[2 * (c * parts + p) + 1];
        }
        sums[c] = sdy;
        sums[channels + c] = sdyx;
    }
};

/// Value i: dx[i] = input_gradient(dy[i], x[i]) with its channel's coefficients (generic path).
template <class T, class Acc>
struct input_gradient_fn {
    const T* dy;
    const T* x;
    T* dx;
    channel_geometry g;
    backward_coefficients<Acc> co;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        const std::size_t c = g.channel_of(i);
        dx[i] = static_cast<T>(input_gradient(static_cast<Acc>(dy[i]), static_cast<Acc>(x[i]),
                                              co.mean[c], co.k[c], co.a[c], co.b[c]));
    }
};

} // namespace lockstep::kernels

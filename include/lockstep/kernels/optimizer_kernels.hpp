// lockstep/kernels/optimizer_kernels.hpp: element-wise arithmetic of the fused optimizer updates.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/segmented.hpp"

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

// Every functor here is applied per element i of a flat parameter buffer w with gradient g,
// through kernels::tile_apply / tile_reduce (host: a Thrust for_each over tiles) or tile_lanes
// (device: one element per thread), see segmented.hpp. `segment(s)` loads the per-tensor
// scalars (once per tile on the host). The equations are documented on the
// optimizer classes in optim/; the functors implement them literally, in T arithmetic.

namespace lockstep::kernels {

namespace detail {
LOCKSTEP_HOST_DEVICE inline float sqrt_t(float x) {
    return ::sqrtf(x);
}
LOCKSTEP_HOST_DEVICE inline double sqrt_t(double x) {
    return ::sqrt(x);
}
} // namespace detail

/// True when x is neither NaN nor infinite (bit test: immune to -ffast-math).
struct is_finite_fn {
    LOCKSTEP_HOST_DEVICE bool operator()(float x) const {
        return (std::bit_cast<std::uint32_t>(x) & 0x7f800000u) != 0x7f800000u;
    }
    LOCKSTEP_HOST_DEVICE bool operator()(double x) const {
        return (std::bit_cast<std::uint64_t>(x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
    }
};

/// SGD (torch.optim.SGD): d = g + wd_s w; with momentum: b = first ? d : mu b + (1 - damp) d,
/// d = nesterov ? d + mu b : b; then w -= lr d. wd_s = 0 on segments without decay.
template <class T>
struct sgd_update {
    T* w;
    const T* g;
    T* m; ///< momentum buffer (unused when momentum == 0)
    const segment_flags* flags;
    T lr, momentum, one_minus_dampening, weight_decay;
    bool nesterov, first_step;

    LOCKSTEP_HOST_DEVICE T segment(std::uint32_t s) const {
        return flags[s].decay ? weight_decay : T(0);
    }
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i, T wd) const {
        const T wi = w[i];
        T d = g[i] + wd * wi;
        if (momentum != T(0)) {
            const T b = first_step ? d : momentum * m[i] + one_minus_dampening * d;
            m[i] = b;
            d = nesterov ? d + momentum * b : b;
        }
        w[i] = wi - lr * d;
    }
};

/// Adam / AdamW (torch.optim.Adam, torch.optim.AdamW), step t >= 1:
/// coupled (Adam): g' = g + wd_s w;  decoupled (AdamW): w' = w (1 - lr wd_s), g' = g;
/// m = b1 m + (1 - b1) g'; v = b2 v + (1 - b2) g'^2;
/// w = w' - step_size m / (sqrt(v) / sqrt_bc2 + eps), step_size = lr / (1 - b1^t),
/// sqrt_bc2 = sqrt(1 - b2^t).
template <class T>
struct adam_update {
    T* w;
    const T* g;
    T* m;
    T* v;
    const segment_flags* flags;
    // The (1 - x) factors are computed in double on the host, then rounded once to T (as
    // PyTorch passes 1 - beta as a Python float): 1 - 0.999f in float is off by 1.3e-5.
    T beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, step_size,
        sqrt_bc2;
    bool decoupled;

    struct scalars {
        T wd;     ///< coupled L2 coefficient of the segment (0 for AdamW or !decay)
        T factor; ///< decoupled factor 1 - lr wd of the segment (1 for Adam or !decay)
    };
    LOCKSTEP_HOST_DEVICE scalars segment(std::uint32_t s) const {
        if (!flags[s].decay)
            return {T(0), T(1)};
        return decoupled ? scalars{T(0), decay_factor} : scalars{weight_decay, T(1)};
    }
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i, const scalars& s) const {
        const T wi = w[i] * s.factor;
        const T gi = g[i] + s.wd * w[i];
        const T mi = beta1 * m[i] + one_minus_beta1 * gi;
        const T vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] = wi - step_size * mi / (detail::sqrt_t(vi) / sqrt_bc2 + eps);
    }
};

/// Squared norms of w and g over a segment (LARS's first pass): returns {w_i^2, g_i^2}.
template <class T>
struct norm2_w_g {
    const T* w;
    const T* g;
    LOCKSTEP_HOST_DEVICE int segment(std::uint32_t) const { return 0; }
    LOCKSTEP_HOST_DEVICE sum_pair operator()(std::size_t i, int) const {
        const double wi = static_cast<double>(w[i]), gi = static_cast<double>(g[i]);
        return {wi * wi, gi * gi};
    }
};

/// LARS's local learning rate per segment from {||w||^2, ||g||^2}:
/// trust = eta ||w|| / (||g|| + wd_s ||w|| + eps) when the segment adapts and both norms are
/// positive, else 1; writes scaled_lr[s] = lr * trust and trust_out[s] = trust.
struct lars_trust {
    const sum_pair* norms;
    const segment_flags* flags;
    double* scaled_lr;
    double* trust_out;
    double lr, eta, weight_decay, eps;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t s) const {
        const double wn = ::sqrt(norms[s].a), gn = ::sqrt(norms[s].b);
        const double wd = flags[s].decay ? weight_decay : 0.0;
        const double t =
            (flags[s].adapt && wn > 0 && gn > 0) ? eta * wn / (gn + wd * wn + eps) : 1.0;
        trust_out[s] = t;
        scaled_lr[s] = lr * t;
    }
};

/// LARS update (You, Gitman, Ginsburg 2017, Algorithm 1): v = mu v + lr_s (g + wd_s w);
/// w -= v, with lr_s = lr * trust of the element's segment.
template <class T>
struct lars_update {
    T* w;
    const T* g;
    T* v;
    const segment_flags* flags;
    const double* scaled_lr;
    T momentum, weight_decay;
    struct scalars {
        T lr, wd;
    };
    LOCKSTEP_HOST_DEVICE scalars segment(std::uint32_t s) const {
        return {static_cast<T>(scaled_lr[s]), flags[s].decay ? weight_decay : T(0)};
    }
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i, const scalars& s) const {
        const T wi = w[i];
        const T vi = momentum * v[i] + s.lr * (g[i] + s.wd * wi);
        v[i] = vi;
        w[i] = wi - vi;
    }
};

/// LAMB's first pass (You et al. 2019, Algorithm 2, with Adam's bias correction), step t >= 1:
/// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
/// u = (m / bc1) / (sqrt(v / bc2) + eps) + wd_s w, written to `update`;
/// returns {w_i^2, u_i^2} for the per-segment trust ratio.
template <class T>
struct lamb_moments {
    const T* w;
    const T* g;
    T* m;
    T* v;
    T* update;
    const segment_flags* flags;
    T beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, inv_bc1, inv_bc2;
    LOCKSTEP_HOST_DEVICE T segment(std::uint32_t s) const {
        return flags[s].decay ? weight_decay : T(0);
    }
    LOCKSTEP_HOST_DEVICE sum_pair operator()(std::size_t i, T wd) const {
        const T wi = w[i], gi = g[i];
        const T mi = beta1 * m[i] + one_minus_beta1 * gi;
        const T vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const T u = (mi * inv_bc1) / (detail::sqrt_t(vi * inv_bc2) + eps) + wd * wi;
        update[i] = u;
        const double wd_ = static_cast<double>(wi), ud = static_cast<double>(u);
        return {wd_ * wd_, ud * ud};
    }
};

/// LAMB's trust ratio per segment from {||w||^2, ||u||^2}: phi(||w||) / ||u|| with
/// phi(z) = min(max(z, phi_min), phi_max) when the segment adapts and both norms are positive,
/// else 1; writes scaled_lr[s] = lr * ratio and trust_out[s] = ratio.
struct lamb_trust {
    const sum_pair* norms;
    const segment_flags* flags;
    double* scaled_lr;
    double* trust_out;
    double lr, phi_min, phi_max;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t s) const {
        const double wn = ::sqrt(norms[s].a), un = ::sqrt(norms[s].b);
        const double phi = wn < phi_min ? phi_min : (wn > phi_max ? phi_max : wn);
        const double r = (flags[s].adapt && wn > 0 && un > 0) ? phi / un : 1.0;
        trust_out[s] = r;
        scaled_lr[s] = lr * r;
    }
};

/// LAMB's second pass: w -= lr_s u, lr_s = lr * ratio of the element's segment.
template <class T>
struct lamb_apply {
    T* w;
    const T* update;
    const double* scaled_lr;
    LOCKSTEP_HOST_DEVICE T segment(std::uint32_t s) const { return static_cast<T>(scaled_lr[s]); }
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i, T lr) const {
        w[i] = w[i] - lr * update[i];
    }
};

} // namespace lockstep::kernels

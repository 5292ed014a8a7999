// lockstep/kernels/optimizer_kernels.hpp: element-wise arithmetic of the fused optimizer updates.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/segmented.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

// Every functor here is applied per element i of a flat parameter buffer w with gradient g,
// through kernels::tile_apply / tile_reduce (host: a Thrust for_each over tiles) or tile_lanes
// (device: one element per thread), see segmented.hpp. `segment(s)` loads the per-tensor
// scalars and the per-step scalars of the step_state (once per tile on the host, once per
// thread on a device). The equations are documented on the optimizer classes in optim/; the
// functors implement them literally, in T arithmetic.
//
// A step starts with begin_step, one thread that reads the step's skip flag and, when the step
// is applied, advances the applied-step count and computes the step's scalars (bias
// corrections) in double. The count lives in the system's memory so that a skipped step needs
// no host decision: the drivers take &state->skip as their noop flag.

namespace lockstep::kernels {

namespace detail {
LOCKSTEP_HOST_DEVICE inline float sqrt_t(float x) {
    return ::sqrtf(x);
}
LOCKSTEP_HOST_DEVICE inline double sqrt_t(double x) {
    return ::sqrt(x);
}
} // namespace detail

/// True when x is neither NaN nor infinite (lockstep::is_finite).
struct is_finite_fn {
    template <class T>
    LOCKSTEP_HOST_DEVICE bool operator()(T x) const {
        return is_finite(x);
    }
};

/// An optimizer's step state in its system's memory: the count of applied steps, the skip flag
/// of the step in flight, and the per-step scalars of the last applied step.
template <class Scalars>
struct step_state {
    std::int64_t applied = 0; ///< steps applied so far (skipped steps do not count)
    int skip = 0;             ///< 1 while the step in flight is skipped: the drivers' noop flag
    Scalars scalars{};        ///< rule(t) of the last applied step t
};

/// The prologue of every optimizer step, run by one thread (a for_each over one index) before
/// the step's other passes, on the same stream. Reads *skip (null: never skip) into
/// state->skip; when the step is applied, t = applied + 1, scalars = rule(t), applied = t.
/// Rule is a functor `scalars (std::int64_t t)` evaluated in double.
template <class Rule>
struct begin_step {
    using scalars_type = decltype(std::declval<const Rule&>()(std::int64_t{1}));
    step_state<scalars_type>* state;
    const int* skip;
    Rule rule;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        const int skipped = noop_set(skip) ? 1 : 0;
        state->skip = skipped;
        if (skipped != 0)
            return;
        const std::int64_t t = state->applied + 1;
        state->scalars = rule(t);
        state->applied = t;
    }
};

/// No per-step scalars (LARS: only the count).
struct no_scalars {};
/// The rule of optimizers that only count their steps.
struct count_rule {
    LOCKSTEP_HOST_DEVICE no_scalars operator()(std::int64_t) const { return {}; }
};

/// SGD's per-step scalar: whether this is the first applied step (the momentum buffer starts as
/// the first d).
struct sgd_scalars {
    int first_step = 0;
};
/// SGD's rule: first_step = 1 at t = 1.
struct sgd_rule {
    LOCKSTEP_HOST_DEVICE sgd_scalars operator()(std::int64_t t) const { return {t == 1 ? 1 : 0}; }
};

/// Adam's per-step scalars at step t: step_size = lr / (1 - beta1^t), sqrt_bc2 =
/// sqrt(1 - beta2^t), in double (rounded to T once, in the update).
struct adam_scalars {
    double step_size = 0;
    double sqrt_bc2 = 1;
};
/// Adam's rule: the bias corrections of step t with the learning rate of this step.
struct adam_rule {
    double lr, beta1, beta2;
    LOCKSTEP_HOST_DEVICE adam_scalars operator()(std::int64_t t) const {
        const double td = static_cast<double>(t);
        const double bc1 = 1.0 - ::pow(beta1, td);
        const double bc2 = 1.0 - ::pow(beta2, td);
        return {lr / bc1, ::sqrt(bc2)};
    }
};

/// LAMB's per-step scalars at step t: 1 / (1 - beta1^t) and 1 / (1 - beta2^t), in double.
struct lamb_scalars {
    double inv_bc1 = 1;
    double inv_bc2 = 1;
};
/// LAMB's rule: the inverse bias corrections of step t.
struct lamb_rule {
    double beta1, beta2;
    LOCKSTEP_HOST_DEVICE lamb_scalars operator()(std::int64_t t) const {
        const double td = static_cast<double>(t);
        const double bc1 = 1.0 - ::pow(beta1, td);
        const double bc2 = 1.0 - ::pow(beta2, td);
        return {1.0 / bc1, 1.0 / bc2};
    }
};

/// SGD (torch.optim.SGD): d = g + wd_s w; with momentum: b = first ? d : mu b + (1 - damp) d,
/// d = nesterov ? d + mu b : b; then w -= lr d. wd_s = 0 on segments without decay; `first`
/// comes from the step state (the first applied step).
template <class T>
struct sgd_update {
    T* w;
    const T* g;
    T* m; ///< momentum buffer (unused when momentum == 0)
    const segment_flags* flags;
    const step_state<sgd_scalars>* step;
    T lr, momentum, one_minus_dampening, weight_decay;
    bool nesterov;

    struct scalars {
        T wd;
        bool first_step;
    };
    LOCKSTEP_HOST_DEVICE scalars segment(std::uint32_t s) const {
        return {flags[s].decay ? weight_decay : T(0), step->scalars.first_step != 0};
    }
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i, const scalars& s) const {
        const T wi = w[i];
        T d = g[i] + s.wd * wi;
        if (momentum != T(0)) {
            const T b = s.first_step ? d : momentum * m[i] + one_minus_dampening * d;
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
/// sqrt_bc2 = sqrt(1 - b2^t) (from the step state, computed by adam_rule).
template <class T>
struct adam_update {
    T* w;
    const T* g;
    T* m;
    T* v;
    const segment_flags* flags;
    const step_state<adam_scalars>* step;
    // The (1 - x) factors are computed in double on the host, then rounded once to T (as
    // PyTorch passes 1 - beta as a Python float): 1 - 0.999f in float is off by 1.3e-5.
    T beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor;
    bool decoupled;

    struct scalars {
        T wd;        ///< coupled L2 coefficient of the segment (0 for AdamW or !decay)
        T factor;    ///< decoupled factor 1 - lr wd of the segment (1 for Adam or !decay)
        T step_size; ///< lr / (1 - b1^t)
        T sqrt_bc2;  ///< sqrt(1 - b2^t)
    };
    LOCKSTEP_HOST_DEVICE scalars segment(std::uint32_t s) const {
        const adam_scalars a = step->scalars;
        const T size = static_cast<T>(a.step_size), root = static_cast<T>(a.sqrt_bc2);
        if (!flags[s].decay)
            return {T(0), T(1), size, root};
        return decoupled ? scalars{T(0), decay_factor, size, root}
                         : scalars{weight_decay, T(1), size, root};
    }
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i, const scalars& s) const {
        const T wi = w[i] * s.factor;
        const T gi = g[i] + s.wd * w[i];
        const T mi = beta1 * m[i] + one_minus_beta1 * gi;
        const T vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] = wi - s.step_size * mi / (detail::sqrt_t(vi) / s.sqrt_bc2 + eps);
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
    const sum_pair* norms = nullptr;      ///< set by the layerwise pass
    const segment_flags* flags = nullptr; ///< set by the layerwise pass
    double* scaled_lr = nullptr;          ///< set by the layerwise pass
    double* trust_out = nullptr;          ///< set by the layerwise pass
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
/// returns {w_i^2, u_i^2} for the per-segment trust ratio. 1 / bc1 and 1 / bc2 come from the
/// step state (lamb_rule).
template <class T>
struct lamb_moments {
    const T* w;
    const T* g;
    T* m;
    T* v;
    T* update;
    const segment_flags* flags;
    const step_state<lamb_scalars>* step;
    T beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
    struct scalars {
        T wd, inv_bc1, inv_bc2;
    };
    LOCKSTEP_HOST_DEVICE scalars segment(std::uint32_t s) const {
        const lamb_scalars b = step->scalars;
        return {flags[s].decay ? weight_decay : T(0), static_cast<T>(b.inv_bc1),
                static_cast<T>(b.inv_bc2)};
    }
    LOCKSTEP_HOST_DEVICE sum_pair operator()(std::size_t i, const scalars& s) const {
        const T wi = w[i], gi = g[i];
        const T mi = beta1 * m[i] + one_minus_beta1 * gi;
        const T vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const T u = (mi * s.inv_bc1) / (detail::sqrt_t(vi * s.inv_bc2) + eps) + s.wd * wi;
        update[i] = u;
        const double wd_ = static_cast<double>(wi), ud = static_cast<double>(u);
        return {wd_ * wd_, ud * ud};
    }
};

/// LAMB's trust ratio per segment from {||w||^2, ||u||^2}: phi(||w||) / ||u|| with
/// phi(z) = min(max(z, phi_min), phi_max) when the segment adapts and both norms are positive,
/// else 1; writes scaled_lr[s] = lr * ratio and trust_out[s] = ratio.
struct lamb_trust {
    const sum_pair* norms = nullptr;      ///< set by the layerwise pass
    const segment_flags* flags = nullptr; ///< set by the layerwise pass
    double* scaled_lr = nullptr;          ///< set by the layerwise pass
    double* trust_out = nullptr;          ///< set by the layerwise pass
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

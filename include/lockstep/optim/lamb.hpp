// lockstep/optim/lamb.hpp: LAMB, layer-wise adaptive moments (You et al. 2019).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/optim/detail/layerwise_block.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <limits>
#include <span>

namespace lockstep::optim {

/// Runtime knobs of optim::lamb. phi clamps ||w|| in the trust ratio: the default
/// [0, infinity) is the identity; the paper allows [gamma_l, gamma_u], e.g. {.phi_max = 10}.
struct lamb_params {
    double lr = 1e-3;           ///< learning rate (>= 0)
    double beta1 = 0.9;         ///< in [0, 1)
    double beta2 = 0.999;       ///< in [0, 1)
    double eps = 1e-6;          ///< > 0 (the paper's value)
    double weight_decay = 0.01; ///< lambda (>= 0), decoupled: added to the update
    double phi_min = 0.0;       ///< gamma_l (>= 0)
    double phi_max = std::numeric_limits<double>::infinity(); ///< gamma_u (>= phi_min)
};

/// LAMB over one flat buffer of tensors (You et al., "Large Batch Optimization for Deep
/// Learning: Training BERT in 76 minutes", ICLR 2020, Algorithm 2, with Adam's bias
/// correction as in NVIDIA's FusedLAMB). Per applied step t >= 1 (skipped steps do not count)
/// and tensor (segment) s:
///   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
///   r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lambda_s w   (lambda_s = 0 if !decay)
///   ratio_s = phi(||w_s||) / ||r_s||  if s adapts, ||w_s|| > 0 and ||r_s|| > 0; else 1
///   w = w - lr ratio_s r,   phi(z) = min(max(z, phi_min), phi_max)
/// Two fused passes: moments + r (kept in a scratch buffer) + per-tile ||w||^2, ||r||^2; then
/// the per-segment ratios and w -= lr ratio_s r. Norms are accumulated in double, in a fixed
/// order. The bias corrections are computed in double by a one-thread prologue in System memory,
/// where t lives. State: "exp_avg" (m), "exp_avg_sq" (v), step count t. The norms, their
/// reduction over replicas (set_norm_reduction) and trust_ratios() are layerwise_block's.
template <class T, class System = host_system>
class lamb : public detail::layerwise_block<T, System, lamb_params, kernels::lamb_rule, 2> {
    static_assert(std::is_floating_point_v<T>, "optim::lamb updates float or double parameters.");

public:
    /// State for n parameters laid out as `segments` (empty: one tensor). requires: lr,
    /// weight_decay, phi_min >= 0, 0 <= beta1, beta2 < 1, finite eps > 0 (at least T's smallest
    /// normal value), phi_max >= phi_min; lr and the others finite also as T.
    /// Throws lockstep::error otherwise.
    explicit lamb(std::size_t n, lamb_params p = {}, System sys = default_system<System>(),
                  std::span<const tensor_segment> segments = {})
        : base("lamb", {"exp_avg", "exp_avg_sq"}, {true, true}, n, p, sys, segments),
          update_(n, sys_) {
        detail::check_param<T>("lamb", "lr", p.lr, 0.0);
        detail::check_param<T>("lamb", "beta1", p.beta1, 0.0);
        detail::check_param<T>("lamb", "beta2", p.beta2, 0.0);
        detail::check_param<T>("lamb", "weight_decay", p.weight_decay, 0.0);
        detail::check_param<T>("lamb", "phi_min", p.phi_min, 0.0);
        LOCKSTEP_REQUIRE(
            p.beta1 < 1 && p.beta2 < 1 && p.eps > 0 && is_finite(p.eps) && p.phi_max >= p.phi_min,
            errc::invalid_argument, -1, "lamb",
            "need beta1 < 1, beta2 < 1, finite eps > 0, phi_max >= phi_min (beta1 = ", p.beta1,
            ", beta2 = ", p.beta2, ", eps = ", p.eps, ", phi = [", p.phi_min, ", ", p.phi_max,
            "])");
        detail::check_eps<T>("lamb", p.eps);
    }

    /// One update of w from g, unless *skip != 0 when the step's kernels run. requires:
    /// w.size() == g.size() == size(), System memory; skip null (never skip) or one int in
    /// System memory, set before the step on the system's stream. ensures: applied: w, m, v
    /// updated with the bias corrections of t = step_count() + 1, step_count() grows by one,
    /// trust_ratios() holds this step's ratios; skipped: w, m, v, trust_ratios() and
    /// step_count() unchanged. The flag is read by the kernels only: no host synchronisation,
    /// no allocation.
    void step(std::span<T> w, std::span<const T> g, const int* skip) {
        detail::check_step("lamb.step", this->size(), w.size(), g.size());
        count_.begin(sys_, skip, kernels::lamb_rule{p_.beta1, p_.beta2});
        const int* noop = count_.noop();
        this->trust_pass(
            kernels::lamb_moments<T>{.w = w.data(),
                                     .g = g.data(),
                                     .m = this->slot(0),
                                     .v = this->slot(1),
                                     .update = update_.data(),
                                     .flags = layout_.flags(),
                                     .step = count_.state(),
                                     .beta1 = static_cast<T>(p_.beta1),
                                     .one_minus_beta1 = static_cast<T>(1.0 - p_.beta1),
                                     .beta2 = static_cast<T>(p_.beta2),
                                     .one_minus_beta2 = static_cast<T>(1.0 - p_.beta2),
                                     .eps = static_cast<T>(p_.eps),
                                     .weight_decay = static_cast<T>(p_.weight_decay)},
            kernels::lamb_trust{.lr = p_.lr, .phi_min = p_.phi_min, .phi_max = p_.phi_max}, noop);
        layout_.apply(sys_,
                      kernels::lamb_apply<T>{
                          .w = w.data(), .update = update_.data(), .scaled_lr = this->scaled_lr()},
                      noop);
    }
    /// step(w, g, nullptr): a step that is always applied.
    void step(std::span<T> w, std::span<const T> g) { step(w, g, nullptr); }

private:
    using base = detail::layerwise_block<T, System, lamb_params, kernels::lamb_rule, 2>;
    using base::count_;
    using base::layout_;
    using base::p_;
    using base::sys_;
    buffer<T, System> update_; ///< r of the step, between its two passes
};

} // namespace lockstep::optim

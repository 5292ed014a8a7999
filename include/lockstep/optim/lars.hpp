// lockstep/optim/lars.hpp: LARS, layer-wise adaptive rate scaling with momentum (You, Gitman,
// Ginsburg 2017). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/optim/detail/layerwise_block.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <span>

namespace lockstep::optim {

/// Runtime knobs of optim::lars.
struct lars_params {
    double lr = 0.1;           ///< global learning rate gamma (>= 0), usually warmed up
    double momentum = 0.9;     ///< mu in [0, 1]
    double eta = 1e-3;         ///< trust coefficient (> 0)
    double weight_decay = 0.0; ///< beta (>= 0)
    double eps = 1e-8;         ///< added to the trust ratio's denominator (>= 0)
};

/// LARS over one flat buffer of tensors (You, Gitman, Ginsburg, "Large Batch Training of
/// Convolutional Networks", arXiv:1708.03888, Algorithm 1, as MLPerf's and NVIDIA's
/// implementations run it). For each tensor (segment) s, per step:
///   trust_s = eta ||w_s|| / (||g_s|| + beta_s ||w_s|| + eps)  if s adapts, ||w_s|| > 0 and
///             ||g_s|| > 0; else 1                               (beta_s = 0 when !decay)
///   v = mu v + gamma trust_s (g + beta_s w);   w = w - v        (every element of s)
/// Two passes: a segmented reduction of ||w_s||^2 and ||g_s||^2 (per tile, then per segment in
/// a fixed order: deterministic), then one fused update. The norms are accumulated in double.
/// Segments with adapt = false (biases, BN gamma/beta) get plain momentum SGD.
/// State: "momentum" (v) and the step count (applied steps, in System memory). The norms, their
/// reduction over replicas (set_norm_reduction) and trust_ratios() are layerwise_block's.
template <class T, class System = host_system>
class lars : public detail::layerwise_block<T, System, lars_params, kernels::count_rule, 1> {
    static_assert(std::is_floating_point_v<T>, "optim::lars updates float or double parameters.");

public:
    /// State for n parameters laid out as `segments` (empty: one tensor). requires:
    /// lr, weight_decay, eps finite and >= 0, momentum in [0, 1], eta finite and > 0. Throws
    /// lockstep::error otherwise.
    explicit lars(std::size_t n, lars_params p = {}, System sys = default_system<System>(),
                  std::span<const tensor_segment> segments = {})
        : base("lars", {"momentum"}, {true}, n, p, sys, segments) {
        detail::check_param<T>("lars", "lr", p.lr, 0.0);
        detail::check_param<T>("lars", "momentum", p.momentum, 0.0);
        detail::check_param<T>("lars", "weight_decay", p.weight_decay, 0.0);
        detail::check_param<T>("lars", "eps", p.eps, 0.0);
        LOCKSTEP_REQUIRE(p.eta > 0 && is_finite(p.eta), errc::invalid_argument, -1, "lars",
                         "eta = ", p.eta, " (must be finite and > 0)");
        LOCKSTEP_REQUIRE(p.momentum <= 1, errc::invalid_argument, -1, "lars",
                         "momentum = ", p.momentum, " (must be in [0, 1])");
    }

    /// One update of w from g, unless *skip != 0 when the step's kernels run. requires:
    /// w.size() == g.size() == size(), System memory; skip null (never skip) or one int in
    /// System memory, set before the step on the system's stream. ensures: applied: w and v
    /// updated, step_count() grows by one, trust_ratios() holds this step's ratios; skipped: w,
    /// v, trust_ratios() and step_count() unchanged. The flag is read by the kernels only: no
    /// host synchronisation, no allocation.
    void step(std::span<T> w, std::span<const T> g, const int* skip) {
        detail::check_step("lars.step", this->size(), w.size(), g.size());
        count_.begin(sys_, skip, kernels::count_rule{});
        const int* noop = count_.noop();
        this->trust_pass(
            kernels::norm2_w_g<T>{w.data(), g.data()},
            kernels::lars_trust{
                .lr = p_.lr, .eta = p_.eta, .weight_decay = p_.weight_decay, .eps = p_.eps},
            noop);
        layout_.apply(sys_,
                      kernels::lars_update<T>{.w = w.data(),
                                              .g = g.data(),
                                              .v = this->slot(0),
                                              .flags = layout_.flags(),
                                              .scaled_lr = this->scaled_lr(),
                                              .momentum = static_cast<T>(p_.momentum),
                                              .weight_decay = static_cast<T>(p_.weight_decay)},
                      noop);
    }
    /// step(w, g, nullptr): a step that is always applied.
    void step(std::span<T> w, std::span<const T> g) { step(w, g, nullptr); }

private:
    using base = detail::layerwise_block<T, System, lars_params, kernels::count_rule, 1>;
    using base::count_;
    using base::layout_;
    using base::p_;
    using base::sys_;
};

} // namespace lockstep::optim

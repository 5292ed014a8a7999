// lockstep/optim/adam.hpp: Adam and AdamW (decoupled weight decay), as torch.optim.Adam and
// torch.optim.AdamW define them. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/optim/detail/flat_layout.hpp"
#include "lockstep/optim/detail/state_block.hpp"
#include "lockstep/optim/detail/step_counter.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

namespace lockstep::optim {

/// Runtime knobs of optim::adam (L2 weight decay added to the gradient).
struct adam_params {
    double lr = 1e-3;          ///< learning rate (>= 0)
    double beta1 = 0.9;        ///< first-moment decay, in [0, 1)
    double beta2 = 0.999;      ///< second-moment decay, in [0, 1)
    double eps = 1e-8;         ///< added to the bias-corrected sqrt(v), > 0
    double weight_decay = 0.0; ///< lambda (>= 0)
};

/// Runtime knobs of optim::adamw (decoupled weight decay; PyTorch's default lambda 0.01).
struct adamw_params {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 1e-2;
};

namespace detail {
/// Adam and AdamW share everything but where the decay goes. Per element, at applied step t >= 1
/// (Kingma & Ba 2015, Algorithm 1; Loshchilov & Hutter 2019 for AdamW; the forms of
/// torch.optim.Adam / AdamW with amsgrad = False, maximize = False):
///   Adam:  g' = g + lambda_s w                     AdamW: w = w (1 - lr lambda_s), g' = g
///   m = beta1 m + (1 - beta1) g'
///   v = beta2 v + (1 - beta2) g'^2
///   w = w - (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)     (eps outside sqrt)
/// lambda_s = weight_decay, 0 on segments with !decay. Skipped steps do not count in t. The
/// bias corrections are computed in double each step by a one-thread prologue in System memory,
/// where t lives (see step(w, g, skip)). State: "exp_avg" (m), "exp_avg_sq" (v), step count t.
template <class T, class System, class Params, bool Decoupled>
class adam_impl : public state_block<T, System, Params, kernels::adam_rule, 2> {
    static_assert(std::is_floating_point_v<T>, "optim::adam updates float or double parameters.");

public:
    /// State for a flat buffer of n parameters (moments zero, step 0). requires: lr,
    /// weight_decay >= 0, 0 <= beta1, beta2 < 1, finite eps > 0 (every value finite, also as T;
    /// eps at least T's smallest normal value); segments as
    /// tensor_segment says (only `decay` is used). Throws lockstep::error (invalid_argument)
    /// otherwise.
    explicit adam_impl(std::size_t n, Params p = {}, System sys = default_system<System>(),
                       std::span<const tensor_segment> segments = {})
        : state_block<T, System, Params, kernels::adam_rule, 2>(name(), {"exp_avg", "exp_avg_sq"},
                                                                {true, true}, n, p, sys, segments) {
        check_param<T>(name(), "lr", p.lr, 0.0);
        check_param<T>(name(), "beta1", p.beta1, 0.0);
        check_param<T>(name(), "beta2", p.beta2, 0.0);
        check_param<T>(name(), "weight_decay", p.weight_decay, 0.0);
        LOCKSTEP_REQUIRE(p.beta1 < 1 && p.beta2 < 1 && p.eps > 0 && is_finite(p.eps),
                         errc::invalid_argument, -1, name(),
                         "need beta1 < 1, beta2 < 1, finite eps > 0 (beta1 = ", p.beta1,
                         ", beta2 = ", p.beta2, ", eps = ", p.eps, ")");
        check_eps<T>(name(), p.eps);
    }

    /// One update of w from g, unless *skip != 0 when the step's kernels run. requires:
    /// w.size() == g.size() == size(), System memory; skip null (never skip) or one int in
    /// System memory, set before the step on the system's stream. ensures: applied: w, m, v
    /// updated with the bias corrections of t = step_count() + 1, step_count() grows by one;
    /// skipped: w, m, v and step_count() unchanged. The flag is read by the kernels only: no
    /// host synchronisation, no allocation.
    void step(std::span<T> w, std::span<const T> g, const int* skip) {
        check_step(Decoupled ? "adamw.step" : "adam.step", this->size(), w.size(), g.size());
        count_.begin(sys_, skip, kernels::adam_rule{p_.lr, p_.beta1, p_.beta2});
        const kernels::adam_update<T> f{.w = w.data(),
                                        .g = g.data(),
                                        .m = this->slot(0),
                                        .v = this->slot(1),
                                        .flags = layout_.flags(),
                                        .step = count_.state(),
                                        .beta1 = static_cast<T>(p_.beta1),
                                        .one_minus_beta1 = static_cast<T>(1.0 - p_.beta1),
                                        .beta2 = static_cast<T>(p_.beta2),
                                        .one_minus_beta2 = static_cast<T>(1.0 - p_.beta2),
                                        .eps = static_cast<T>(p_.eps),
                                        .weight_decay = static_cast<T>(p_.weight_decay),
                                        .decay_factor =
                                            static_cast<T>(1.0 - p_.lr * p_.weight_decay),
                                        .decoupled = Decoupled};
        layout_.apply(sys_, f, count_.noop());
    }
    /// step(w, g, nullptr): a step that is always applied.
    void step(std::span<T> w, std::span<const T> g) { step(w, g, nullptr); }

private:
    static constexpr const char* name() { return Decoupled ? "adamw" : "adam"; }

    using base = state_block<T, System, Params, kernels::adam_rule, 2>;
    using base::count_;
    using base::layout_;
    using base::p_;
    using base::sys_;
};
} // namespace detail

/// Adam (torch.optim.Adam): weight decay is an L2 term added to the gradient. See
/// detail::adam_impl for the update equations.
template <class T, class System = host_system>
using adam = detail::adam_impl<T, System, adam_params, false>;

/// AdamW (torch.optim.AdamW): decoupled weight decay w = w (1 - lr lambda) before the Adam step.
/// See detail::adam_impl for the update equations.
template <class T, class System = host_system>
using adamw = detail::adam_impl<T, System, adamw_params, true>;

} // namespace lockstep::optim

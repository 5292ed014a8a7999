// lockstep/optim/sgd.hpp: stochastic gradient descent with momentum, dampening, Nesterov and
// weight decay, as torch.optim.SGD defines it. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/optim/detail/flat_layout.hpp"
#include "lockstep/optim/detail/state_block.hpp"
#include "lockstep/optim/detail/step_counter.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

namespace lockstep::optim {

/// Runtime knobs of optim::sgd (designated initialisers: `{.lr = 0.1, .momentum = 0.9}`).
struct sgd_params {
    double lr = 0.01;          ///< learning rate (>= 0); schedules change it with set_lr
    double momentum = 0.0;     ///< mu in [0, 1]; 0 keeps no momentum buffer
    double dampening = 0.0;    ///< tau in [0, 1]
    double weight_decay = 0.0; ///< L2 penalty lambda (>= 0), added to the gradient
    bool nesterov = false;     ///< requires momentum > 0 and dampening == 0 (as PyTorch)
};

/// SGD over one flat parameter buffer, in one fused kernel per step (torch.optim.SGD,
/// https://pytorch.org/docs/stable/generated/torch.optim.SGD.html). Per element, at applied
/// step t (t = 1 for the first step; skipped steps do not count):
///   d = g + lambda_s w                   (lambda_s = weight_decay, 0 on segments with !decay)
///   if mu != 0:  b = d                   (t = 1: the buffer starts as the first d)
///                b = mu b + (1 - tau) d  (t > 1)
///                d = nesterov ? d + mu b : b
///   w = w - lr d
/// Arithmetic in T (float or double). State: "momentum" (b, when mu != 0) and the step count,
/// which lives in System memory (see step(w, g, skip)).
template <class T, class System = host_system>
class sgd : public detail::state_block<T, System, sgd_params, kernels::sgd_rule, 1> {
    static_assert(std::is_floating_point_v<T>, "optim::sgd updates float or double parameters.");

public:
    /// Optimizer state for a flat buffer of n parameters (momentum zero, step 0).
    /// requires: lr, weight_decay finite and >= 0; momentum in [0, 1]; 0 <= dampening <= 1;
    /// nesterov only with momentum > 0 and dampening == 0; segments as tensor_segment says (only
    /// `decay` is used). Throws lockstep::error (invalid_argument) otherwise.
    explicit sgd(std::size_t n, sgd_params p = {}, System sys = default_system<System>(),
                 std::span<const tensor_segment> segments = {})
        : detail::state_block<T, System, sgd_params, kernels::sgd_rule, 1>(
              "sgd", {"momentum"}, {p.momentum != 0}, n, p, sys, segments) {
        detail::check_param<T>("sgd", "lr", p.lr, 0.0);
        detail::check_param<T>("sgd", "momentum", p.momentum, 0.0);
        detail::check_param<T>("sgd", "dampening", p.dampening, 0.0);
        detail::check_param<T>("sgd", "weight_decay", p.weight_decay, 0.0);
        LOCKSTEP_REQUIRE(p.momentum <= 1.0, errc::invalid_argument, -1, "sgd",
                         "momentum = ", p.momentum, " (must be in [0, 1])");
        LOCKSTEP_REQUIRE(p.dampening <= 1.0, errc::invalid_argument, -1, "sgd",
                         "dampening = ", p.dampening, " (must be <= 1)");
        LOCKSTEP_REQUIRE(
            !p.nesterov || (p.momentum > 0 && p.dampening == 0), errc::invalid_argument, -1, "sgd",
            "Nesterov momentum requires momentum > 0 and dampening == 0 (momentum = ", p.momentum,
            ", dampening = ", p.dampening, ")");
    }

    /// One update of w from g, unless *skip != 0 when the step's kernels run. requires:
    /// w.size() == g.size() == size(), both in System memory; skip null (never skip) or one int
    /// in System memory, set before the step on the system's stream (a NaN gradient poisons w
    /// and the momentum: set the flag when g is not finite). ensures: applied: w and the
    /// momentum updated, step_count() grows by one; skipped: w, the momentum and step_count()
    /// unchanged. The flag is read by the kernels only: no host synchronisation, no allocation.
    void step(std::span<T> w, std::span<const T> g, const int* skip) {
        detail::check_step("sgd.step", this->size(), w.size(), g.size());
        count_.begin(sys_, skip, kernels::sgd_rule{});
        const kernels::sgd_update<T> f{.w = w.data(),
                                       .g = g.data(),
                                       .m = this->slot(0),
                                       .flags = layout_.flags(),
                                       .step = count_.state(),
                                       .lr = static_cast<T>(p_.lr),
                                       .momentum = static_cast<T>(p_.momentum),
                                       .one_minus_dampening = static_cast<T>(1.0 - p_.dampening),
                                       .weight_decay = static_cast<T>(p_.weight_decay),
                                       .nesterov = p_.nesterov};
        layout_.apply(sys_, f, count_.noop());
    }
    /// step(w, g, nullptr): a step that is always applied.
    void step(std::span<T> w, std::span<const T> g) { step(w, g, nullptr); }

private:
    using base = detail::state_block<T, System, sgd_params, kernels::sgd_rule, 1>;
    using base::count_;
    using base::layout_;
    using base::p_;
    using base::sys_;
};

} // namespace lockstep::optim

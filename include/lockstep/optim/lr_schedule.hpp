// lockstep/optim/lr_schedule.hpp: learning-rate schedules (constant, linear scaling rule with
// warm-up, cosine decay) as plain value types. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <cmath>
#include <concepts>
#include <cstdint>

namespace lockstep::optim {

/// A schedule maps a 0-based step index to a learning rate. Every schedule here is also
/// callable, so it can be passed where a std::function<double(std::int64_t)> is expected
/// (e.g. train_params::lr).
template <class S>
concept lr_schedule = requires(const S& s, std::int64_t step) {
    { s.lr(step) } -> std::convertible_to<double>;
};

/// The linear scaling rule (Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in
/// 1 Hour", 2017, section 2.1): base_lr * global_batch / base_batch.
/// requires: base_batch > 0, global_batch > 0.
inline double scaled_lr(double base_lr, std::int64_t global_batch, std::int64_t base_batch) {
    LOCKSTEP_REQUIRE(base_batch > 0 && global_batch > 0, errc::invalid_argument, -1, "scaled_lr",
                     "batches must be positive (global_batch = ", global_batch,
                     ", base_batch = ", base_batch, ")");
    return base_lr * static_cast<double>(global_batch) / static_cast<double>(base_batch);
}

namespace detail {
inline void check_step_index(const char* op, std::int64_t step) {
    LOCKSTEP_REQUIRE(step >= 0, errc::invalid_argument, -1, op, "step = ", step, " (must be >= 0)");
}
} // namespace detail

/// The same learning rate at every step.
struct constant_lr {
    double value = 0.1;
    /// ensures: value. requires: step >= 0.
    double lr(std::int64_t step) const {
        detail::check_step_index("constant_lr", step);
        return value;
    }
    double operator()(std::int64_t step) const { return lr(step); }
};

/// Where a linear warm-up starts.
enum class warmup_start {
    base_lr, ///< from the unscaled base_lr (Goyal et al.'s gradual warm-up)
    zero     ///< from 0
};

/// The linear scaling rule with gradual warm-up (Goyal et al. 2017, sections 2.1-2.2):
/// target = base_lr * global_batch / base_batch;
/// lr(s) = start + (target - start) * s / warmup_steps  for s < warmup_steps,
/// lr(s) = target                                       for s >= warmup_steps,
/// where start = base_lr (the paper: "start from a learning rate of eta and increment it by a
/// constant amount at each iteration such that it reaches k eta") or 0. So lr(0) = start and
/// lr(warmup_steps) is the first step at the target. warmup_steps = 0: target from step 0.
struct linear_scaling {
    double base_lr = 0.1;            ///< the learning rate tuned for base_batch
    std::int64_t base_batch = 256;   ///< the batch base_lr was tuned for (> 0)
    std::int64_t global_batch = 256; ///< the global batch actually used (> 0)
    std::int64_t warmup_steps = 0;   ///< steps of linear ramp (>= 0)
    warmup_start start = warmup_start::base_lr;

    /// The scaled learning rate the warm-up reaches.
    double target() const { return scaled_lr(base_lr, global_batch, base_batch); }
    /// requires: step >= 0, warmup_steps >= 0 (throws lockstep::error otherwise).
    double lr(std::int64_t step) const {
        detail::check_step_index("linear_scaling", step);
        LOCKSTEP_REQUIRE(warmup_steps >= 0, errc::invalid_argument, -1, "linear_scaling",
                         "warmup_steps = ", warmup_steps, " (must be >= 0)");
        const double t = target();
        if (step >= warmup_steps)
            return t;
        const double s0 = start == warmup_start::base_lr ? base_lr : 0.0;
        return s0 + (t - s0) * static_cast<double>(step) / static_cast<double>(warmup_steps);
    }
    double operator()(std::int64_t step) const { return lr(step); }
};

/// Cosine decay (Loshchilov & Hutter, "SGDR", 2017, without restarts) after an optional
/// linear warm-up from warmup_start_lr to base_lr:
/// lr(s) = warmup_start_lr + (base_lr - warmup_start_lr) * s / W          for s < W,
/// lr(s) = final_lr + (base_lr - final_lr) (1 + cos(pi (s - W) / (T - W))) / 2   for W <= s < T,
/// lr(s) = final_lr                                                      for s >= T,
/// with W = warmup_steps, T = total_steps. For the linear scaling rule, set base_lr to
/// scaled_lr(base, global_batch, base_batch).
struct cosine {
    double base_lr = 0.1;            ///< the peak learning rate
    double final_lr = 0.0;           ///< the learning rate at and after total_steps
    std::int64_t total_steps = 1000; ///< steps until final_lr (> warmup_steps)
    std::int64_t warmup_steps = 0;   ///< linear warm-up steps (>= 0)
    double warmup_start_lr = 0.0;    ///< the learning rate of step 0 when warming up

    /// requires: step >= 0, 0 <= warmup_steps < total_steps (throws lockstep::error otherwise).
    double lr(std::int64_t step) const {
        detail::check_step_index("cosine", step);
        LOCKSTEP_REQUIRE(warmup_steps >= 0 && total_steps > warmup_steps, errc::invalid_argument,
                         -1, "cosine",
                         "need 0 <= warmup_steps < total_steps (warmup_steps = ", warmup_steps,
                         ", total_steps = ", total_steps, ")");
        if (step < warmup_steps)
            return warmup_start_lr + (base_lr - warmup_start_lr) * static_cast<double>(step) /
                                         static_cast<double>(warmup_steps);
        if (step >= total_steps)
            return final_lr;
        const double p = static_cast<double>(step - warmup_steps) /
                         static_cast<double>(total_steps - warmup_steps);
        return final_lr + (base_lr - final_lr) * 0.5 * (1.0 + std::cos(3.141592653589793 * p));
    }
    double operator()(std::int64_t step) const { return lr(step); }
};

} // namespace lockstep::optim

// lockstep/train/loss_scaler.hpp: loss_scaling (the dynamic loss scale's knobs), loss_scaler_state
// (its checkpointable state) and loss_scaler<System>, which keeps the scale in the system's memory
// and updates it on the device from a step's status. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/system/buffer.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep {

/// The knobs of a dynamic loss scale (as torch.cuda.amp.GradScaler): the user's backward
/// multiplies the loss's gradient by the scale S, so that small gradients survive 16-bit
/// arithmetic; the trainer multiplies the reduced gradient by 1 / S before the update. A step
/// whose gradient has a NaN or infinity (an overflow) is skipped and S *= backoff_factor; after
/// growth_interval consecutive applied steps, S *= growth_factor, at most the scaler's max_scale
/// (max_loss_scale<float>() = 2^126 by default). Powers of two (the defaults) make scaling and
/// unscaling exact. S never backs off below min_scale (the floor): a step that overflows at the
/// floor is skipped with S kept, and counts towards train_params::max_consecutive_skips (the skips
/// of a scale still backing off do not).
struct loss_scaling {
    double init_scale = 65536.0;         ///< S of the first step: > 0, <= the scaler's max_scale
    double growth_factor = 2.0;          ///< > 1
    double backoff_factor = 0.5;         ///< in (0, 1)
    std::int64_t growth_interval = 2000; ///< in [1, 2^52]
    /// The floor of S: >= 1 / the scaler's max_scale (2^-126), <= init_scale. 1 (as DeepSpeed's
    /// min_loss_scale): below 1 the scale no longer protects small gradients, and a gradient that
    /// overflows unscaled is not a scaling problem; 65536 reaches it in 16 back-offs.
    double min_scale = 1.0;
};

/// The largest loss scale S for gradients of type T: the largest power of two such that S and
/// 1 / S are both normal numbers of T (2^126 for float, 2^1022 for double), so that the unscale
/// factor 1 / S cast to T is exact and never flushes to 0 (for float it would at S = 2^150).
/// requires: T an IEEE binary floating-point type.
template <class T>
constexpr double max_loss_scale() noexcept {
    static_assert(
        std::numeric_limits<T>::is_iec559,
        "max_loss_scale<T>: T must be an IEEE binary floating-point type (float, double)");
    const int up = std::numeric_limits<T>::max_exponent - 1;   // largest normal 2^up
    const int down = 1 - std::numeric_limits<T>::min_exponent; // smallest normal 2^-down
    double s = 1.0;
    for (int k = 0; k < (up < down ? up : down); ++k)
        s *= 2.0;
    return s;
}

/// A loss scaler's state between steps (what a checkpoint stores): the scale of the next step
/// and the number of consecutive applied steps since the scale last changed.
struct loss_scaler_state {
    double scale = 1.0;
    std::int64_t growth_tracker = 0;
    friend bool operator==(const loss_scaler_state&, const loss_scaler_state&) = default;
};

/// The scale after a step's report (a kernels::loss_scale_record), as the host reads it at the
/// end of a step.
struct loss_scale_report {
    double used = 1.0; ///< the scale the step's backward used
    loss_scaler_state next{};
};

/// One replica's dynamic loss scale, kept in System memory (scale, growth tracker, 1 / scale) so
/// that a step never waits on the host for it: unscale() and update() are kernels that read and
/// write it on the system's stream. Disabled (constructed with no loss_scaling), the scale is 1
/// forever and unscale()/update() do nothing. Decisions depend only on the status passed to
/// update(): replicas that pass the same (all-reduced) status stay bitwise identical. The scale
/// stays within [1 / max_scale, max_scale]: unscaling gradients of any T whose
/// max_loss_scale<T>() >= max_scale is exact (the default, float's bound, holds for float and
/// double).
template <execution_system System>
class loss_scaler {
public:
    using system_type = System;

    /// requires: cfg, when given, within the ranges loss_scaling states for this max_scale (else
    /// lockstep::error, invalid_argument, naming `rank`); max_scale a power of two in [1,
    /// max_loss_scale<double>()]. ensures: state() == {cfg->init_scale, 0} (or {1, 0}).
    explicit loss_scaler(std::optional<loss_scaling> cfg, System sys = default_system<System>(),
                         int rank = -1, double max_scale = max_loss_scale<float>())
        : cfg_(cfg.value_or(loss_scaling{})), enabled_(cfg.has_value()), sys_(sys), rank_(rank),
          max_scale_(max_scale), state_(1, sys) {
        int e = 0;
        LOCKSTEP_REQUIRE(max_scale >= 1 && max_scale <= max_loss_scale<double>() &&
                             std::frexp(max_scale, &e) == 0.5,
                         errc::invalid_argument, rank_, "loss_scaler", "max_scale = ", max_scale,
                         " (must be a power of two in [1, max_loss_scale<double>()])");
        if (enabled_)
            check_config(cfg_, rank_, max_scale_);
        write({enabled_ ? cfg_.init_scale : 1.0, 0});
    }

    bool enabled() const noexcept { return enabled_; }
    const loss_scaling& config() const noexcept { return cfg_; }
    /// The largest scale (growth stops there).
    double max_scale() const noexcept { return max_scale_; }

    /// The current scale, one double in System memory (1 when disabled): read it in device code
    /// that seeds the backward pass. Valid for the scaler's lifetime; update() changes its value.
    const double* scale_device() const noexcept { return &state_.data()->scale; }
    /// 1 / the current scale, one double in System memory (the unscale factor).
    const double* inverse_device() const noexcept { return &state_.data()->inverse; }
    /// The whole state (scale, growth tracker, inverse), in System memory.
    const kernels::loss_scale_device_state* state_device() const noexcept { return state_.data(); }

    /// The current scale on the host when it is known without a wait: on a host system always
    /// (a plain read of host memory); on a device system after construction, restore(), or a
    /// report observe()d since the last update(). Otherwise nullopt.
    std::optional<double> known_scale() const {
        if constexpr (System::is_host) // the host may read the system's memory directly
            return state_[0].scale;
        else
            return known_;
    }

    /// grads *= 1 / scale on the system's stream (no host read). No-op when disabled.
    template <class T>
    void unscale(std::span<T> grads) const {
        if (enabled_)
            kernels::multiply_by(sys_, grads, inverse_device());
    }

    /// The scale update of a step whose status is final: see kernels::loss_scale_update_fn
    /// (overflow: the step's non-finite gradient count, skipped: its skip decision, report: where
    /// the host's end-of-step read finds the outcome; all in System memory). One one-thread
    /// kernel, no host read. Disabled: nothing (observe() then reports scale 1).
    void update(const double* overflow, const double* skipped, kernels::loss_scale_record* report) {
        if (!enabled_)
            return;
        known_.reset();
        kernels::for_each_index(
            sys_, 1,
            kernels::loss_scale_update_fn{.state = state_.data(),
                                          .overflow = overflow,
                                          .skipped = skipped,
                                          .report = report,
                                          .growth = cfg_.growth_factor,
                                          .backoff = cfg_.backoff_factor,
                                          .interval = static_cast<double>(cfg_.growth_interval),
                                          .floor = cfg_.min_scale,
                                          .ceiling = max_scale_});
    }

    /// The host's view of a step's report (read back to the host). When the report is of the
    /// last update(), the scale becomes known on the host (known_scale()). Disabled: {1, {1, 0}}
    /// whatever report holds.
    loss_scale_report observe(const kernels::loss_scale_record& report, bool last) {
        if (!enabled_)
            return {};
        loss_scale_report r{report.used,
                            {report.next, static_cast<std::int64_t>(report.growth_tracker)}};
        if (last)
            known_ = r.next.scale;
        return r;
    }

    /// The state between steps (one synchronising read on a device system: not for use inside a
    /// step).
    loss_scaler_state state() const {
        kernels::loss_scale_device_state s;
        copy(std::span<const kernels::loss_scale_device_state>(state_.span()), sys_,
             std::span<kernels::loss_scale_device_state>(&s, 1), host_system{1});
        return {s.scale, static_cast<std::int64_t>(s.growth_tracker)};
    }

    /// Restores a state() (e.g. from a checkpoint). requires: scale finite and > 0 (exactly 1
    /// when disabled), 0 <= growth_tracker < growth_interval; else lockstep::error
    /// (invalid_argument) and nothing changes. ensures: a scale within [min_scale, max_scale()]
    /// is restored as given; one outside (a run resumed with a higher min_scale, or saved by a
    /// scaler with a higher max_scale) starts at the nearer bound with growth_tracker 0.
    void restore(const loss_scaler_state& s) {
        LOCKSTEP_REQUIRE(is_finite(s.scale) && s.scale > 0, errc::invalid_argument, rank_,
                         "loss_scaler.restore", "scale = ", s.scale, " (must be finite and > 0)");
        LOCKSTEP_REQUIRE(enabled_ || (s.scale == 1.0 && s.growth_tracker == 0),
                         errc::invalid_argument, rank_, "loss_scaler.restore",
                         "loss scaling is off but the state has scale = ", s.scale,
                         ", growth_tracker = ", s.growth_tracker);
        LOCKSTEP_REQUIRE(s.growth_tracker >= 0 && s.growth_tracker < cfg_.growth_interval,
                         errc::invalid_argument, rank_, "loss_scaler.restore",
                         "growth_tracker = ", s.growth_tracker, " (must be in [0, ",
                         cfg_.growth_interval, "))");
        if (enabled_ && (s.scale < cfg_.min_scale || s.scale > max_scale_)) {
            write({s.scale < cfg_.min_scale ? cfg_.min_scale : max_scale_, 0});
            return;
        }
        write(s);
    }

    /// Throws lockstep::error (invalid_argument, naming rank) unless c is within the ranges
    /// loss_scaling states for a scaler whose largest scale is max_scale.
    static void check_config(const loss_scaling& c, int rank,
                             double max_scale = max_loss_scale<float>()) {
        LOCKSTEP_REQUIRE(is_finite(c.init_scale) && c.init_scale > 0, errc::invalid_argument, rank,
                         "loss_scaling", "init_scale = ", c.init_scale,
                         " (must be finite and > 0)");
        LOCKSTEP_REQUIRE(c.init_scale <= max_scale, errc::invalid_argument, rank, "loss_scaling",
                         "init_scale = ", c.init_scale, " is above the largest loss scale ",
                         max_scale, " = 2^", std::ilogb(max_scale),
                         " (max_loss_scale<T> of the gradients' type T: beyond it 1 / scale is "
                         "not a normal number of T, and unscaled gradients lose bits or become 0)");
        LOCKSTEP_REQUIRE(is_finite(c.growth_factor) && c.growth_factor > 1, errc::invalid_argument,
                         rank, "loss_scaling", "growth_factor = ", c.growth_factor,
                         " (must be finite and > 1)");
        LOCKSTEP_REQUIRE(c.backoff_factor > 0 && c.backoff_factor < 1, errc::invalid_argument, rank,
                         "loss_scaling", "backoff_factor = ", c.backoff_factor,
                         " (must be in (0, 1))");
        LOCKSTEP_REQUIRE(c.growth_interval >= 1 && c.growth_interval <= (std::int64_t(1) << 52),
                         errc::invalid_argument, rank, "loss_scaling",
                         "growth_interval = ", c.growth_interval, " (must be in [1, 2^52])");
        LOCKSTEP_REQUIRE(is_finite(c.min_scale) && c.min_scale > 0 && c.min_scale <= c.init_scale,
                         errc::invalid_argument, rank, "loss_scaling", "min_scale = ", c.min_scale,
                         " (must be finite, > 0 and <= init_scale = ", c.init_scale, ")");
        LOCKSTEP_REQUIRE(c.min_scale >= 1.0 / max_scale, errc::invalid_argument, rank,
                         "loss_scaling", "min_scale = ", c.min_scale,
                         " is below the smallest loss scale ", 1.0 / max_scale, " = 2^-",
                         std::ilogb(max_scale),
                         " (1 / max_loss_scale<T> of the gradients' type T: below it the scale "
                         "is not a normal number of T and 1 / scale overflows)");
    }

private:
    void write(const loss_scaler_state& s) {
        const kernels::loss_scale_device_state v{s.scale, static_cast<double>(s.growth_tracker),
                                                 1.0 / s.scale};
        copy(std::span<const kernels::loss_scale_device_state>(&v, 1), host_system{1},
             state_.span(), sys_);
        known_ = s.scale;
    }

    loss_scaling cfg_;
    bool enabled_;
    System sys_;
    int rank_;
    double max_scale_;
    buffer<kernels::loss_scale_device_state, System> state_;
    std::optional<double> known_;
};

} // namespace lockstep

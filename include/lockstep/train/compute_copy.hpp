// lockstep/train/compute_copy.hpp: compute_copy<Low, T, System>, a 16-bit (half or bfloat16)
// copy of a flat float parameter buffer for a network that computes in 16 bits while the trainer
// keeps float master weights, and a 16-bit gradient buffer that is accumulated into the float
// gradients. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/parameter_loads.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>

#include <thrust/fill.h>

namespace lockstep {

/// Mixed precision for a user's network: parameters and optimizer state stay in T (float) in the
/// trainer's flat buffers; the network's forward and backward read values() (Low: half or
/// bfloat16) and write their gradient in Low into grads(), which accumulate_into() adds to the
/// trainer's float gradient buffer. Typical step function (registry network, loss scaling on):
///   copy.refresh(ctx.registry().values(), ctx.step());   // once per step, cheap to repeat
///   forward(copy.values()), backward seeded with dL * ctx.loss_scale() into copy.grads()
///   copy.accumulate_into(ctx.registry().grads());        // float += Low, still scaled
/// and the trainer unscales the reduced float gradient (train_params::loss_scale). All work is
/// kernels on System's stream (no host synchronisation); the casts round to nearest, ties to
/// even, with the same bits on the host and on a device (kernels/mixed_precision.hpp).
template <class Low, class T = float, class System = host_system>
class compute_copy {
    static_assert(is_wire_float16_v<Low>,
                  "compute_copy holds lockstep::half or lockstep::bfloat16 values.");
    static_assert(std::is_floating_point_v<T>, "compute_copy's master values are float or double.");

public:
    using low_type = Low;
    using value_type = T;
    using system_type = System;

    /// Buffers for n values and n gradients in sys's memory (contents unspecified until
    /// refresh() and the user's backward write them).
    explicit compute_copy(std::size_t n, System sys = default_system<System>())
        : sys_(sys), values_(n, sys), grads_(n, sys) {}

    std::size_t size() const noexcept { return values_.size(); }
    /// The 16-bit parameter values (as of the last refresh()).
    std::span<const Low> values() const noexcept { return values_.span(); }
    /// The 16-bit gradient buffer the network's backward writes (overwrites or accumulates: the
    /// buffer is the user's; zero_grads() clears it).
    std::span<Low> grads() noexcept { return grads_.span(); }

    /// values() = Low(master), unless already done for `step` (pass ctx.step(): the first call of
    /// a step casts, the other micro-batches reuse the copy; pass a negative step to force it).
    /// A checkpoint load since the last cast makes the next call cast even for the same step (a
    /// load can return to a step with other weights: detail::parameter_loads). Parameters the
    /// user writes between steps need a negative step. requires: master.size() == size(), in
    /// System memory, laid out as values().
    void refresh(std::span<const T> master, std::int64_t step = -1) {
        LOCKSTEP_REQUIRE(master.size() == size(), errc::shape_mismatch, -1, "compute_copy.refresh",
                         "master buffer has ", master.size(), " values, the copy ", size());
        const std::uint64_t loads = detail::parameter_loads.load(std::memory_order_relaxed);
        if (step >= 0 && step == refreshed_ && loads == loads_seen_)
            return;
        kernels::cast_down(sys_, master, values_.span());
        refreshed_ = step;
        loads_seen_ = loads;
    }

    /// grads() = +0.
    void zero_grads() {
        if (!grads_.empty())
            kernels::with_policy_for(sys_, grads_.size(), [&](auto policy) {
                thrust::fill(policy, grads_.data(), grads_.data() + grads_.size(), Low{});
            });
    }

    /// master_grads += T(grads()) (times *factor when factor is non-null: one double in System
    /// memory, e.g. a loss_scaler's inverse_device() for a user who unscales here rather than in
    /// the trainer). A 16-bit gradient that overflowed is infinite and stays so, which the
    /// trainer's non-finite check sees. requires: master_grads.size() == size(), in System memory.
    void accumulate_into(std::span<T> master_grads, const double* factor = nullptr) const {
        LOCKSTEP_REQUIRE(master_grads.size() == size(), errc::shape_mismatch, -1,
                         "compute_copy.accumulate_into", "master gradient buffer has ",
                         master_grads.size(), " values, the copy ", size());
        kernels::accumulate_up(sys_, grads_.span(), master_grads, factor);
    }

private:
    System sys_;
    buffer<Low, System> values_;
    buffer<Low, System> grads_;
    std::int64_t refreshed_ = std::numeric_limits<std::int64_t>::min();
    std::uint64_t loads_seen_ = 0;
};

} // namespace lockstep

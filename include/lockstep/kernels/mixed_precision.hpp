// lockstep/kernels/mixed_precision.hpp: the element-wise arithmetic of mixed precision training
// (16-bit compute copies of float parameters, 16-bit gradients accumulated into float, the loss
// scale's unscale and update) as host/device functors over Thrust. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/float16_convert.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/system/system.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep::kernels {

/// Elements per host task of the casts below.
inline constexpr std::size_t cast_host_tile = 4096;

/// Elements per task on System: long tiles on the host, one element per thread on a device.
/// Keyed on is_host rather than on the system type: host code converts a tile with the array
/// conversions, device code one element (kernels/float16_convert.hpp); the bits are the same
/// either way.
template <execution_system System>
constexpr std::size_t cast_tile() {
    return System::is_host ? cast_host_tile : 1;
}

/// Task t over [t * tile, min((t + 1) * tile, n)): dst[i] = Low(float(src[i])) (T -> float ->
/// Low; for T = float a single rounding to nearest even).
template <class T, class Low>
struct cast_down_fn {
    const T* src;
    Low* dst;
    std::size_t n;
    std::size_t tile;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = t * tile, e = b + tile < n ? b + tile : n;
        round_to_16bit<Low>(src + b, e - b, dst + b);
    }
};

/// Task t over [t * tile, min((t + 1) * tile, n)): dst[i] += T(float(src[i])) * T(*factor)
/// (factor null: 1). The factor lives in the system's memory (e.g. a loss scaler's inverse
/// scale), so no host read; with a power-of-two factor the multiplication is exact (outside T's
/// subnormals and overflow). T(*factor) rounds: a loss scaler keeps its inverse in float's and
/// double's normal range (loss_scaler's max_scale), so the cast of a power of two is exact.
template <class Low, class T>
struct accumulate_up_fn {
    const Low* src;
    T* dst;
    std::size_t n;
    const double* factor;
    std::size_t tile;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = t * tile, e = b + tile < n ? b + tile : n;
        const T f = factor != nullptr ? static_cast<T>(*factor) : T(1);
        T* const d = dst + b;
        for_each_widened<Low>(src + b, e - b,
                              [d, f](std::size_t i, float v) { d[i] += static_cast<T>(v) * f; });
    }
};

/// Task t over [t * tile, min((t + 1) * tile, n)): data[i] *= T(*factor), the factor read from
/// the system's memory (no host read). T(*factor) rounds (to 0 below T's subnormals): a loss
/// scaler keeps its inverse in float's and double's normal range (loss_scaler's max_scale).
template <class T>
struct multiply_by_fn {
    T* data;
    std::size_t n;
    const double* factor;
    std::size_t tile;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = t * tile, e = b + tile < n ? b + tile : n;
        const T f = static_cast<T>(*factor);
        for (std::size_t i = b; i < e; ++i)
            data[i] *= f;
    }
};

/// A loss scaler's state in its system's memory.
struct loss_scale_device_state {
    double scale = 1;          ///< the scale of the next (or current) step
    double growth_tracker = 0; ///< consecutive applied steps since a change
    double inverse = 1;        ///< 1 / scale (the unscale factor)
};

/// What a loss scale update writes next to a step's state, for the host's end-of-step read.
struct loss_scale_record {
    double used = 0;           ///< the scale the step's backward used
    double next = 0;           ///< the scale of the next step
    double growth_tracker = 0; ///< the growth tracker after the step
};

/// One task, after the step's status is final (summed over replicas for synchronous steps,
/// the skip decision taken): the dynamic loss scale update of torch.cuda.amp.GradScaler.
/// - *overflow > 0 (NaN/inf gradient elements): scale *= backoff, not below floor (a scale
///   already at or below it is kept), tracker = 0;
/// - else, the step applied (*skipped == 0): tracker += 1, and when tracker reaches
///   interval: scale *= growth, at most ceiling, tracker = 0;
/// - else (skipped for another reason): unchanged.
/// report receives the scale used, the next scale and the tracker.
/// Deterministic in the status: replicas that see the same status take the same decision.
struct loss_scale_update_fn {
    loss_scale_device_state* state;
    const double* overflow; ///< the step's count of non-finite gradient elements
    const double* skipped;  ///< the step's skip decision (1: skipped)
    loss_scale_record* report;
    double growth;
    double backoff;
    double interval;
    double floor = 0; ///< loss_scaling::min_scale
    /// The largest scale (loss_scaler's max_scale: S and 1 / S normal numbers of the gradients'
    /// type); 2^1022 by default, double's bound.
    double ceiling = 0x1p1022;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        const double used = state->scale;
        double scale = used;
        double tracker = state->growth_tracker;
        if (*overflow > 0) {
            if (used > floor)
                scale = used * backoff > floor ? used * backoff : floor;
            tracker = 0;
        } else if (*skipped == 0) {
            tracker += 1;
            if (tracker >= interval) {
                const double grown = scale * growth;
                scale = grown < ceiling ? grown : ceiling;
                tracker = 0;
            }
        }
        state->scale = scale;
        state->growth_tracker = tracker;
        state->inverse = 1.0 / scale;
        report->used = used;
        report->next = scale;
        report->growth_tracker = tracker;
    }
};

/// dst = Low(src) element-wise on sys. requires: dst.size() == src.size(), both in sys's memory.
template <execution_system System, class T, class Low>
void cast_down(const System& sys, std::span<const T> src, std::span<Low> dst) {
    const std::size_t n = src.size(), tile = cast_tile<System>();
    if (n == 0)
        return;
    kernels::for_each_index(sys, (n + tile - 1) / tile,
                            cast_down_fn<T, Low>{src.data(), dst.data(), n, tile});
}

/// dst += T(src) * *factor element-wise on sys (factor null: * 1). requires: equal sizes, all
/// in sys's memory; factor, when given, one double in sys's memory.
template <execution_system System, class Low, class T>
void accumulate_up(const System& sys, std::span<const Low> src, std::span<T> dst,
                   const double* factor = nullptr) {
    const std::size_t n = src.size(), tile = cast_tile<System>();
    if (n == 0)
        return;
    kernels::for_each_index(sys, (n + tile - 1) / tile,
                            accumulate_up_fn<Low, T>{src.data(), dst.data(), n, factor, tile});
}

/// data *= *factor element-wise on sys. requires: factor one double in sys's memory.
template <execution_system System, class T>
void multiply_by(const System& sys, std::span<T> data, const double* factor) {
    const std::size_t n = data.size(), tile = cast_tile<System>();
    if (n == 0)
        return;
    kernels::for_each_index(sys, (n + tile - 1) / tile,
                            multiply_by_fn<T>{data.data(), n, factor, tile});
}

} // namespace lockstep::kernels

// lockstep/kernels/channel_geometry.hpp: how a per-channel tensor (NCHW, NHWC, N x C) lies in
// memory, as one (outer, channels, inner) triple. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

#include <cstddef>

namespace lockstep::kernels {

/// Element (o, c, i) of a per-channel tensor lives at ((o * channels) + c) * inner + i.
/// NCHW is (N, C, H*W): each (n, c) plane is contiguous. NHWC is (N*H*W, C, 1) and N x C is
/// (N, C, 1): the channel is the fastest axis. Every channel holds outer * inner values.
struct channel_geometry {
    std::size_t outer = 0;
    std::size_t channels = 0;
    std::size_t inner = 1;

    /// Values per channel (the count its statistics are taken over).
    LOCKSTEP_HOST_DEVICE constexpr std::size_t per_channel() const { return outer * inner; }
    /// Values in the whole tensor.
    LOCKSTEP_HOST_DEVICE constexpr std::size_t size() const { return outer * channels * inner; }
    /// The offset of the k-th value (0 <= k < per_channel()) of channel c.
    LOCKSTEP_HOST_DEVICE constexpr std::size_t offset(std::size_t c, std::size_t k) const {
        return ((k / inner) * channels + c) * inner + k % inner;
    }
    /// The channel of the value at offset i.
    LOCKSTEP_HOST_DEVICE constexpr std::size_t channel_of(std::size_t i) const {
        return (i / inner) % channels;
    }
    friend constexpr bool operator==(const channel_geometry&, const channel_geometry&) = default;
};

/// g.size() for a geometry that comes from outside (a kernel's precondition check), or throws
/// lockstep::error (errc::invalid_argument) naming `operation` and the geometry when
/// outer x channels x inner overflows std::size_t (a wrapped size would pass the kernels' size
/// checks with too short spans) or when inner is 0 (the kernels take inner <= 1 as one value per
/// (outer, channel) row: an empty batch is outer 0 with inner 1, as nchw::geometry gives it).
inline std::size_t checked_size(const channel_geometry& g, const char* operation) {
    LOCKSTEP_REQUIRE(g.inner > 0, errc::invalid_argument, -1, operation, "the geometry (outer ",
                     g.outer, ", channels ", g.channels,
                     ", inner 0) has no values per row: give an empty batch as outer 0, inner 1");
    const std::size_t extents[] = {g.outer, g.channels, g.inner};
    return checked_product(extents, -1, operation, "the geometry (outer, channels, inner)");
}

/// How many partitions the generic (Thrust) kernels split one channel into: enough tasks to keep
/// a device busy, few enough that merging the partials stays cheap. Depends only on the
/// geometry, so results do not depend on the thread count.
inline std::size_t generic_partitions(const channel_geometry& g) {
    const std::size_t per_channel = g.per_channel();
    const std::size_t channels = g.channels == 0 ? 1 : g.channels;
    std::size_t p = (per_channel + 255) / 256;
    const std::size_t cap = 16384 / channels > 0 ? 16384 / channels : 1;
    if (p > cap)
        p = cap;
    return p == 0 ? 1 : p;
}

} // namespace lockstep::kernels

// lockstep/kernels/detail/bn_steps.hpp: the division-free steps the CUDA batch-norm kernels take
// through a channel_geometry (a channel's values, the tensor's offsets, row partitions). Host and
// device code, so the index arithmetic is tested without a GPU. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/channel_geometry.hpp"

#include <cstddef>

namespace lockstep::kernels::cuda_path::detail {

/// g in units of v consecutive values (16-byte vectors): a plane of inner values is inner / v
/// units. requires: inner % v == 0.
LOCKSTEP_HOST_DEVICE constexpr channel_geometry unit_geometry(const channel_geometry& g, int v) {
    return {g.outer, g.channels, g.inner / static_cast<std::size_t>(v)};
}

/// The offsets of channel c's values k, k + stride, k + 2 stride, ... (k counts as in
/// channel_geometry::offset), one division at the start and none per step.
struct channel_walk {
    std::size_t off;   ///< g.offset(c, k)
    std::size_t i;     ///< k % inner
    std::size_t di;    ///< stride % inner
    std::size_t doff;  ///< the offset's step when i does not wrap
    std::size_t wrap;  ///< what a wrap of i adds to the offset
    std::size_t inner; ///< g.inner
    LOCKSTEP_HOST_DEVICE channel_walk(const channel_geometry& g, std::size_t c, std::size_t k,
                                      std::size_t stride)
        : di(stride % g.inner), inner(g.inner) {
        const std::size_t o = k / g.inner;
        i = k - o * g.inner;
        off = (o * g.channels + c) * g.inner + i;
        const std::size_t plane = g.channels * g.inner;
        doff = stride / g.inner * plane + di;
        wrap = plane - g.inner;
    }
    LOCKSTEP_HOST_DEVICE void next() {
        i += di;
        off += doff;
        if (i >= inner) {
            i -= inner;
            off += wrap;
        }
    }
};

/// The tensor offsets a, a + stride, a + 2 stride, ... with their plane (offset / inner) and
/// channel (plane % channels), one division at the start and none per step.
struct tensor_walk {
    std::size_t off;
    std::size_t plane;
    std::size_t c;
    std::size_t i; ///< off % inner
    std::size_t stride, di, dplane, dc, inner, channels;
    LOCKSTEP_HOST_DEVICE tensor_walk(const channel_geometry& g, std::size_t a, std::size_t stride_)
        : off(a), stride(stride_), inner(g.inner), channels(g.channels) {
        plane = a / inner;
        i = a - plane * inner;
        c = plane % channels;
        dplane = stride / inner;
        di = stride - dplane * inner;
        dc = dplane % channels;
    }
    LOCKSTEP_HOST_DEVICE void next() {
        off += stride;
        plane += dplane;
        i += di;
        c += dc;
        if (i >= inner) {
            i -= inner;
            ++plane;
            ++c;
        }
        if (c >= channels)
            c -= channels;
    }
};

/// The row boundaries outer * q / parts of the row partitions, q = q0, q0 + 1, ..., stepped
/// without a division per step.
struct partition_walk {
    std::size_t at;    ///< outer * q / parts
    std::size_t rem;   ///< outer * q % parts
    std::size_t quot;  ///< outer / parts
    std::size_t extra; ///< outer % parts
    std::size_t parts;
    LOCKSTEP_HOST_DEVICE partition_walk(std::size_t outer, std::size_t parts_, std::size_t q0)
        : at(outer * q0 / parts_), rem(outer * q0 % parts_), quot(outer / parts_),
          extra(outer % parts_), parts(parts_) {}
    /// Rows of partition q, advancing to q + 1.
    LOCKSTEP_HOST_DEVICE std::size_t next() {
        std::size_t hi = at + quot;
        rem += extra;
        if (rem >= parts) {
            rem -= parts;
            ++hi;
        }
        const std::size_t rows = hi - at;
        at = hi;
        return rows;
    }
};

} // namespace lockstep::kernels::cuda_path::detail

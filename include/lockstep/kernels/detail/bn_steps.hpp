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

/// Channel c's vectors of v values (vector q: values q v, ..., q v + v - 1 of the tensor) that lie
/// wholly inside its planes, and the values of each plane outside them, its edges: `head` before
/// them and `tail` after, fewer than v each. Sample s's vectors are first + s plane, ...,
/// first + s plane + units - 1. With v = 1 every value is a vector and there are no edges.
/// requires: g.channels g.inner % v == 0 (every plane of the channel starts at the same lane) and
/// g.inner >= 2 v - 1 (at least one vector inside a plane).
struct plane_vectors {
    std::size_t v;
    std::size_t plane; ///< vectors a sample: channels inner / v
    std::size_t first; ///< the first vector inside the channel's plane of sample 0
    std::size_t units; ///< vectors inside each plane
    std::size_t head;  ///< values of a plane before its vectors
    std::size_t tail;  ///< values of a plane after them
    LOCKSTEP_HOST_DEVICE plane_vectors(const channel_geometry& g, std::size_t c, std::size_t v_)
        : v(v_), plane(g.channels * g.inner / v_) {
        const std::size_t start = c * g.inner;
        first = (start + v - 1) / v;
        units = (start + g.inner) / v - first;
        head = first * v - start;
        tail = g.inner - head - units * v;
    }
    /// The tensor offset of edge value j (< head + tail; the head's first) of sample s.
    LOCKSTEP_HOST_DEVICE std::size_t edge(std::size_t s, std::size_t j) const {
        const std::size_t at = j < head ? first * v - head + j : (first + units) * v + (j - head);
        return s * plane * v + at;
    }
};

/// The offsets of a channel's units k, k + stride, k + 2 stride, ... (counted plane by plane,
/// `inner` a plane; channel c's values of g are the units of plane_vectors(g, c, 1), and k then
/// counts as in channel_geometry::offset), one division at the start and none per step.
struct channel_walk {
    std::size_t off;   ///< the offset of unit k
    std::size_t i;     ///< k % inner
    std::size_t di;    ///< stride % inner
    std::size_t doff;  ///< the offset's step when i does not wrap
    std::size_t wrap;  ///< what a wrap of i adds to the offset
    std::size_t inner; ///< units a plane
    /// Units k, k + stride, ... of `inner_` a plane, plane o's units from base + o * plane.
    LOCKSTEP_HOST_DEVICE channel_walk(std::size_t plane, std::size_t base, std::size_t inner_,
                                      std::size_t k, std::size_t stride)
        : di(stride % inner_), inner(inner_) {
        const std::size_t o = k / inner;
        i = k - o * inner;
        off = o * plane + base + i;
        doff = stride / inner * plane + di;
        wrap = plane - inner;
    }
    /// The vectors of pv (units k count them plane by plane, `units` a plane).
    LOCKSTEP_HOST_DEVICE channel_walk(const plane_vectors& pv, std::size_t k, std::size_t stride)
        : channel_walk(pv.plane, pv.first, pv.units, k, stride) {}
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

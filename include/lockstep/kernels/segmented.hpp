// lockstep/kernels/segmented.hpp: tiles of a segmented flat buffer and the functors that map and
// reduce over them (per-tensor work in one pass). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <cstddef>
#include <cstdint>

namespace lockstep::kernels {

/// A contiguous run [begin, end) of a flat buffer that lies inside ONE segment (tensor).
/// A flat buffer's segments are cut into tiles of at most a few thousand elements, so one
/// for_each over the tiles touches every element once and reads each segment's scalars once per
/// tile.
struct tile {
    std::size_t begin = 0;
    std::size_t end = 0;
    std::uint32_t segment = 0;
};

/// Per-segment options a fused update reads (see optim::tensor_segment).
struct segment_flags {
    bool decay = true; ///< weight decay applies to this segment
    bool adapt = true; ///< LARS/LAMB trust ratio applies (false: ratio 1)
};

/// Two sums carried by one segmented reduction (e.g. ||w||^2 and ||g||^2).
struct sum_pair {
    double a = 0;
    double b = 0;
};

/// The first and one-past-last tile of a segment.
struct tile_range {
    std::size_t first = 0;
    std::size_t last = 0;
};

/// True when a no-op flag is set: `noop` is null (never) or points to an int in the memory of
/// the system the kernel runs on, read by the kernel itself (the host never reads it), as
/// apex's multi-tensor kernels read their noop flag. A set flag makes every driver below a
/// no-op, so a whole step can be skipped without the host looking at the flag.
LOCKSTEP_HOST_DEVICE inline bool noop_set(const int* noop) {
    return noop != nullptr && *noop != 0;
}

/// for_each body over tile indices: f(i, f.segment(s)) for every element i of tile t, where s
/// is the tile's segment; nothing when noop_set(noop). F provides
/// `segment(std::uint32_t) -> scalars` and `operator()(std::size_t, const scalars&)`. The inner
/// loop is a plain counted loop, so the host compiler vectorizes it.
template <class F>
struct tile_apply {
    const tile* tiles;
    F f;
    const int* noop = nullptr;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        if (noop_set(noop))
            return;
        const tile tl = tiles[t];
        const auto s = f.segment(tl.segment);
        const F g = f; // a local copy: its pointers live in registers across the loop
        for (std::size_t i = tl.begin; i < tl.end; ++i)
            g(i, s);
    }
};

/// for_each body over lanes k in [0, tile count * TileSize): element tiles[k / TileSize].begin +
/// k % TileSize, when inside its tile, gets f(i, f.segment(s)); nothing when noop_set(noop).
/// One element per thread and consecutive threads on consecutive elements (coalesced): the shape
/// of the CUDA path, the same arithmetic as tile_apply. requires: every tile holds at most
/// TileSize elements.
template <class F, std::size_t TileSize>
struct tile_lanes {
    const tile* tiles;
    F f;
    const int* noop = nullptr;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t k) const {
        if (noop_set(noop))
            return;
        const tile tl = tiles[k / TileSize];
        const std::size_t i = tl.begin + k % TileSize;
        if (i < tl.end)
            f(i, f.segment(tl.segment));
    }
};

/// for_each body over tile indices: partial[t] = sum over the tile's elements of f(i, scalars)
/// (a sum_pair), accumulated in an order fixed by the tile (and, on the host, the build's SIMD
/// width), so the result does not depend on the number of threads. When noop_set(noop), f is
/// not called and partial[t] = {0, 0}.
template <class F>
struct tile_reduce {
    const tile* tiles;
    sum_pair* partial;
    F f;
    const int* noop = nullptr;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        if (noop_set(noop)) {
            partial[t] = {0, 0};
            return;
        }
        const tile tl = tiles[t];
        const auto s = f.segment(tl.segment);
        const F g = f;
        double a = 0, b = 0;
        // On the host, let the compiler split the sums into 8 lanes (several vector registers,
        // so the adds do not wait on one another): the order is fixed by the tile and the build,
        // never by the thread count.
#if defined(_OPENMP) && !defined(__CUDA_ARCH__)
#pragma omp simd simdlen(8) reduction(+ : a, b)
#endif
        for (std::size_t i = tl.begin; i < tl.end; ++i) {
            const sum_pair p = g(i, s);
            a += p.a;
            b += p.b;
        }
        partial[t] = {a, b};
    }
};

/// for_each body over segment indices: out[s] = the sum of partial over the segment's tiles, in
/// tile order (deterministic).
struct segment_sum {
    const tile_range* ranges;
    const sum_pair* partial;
    sum_pair* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t s) const {
        double a = 0, b = 0;
        for (std::size_t t = ranges[s].first; t < ranges[s].last; ++t) {
            a += partial[t].a;
            b += partial[t].b;
        }
        out[s] = {a, b};
    }
};

/// for_each body over indices: f(i), or nothing when noop_set(noop) (per-segment passes such as
/// trust ratios, guarded by the same flag as the element passes).
template <class F>
struct unless_noop {
    F f;
    const int* noop = nullptr;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        if (!noop_set(noop))
            f(i);
    }
};

} // namespace lockstep::kernels

// lockstep/train/detail/check_order.hpp: the order in which the gradient checks reduce a buffer
// (tiles, lanes, fixed binary trees), shared by the host and the CUDA kernels so both give the
// same bits, and the generic Thrust passes that follow it. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"

#include <cstddef>
#include <cstdint>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep::detail {

// The order, defined once: a range of n elements is cut into tiles of check_tile elements (the
// last one shorter). Element i of a tile is taken by lane i % check_lanes, and each lane adds its
// squares in element order (one rounded product, one rounded sum: never fused). The lanes of a
// tile are combined by the pairwise tree below, and so are the tiles. Counts and first indices
// are integers (exact in any order); only the sum of squares depends on this order. On the CUDA
// system a tile is one block of check_lanes threads, lane = thread; the host runs the same lanes.

/// Elements per tile: large enough that a host task runs long loops, small enough that a GPU
/// has many blocks.
inline constexpr std::size_t check_tile = std::size_t(1) << 14;
/// Lanes per tile (the threads of one CUDA block).
inline constexpr std::size_t check_lanes = 256;

/// The tiles of n elements (>= 0).
inline std::size_t check_tiles(std::size_t n) {
    return (n + check_tile - 1) / check_tile;
}

/// The checks of a range: NaN/inf elements, 1 + flat index of the first (0: none), and the sum
/// of squares in double (0 where squares were not asked for). An aggregate (shared memory holds
/// it): value-initialise it, `check_sums s{}`.
struct check_sums {
    double count;
    double first;
    double sq;
};

/// acc + x * x with the product rounded on its own (no fused multiply-add), as on every path.
/// On the host this relies on the compiler not contracting a*b+c, which it does not for the
/// default x86-64 target (no FMA); float data is exact either way (x * x is exact in double).
LOCKSTEP_HOST_DEVICE inline double add_square(double acc, double x) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(acc, __dmul_rn(x, x));
#else
    return acc + x * x;
#endif
}

/// The combination of two adjacent ranges, a before b. {} is its identity, exactly: sq is never
/// -0, so sq + 0 == sq.
struct combine_checks {
    LOCKSTEP_HOST_DEVICE check_sums operator()(const check_sums& a, const check_sums& b) const {
        const double first =
            a.first != 0 && (b.first == 0 || a.first < b.first) ? a.first : b.first;
        return {a.count + b.count, first, a.sq + b.sq};
    }
};

/// The pairwise tree over v(0), ..., v(n - 1): leaves t and t + s are combined for t % 2s == 0,
/// s = 1, 2, 4, ... (a missing right operand leaves the left one as it is), the result at 0.
/// Evaluated in one pass: full aligned subtrees are kept on a stack (at most one per bit of n)
/// and the partial ones at the end are combined right to left, which is what the tree does.
/// Load: a callable size_t -> check_sums.
template <class Load>
LOCKSTEP_HOST_DEVICE check_sums tree_fold(std::size_t n, const Load& load) {
    const combine_checks op;
    check_sums stack[8 * sizeof(std::size_t) + 1];
    int top = 0;
    for (std::size_t j = 0; j < n; ++j) {
        stack[top++] = load(j);
        for (std::size_t k = j + 1; (k & 1) == 0; k >>= 1) {
            stack[top - 2] = op(stack[top - 2], stack[top - 1]);
            --top;
        }
    }
    if (top == 0)
        return {};
    check_sums r = stack[--top];
    while (top > 0)
        r = op(stack[--top], r);
    return r;
}

/// The per-tile results as three doubles each (count, first, sq) from `at` on.
struct tile_slots {
    const double* at;
    LOCKSTEP_HOST_DEVICE check_sums operator()(std::size_t t) const {
        return {at[3 * t], at[3 * t + 1], at[3 * t + 2]};
    }
};

LOCKSTEP_HOST_DEVICE inline void store_sums(double* out, const check_sums& s) {
    out[0] = s.count;
    out[1] = s.first;
    out[2] = s.sq;
}

/// Task t over elements [begin + t * tile, min(end, begin + (t + 1) * tile)) of data, in the
/// order above: writes out[3 (base + t) + {0, 1, 2}] = the tile's check_sums.
template <class T>
struct tile_check_fn {
    const T* data;
    std::size_t begin, end, base;
    double* out;
    bool squares;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = begin + t * check_tile;
        const std::size_t e = b + check_tile < end ? b + check_tile : end;
        const non_finite_fn<T> bad;
        std::uint32_t count = 0;
        for (std::size_t i = b; i < e; ++i)
            count += static_cast<std::uint32_t>(bad(data[i]));
        check_sums s{};
        s.count = static_cast<double>(count);
        if (count != 0)
            for (std::size_t i = b; i < e; ++i)
                if (bad(data[i])) {
                    s.first = static_cast<double>(i + 1);
                    break;
                }
        if (squares) {
            double lane[check_lanes] = {};
            for (std::size_t r = b; r < e; r += check_lanes) {
                const std::size_t m = e - r < check_lanes ? e - r : check_lanes;
                for (std::size_t l = 0; l < m; ++l)
                    lane[l] = add_square(lane[l], static_cast<double>(data[r + l]));
            }
            for (std::size_t step = 1; step < check_lanes; step *= 2)
                for (std::size_t l = 0; l < check_lanes; l += 2 * step)
                    lane[l] += lane[l + step];
            s.sq = lane[0];
        }
        store_sums(out + 3 * (base + t), s);
    }
};

/// One task: finish(the tree over tiles [0, tiles) of partial).
template <class F>
struct fold_then_fn {
    const double* partial;
    std::size_t tiles;
    F finish;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        finish(tree_fold(tiles, tile_slots{partial}));
    }
};

// The passes of the checks on any system, as Thrust tasks; a system with a faster mapping of the
// same order declares overloads on its own type (cuda_system: check_order_cuda.cuh), found by
// argument-dependent lookup.

/// The tiles of [begin, end) of data into out[3 base ...]: one task per tile.
template <class System, class T>
void grad_check_tiles(const System& sys, const T* data, std::size_t begin, std::size_t end,
                      std::size_t base, double* out, bool squares) {
    const std::size_t tiles = check_tiles(end - begin);
    if (tiles == 0)
        return;
    kernels::for_each_index(sys, tiles, tile_check_fn<T>{data, begin, end, base, out, squares});
}

/// finish(check_sums of tiles [0, tiles) of partial) in one task. F: a host/device callable
/// taking const check_sums&.
template <class System, class F>
void grad_check_finish(const System& sys, const double* partial, std::size_t tiles,
                       const F& finish) {
    kernels::for_each_index(sys, 1, fold_then_fn<F>{partial, tiles, finish});
}

} // namespace lockstep::detail

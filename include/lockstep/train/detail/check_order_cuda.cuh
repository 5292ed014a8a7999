// lockstep/train/detail/check_order_cuda.cuh: the gradient checks on cuda_system in the order of
// check_order.hpp: one coalesced block per tile and a one-block parallel fold over the tiles.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/core/error.hpp"
#include "lockstep/system/cuda_system.hpp"
#include "lockstep/train/detail/check_order.hpp"

#include <cstddef>

#include <cuda_runtime_api.h>

namespace lockstep::detail::check_cuda {

static_assert(check_lanes == 256, "the check kernels run one thread per lane");

/// Combines thread t's s with thread t + s's for t % 2s == 0, s = 1, 2, ..., 128 (the pairwise
/// tree over the block's 256 threads): shuffles within a warp, then one warp over the 8 warp
/// results. ensures: the tree's result in thread 0.
__device__ inline check_sums block_tree(check_sums s) {
    const combine_checks op;
    const unsigned t = threadIdx.x;
    const unsigned lane = t % 32;
    for (unsigned step = 1; step < 32; step *= 2) {
        const check_sums o{__shfl_down_sync(0xffffffffu, s.count, step),
                           __shfl_down_sync(0xffffffffu, s.first, step),
                           __shfl_down_sync(0xffffffffu, s.sq, step)};
        if (lane % (2 * step) == 0)
            s = op(s, o);
    }
    __shared__ check_sums warps[check_lanes / 32];
    if (lane == 0)
        warps[t / 32] = s;
    __syncthreads();
    if (t < 32) {
        s = t < check_lanes / 32 ? warps[t] : check_sums{};
        for (unsigned step = 1; step < check_lanes / 32; step *= 2) {
            const check_sums o{__shfl_down_sync(0xffffffffu, s.count, step),
                               __shfl_down_sync(0xffffffffu, s.first, step),
                               __shfl_down_sync(0xffffffffu, s.sq, step)};
            if (t % (2 * step) == 0)
                s = op(s, o);
        }
    }
    return s;
}

template <class T>
__device__ __forceinline__ void take(check_sums& s, T x, std::size_t index, bool squares) {
    if (non_finite_fn<T>{}(x) != 0) {
        s.count += 1.0;
        if (s.first == 0)
            s.first = static_cast<double>(index + 1);
    }
    if (squares)
        s.sq = add_square(s.sq, static_cast<double>(x));
}

/// Block t checks tile t of [begin, end): thread l takes elements l, l + 256, ... of the tile in
/// order (consecutive threads read consecutive elements), four loads in flight.
template <class T>
__global__ void __launch_bounds__(check_lanes)
    tile_kernel(const T* __restrict__ data, std::size_t begin, std::size_t end, std::size_t base,
                double* out, bool squares) {
    const std::size_t b = begin + std::size_t(blockIdx.x) * check_tile;
    const std::size_t len = end - b < check_tile ? end - b : check_tile;
    const T* p = data + b;
    check_sums s{};
    std::size_t i = threadIdx.x;
    for (; i + 3 * check_lanes < len; i += 4 * check_lanes) {
        T v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            v[u] = p[i + u * check_lanes];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            take(s, v[u], b + i + u * check_lanes, squares);
    }
    for (; i < len; i += check_lanes)
        take(s, p[i], b + i, squares);
    s = block_tree(s);
    if (threadIdx.x == 0)
        store_sums(out + 3 * (base + blockIdx.x), s);
}

/// finish(the tree over `tiles` tile results) in one block: thread j folds the aligned chunk
/// [j c, (j + 1) c) of tiles (c the power of two that leaves at most 256 chunks), which is a
/// subtree of the tree; block_tree combines the chunks as the tree's upper levels (empty chunks
/// are its exact identity).
template <class F>
__global__ void __launch_bounds__(check_lanes)
    finish_kernel(const double* partial, std::size_t tiles, F finish) {
    std::size_t chunk = 1;
    while (chunk * check_lanes < tiles)
        chunk *= 2;
    const std::size_t lo = threadIdx.x * chunk;
    check_sums s{};
    if (lo < tiles)
        s = tree_fold(tiles - lo < chunk ? tiles - lo : chunk, tile_slots{partial + 3 * lo});
    s = block_tree(s);
    if (threadIdx.x == 0)
        finish(s);
}

} // namespace lockstep::detail::check_cuda

namespace lockstep {

/// The tiles of [begin, end) of data on the GPU: one block per tile (detail::grad_check_tiles's
/// results, bit for bit).
template <class T>
void grad_check_tiles(const cuda_system& sys, const T* data, std::size_t begin, std::size_t end,
                      std::size_t base, double* out, bool squares) {
    const std::size_t tiles = detail::check_tiles(end - begin);
    if (tiles == 0)
        return;
    LOCKSTEP_REQUIRE(tiles < (std::size_t(1) << 31), errc::invalid_argument, -1, "gradient checks",
                     "a grid of ", tiles, " tiles");
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(sys.device()));
    detail::check_cuda::tile_kernel<T>
        <<<static_cast<unsigned>(tiles), detail::check_lanes, 0, sys.stream()>>>(
            data, begin, end, base, out, squares);
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

/// finish(the tiles' check_sums) in one block (detail::grad_check_finish's result, bit for bit).
template <class F>
void grad_check_finish(const cuda_system& sys, const double* partial, std::size_t tiles,
                       const F& finish) {
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(sys.device()));
    detail::check_cuda::finish_kernel<F>
        <<<1, detail::check_lanes, 0, sys.stream()>>>(partial, tiles, finish);
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

} // namespace lockstep
#endif

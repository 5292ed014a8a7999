// lockstep/kernels/detail/bn_cuda_tiles.cuh: the CUDA batch-norm reductions (K1 moments, K4
// backward sums) over channel tiles: NCHW planes of no whole vectors (7x7, 3x3, ...) read in
// 16-byte vectors whose lanes each keep one channel. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/detail/bn_cuda_device.cuh"
#include "lockstep/kernels/detail/bn_cuda_reductions.cuh"
#include "lockstep/kernels/detail/bn_cuda_walks.cuh"
#include "lockstep/kernels/detail/bn_launch_plan.hpp"

#include <cstddef>

namespace lockstep::kernels::cuda_path::detail {

/// The block's threads walk tile `tile` (shape ts, vectors of V values) of the samples
/// [s0, s1): thread t takes vector t % ts.vectors of the tile in samples s0 + t / ts.vectors,
/// then every ts.rows-th sample, B at a time as flat_channel does (op.load(unit, r[u]) for the
/// batch, then op.apply(r, count); units are vectors from the tensor's start). Its vectors sit
/// at one place in every sample's tile, so lane j always holds the tile's value
/// (t % ts.vectors) V + j: its channel never changes. Threads from ts.rows ts.vectors on idle.
template <int B, int V, class Op>
__device__ __forceinline__ void tile_walk(const channel_geometry& g, const tile_shape& ts,
                                          std::size_t tile, std::size_t s0, std::size_t s1,
                                          Op& op) {
    const unsigned t = threadIdx.x;
    if (t >= ts.rows * ts.vectors)
        return;
    const std::size_t sample_units = g.channels * g.inner / V;
    const std::size_t step = sample_units * ts.rows;
    const std::size_t span = std::size_t{B} * ts.rows;
    std::size_t s = s0 + t / ts.vectors;
    std::size_t unit = s * sample_units + tile * ts.vectors + t % ts.vectors;
    for (; s + (span - ts.rows) < s1; s += span) { // the batch's last sample is below s1
        typename Op::regs r[B];
#pragma unroll
        for (int u = 0; u < B; ++u) {
            op.load(unit, r[u]);
            unit += step;
        }
        op.apply(r, B);
    }
    if (s >= s1)
        return;
    const int count = static_cast<int>((s1 - s + ts.rows - 1) / ts.rows);
    typename Op::regs r[B];
#pragma unroll
    for (int u = 0; u < B; ++u) {
        if (u < count)
            op.load(unit, r[u]);
        unit += step;
    }
    op.apply(r, count);
}

/// Each channel of a tile block, folded from the block's lanes: entry(i) is lane i % V of
/// thread i / V (i = row ts.vectors V + value of the tile, row = the thread's t / ts.vectors).
/// Channel ci's entries q < ts.rows inner (row q / inner, value ci inner + q % inner) fold
/// with op in channel_fold's order, which depends on the tile shape and inner alone.
/// ensures: channel ci's fold in its leader thread (channel_fold_result).
template <class R, int V, class Entry, class Op>
__device__ channel_fold_result<R> tile_channels_fold(const channel_geometry& g,
                                                     const tile_shape& ts, Entry entry, Op op) {
    const std::size_t inner = g.inner;
    const std::size_t row_values = std::size_t{ts.vectors} * V;
    return channel_fold<R>(
        ts.channels, std::size_t{ts.rows} * inner,
        [&](std::size_t ci, std::size_t q0, std::size_t q1) {
            R acc{};
            for (std::size_t q = q0; q < q1; ++q) {
                const std::size_t row = q / inner;
                acc = op(acc, entry(row * row_values + ci * inner + (q - row * inner)));
            }
            return acc;
        },
        op);
}

/// K1, tiles: block = (tile, partition p of cuda_tile_partitions(g) of the samples); partials
/// per (channel, partition) as moments_planes_kernel's, folded by the tile's last block.
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads, planes_reduction_blocks<V>)
    moments_tiles_kernel(const T* __restrict__ x, channel_geometry g, tile_shape ts,
                         std::size_t parts, Acc* partials, unsigned* counters,
                         block_header<Acc> header, Acc* block) {
    __shared__ Acc s_mean[block_threads * V];
    __shared__ Acc s_m2[block_threads * V];
    __shared__ Acc s_n[block_threads];
    const std::size_t tile = blockIdx.x / parts;
    const std::size_t p = blockIdx.x - tile * parts;
    const unsigned t = threadIdx.x;
    moments_op<T, Acc, V> op{x};
    tile_walk<moments_batch<V>, V>(g, ts, tile, g.outer * p / parts, g.outer * (p + 1) / parts, op);
    s_n[t] = op.lanes.count;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        s_mean[t * V + j] = op.lanes.mean[j];
        s_m2[t * V + j] = op.lanes.m2[j];
    }
    __syncthreads();
    const auto m = tile_channels_fold<moments<Acc>, V>(
        g, ts,
        [&](std::size_t i) {
            return moments<Acc>{s_n[i / V], s_mean[i], s_m2[i]};
        },
        chan_merge{});
    const std::size_t first = tile * ts.channels;
    if (m.leader) {
        partials[2 * ((first + m.channel) * parts + p)] = m.value.mean;
        partials[2 * ((first + m.channel) * parts + p) + 1] = m.value.m2;
    }
    if (!arrive_last(counters + tile, parts))
        return;
    for (std::size_t c = first; c < first + ts.channels; ++c) {
        const moments<double> total =
            fold_moment_partials(partials + 2 * c * parts, parts, [&](std::size_t q) {
                const std::size_t samples = g.outer * (q + 1) / parts - g.outer * q / parts;
                return static_cast<double>(samples * g.inner);
            });
        if (t == 0) {
            block[packed_moments::mean(c)] = static_cast<Acc>(total.mean);
            block[packed_moments::m2(c)] = static_cast<Acc>(total.m2);
            if (c == 0)
                write_header(block, header);
        }
    }
}

/// K4, tiles: as moments_tiles_kernel with the backward sums; each lane subtracts its own
/// channel's mean.
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads, planes_reduction_blocks<V>)
    sums_tiles_kernel(const T* __restrict__ dy, const T* __restrict__ x, channel_geometry g,
                      tile_shape ts, std::size_t parts, const Acc* mean, Acc status, Acc* partials,
                      unsigned* counters, Acc* sums) {
    __shared__ Acc s_dy[block_threads * V];
    __shared__ Acc s_dyx[block_threads * V];
    const std::size_t tile = blockIdx.x / parts;
    const std::size_t p = blockIdx.x - tile * parts;
    const unsigned t = threadIdx.x;
    const std::size_t first = tile * ts.channels;
    sums_op<T, Acc, V, V> op{dy, x, {}};
    const std::size_t value = std::size_t{t % ts.vectors} * V; // of the tile, lane 0's
#pragma unroll
    for (int j = 0; j < V; ++j)
        op.mu[j] = mean[first + (value + j) / g.inner];
    tile_walk<sums_batch<V>, V>(g, ts, tile, g.outer * p / parts, g.outer * (p + 1) / parts, op);
#pragma unroll
    for (int j = 0; j < V; ++j) {
        s_dy[t * V + j] = op.sdy[j];
        s_dyx[t * V + j] = op.sdyx[j];
    }
    __syncthreads();
    const auto s = tile_channels_fold<dy_sums<Acc>, V>(
        g, ts,
        [&](std::size_t i) {
            return dy_sums<Acc>{s_dy[i], s_dyx[i]};
        },
        add_dy_sums{});
    if (s.leader) {
        partials[2 * ((first + s.channel) * parts + p)] = s.value.dy;
        partials[2 * ((first + s.channel) * parts + p) + 1] = s.value.dyx;
    }
    if (!arrive_last(counters + tile, parts))
        return;
    for (std::size_t c = first; c < first + ts.channels; ++c) {
        const dy_sums<double> total = fold_sum_partials(partials + 2 * c * parts, parts);
        if (t == 0) {
            sums[c] = static_cast<Acc>(total.dy);
            sums[g.channels + c] = static_cast<Acc>(total.dyx);
            if (c == 0)
                sums[packed_sums::status(g.channels)] = status;
        }
    }
}

} // namespace lockstep::kernels::cuda_path::detail
#endif

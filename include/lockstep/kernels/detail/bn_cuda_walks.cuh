// lockstep/kernels/detail/bn_cuda_walks.cuh: how the CUDA batch-norm kernels walk a tensor (runs
// by warp, flat by block) and fold partials in a fixed order (ordered_fold, channel_fold).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_cuda_device.cuh"

#include <cstddef>
#include <cstdint>

namespace lockstep::kernels::cuda_path::detail {

/// Calls f(offset, length) for the contiguous runs of channel c's values k in [a, b) (k counts
/// as in channel_geometry::offset): one division per call, then a pointer walk plane by plane.
template <class F>
__device__ __forceinline__ void channel_runs(const channel_geometry& g, std::size_t c,
                                             std::size_t a, std::size_t b, F&& f) {
    std::size_t o = a / g.inner;
    std::size_t i = a - o * g.inner;
    while (a < b) {
        const std::size_t len = smin(b - a, g.inner - i);
        f((o * g.channels + c) * g.inner + i, len);
        a += len;
        ++o;
        i = 0;
    }
}

/// Calls f(offset, length, plane) for the runs of tensor offsets [a, b) cut at plane
/// boundaries (plane q holds channel q % channels): one division per call.
template <class F>
__device__ __forceinline__ void plane_runs(const channel_geometry& g, std::size_t a, std::size_t b,
                                           F&& f) {
    std::size_t q = a / g.inner;
    std::size_t i = a - q * g.inner;
    while (a < b) {
        const std::size_t len = smin(b - a, g.inner - i);
        f(a, len, q);
        a += len;
        ++q;
        i = 0;
    }
}

/// One warp processes the run [off, off + len): the values before the first 16-byte boundary of
/// ref + off and the tail one per lane (op.scalar), the rest in V-wide vectors, four loads in
/// flight per lane (op.load, then op.apply).
template <int V, class T, class Op>
__device__ __forceinline__ void warp_run(Op& op, const T* ref, std::size_t off, std::size_t len,
                                         unsigned lane) {
    if constexpr (V > 1) {
        const auto addr = reinterpret_cast<std::uintptr_t>(ref + off);
        const std::size_t head = smin(len, ((16 - addr % 16) % 16) / sizeof(T));
        if (lane < head)
            op.scalar(off + lane);
        off += head;
        len -= head;
    }
    const std::size_t nv = len / V;
    std::size_t j = lane;
    for (; j + 96 < nv; j += 128) {
        typename Op::regs r[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            op.load(off + (j + 32 * u) * V, r[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u)
            op.apply(off + (j + 32 * u) * V, r[u]);
    }
    for (; j < nv; j += 32) {
        typename Op::regs r;
        op.load(off + j * V, r);
        op.apply(off + j * V, r);
    }
    if constexpr (V > 1) {
        const std::size_t tail = len - nv * V;
        if (lane < tail)
            op.scalar(off + nv * V + lane);
    }
}

/// The block's threads walk channel c's values k in [a, b) flat: thread t takes k = a + t,
/// a + t + block_threads, ... (consecutive threads, consecutive values of a run: coalesced
/// whatever the plane size), four loads in flight (op.load, then op.apply; V == 1 ops). The
/// tensor offset is stepped without a division per value.
template <class Op>
__device__ __forceinline__ void flat_channel(const channel_geometry& g, std::size_t c,
                                             std::size_t a, std::size_t b, Op& op) {
    std::size_t k = a + threadIdx.x;
    if (k >= b)
        return;
    const std::size_t o = k / g.inner;
    std::size_t i = k - o * g.inner;
    std::size_t off = (o * g.channels + c) * g.inner + i;
    const std::size_t plane = g.channels * g.inner;
    const std::size_t di = block_threads % g.inner;
    const std::size_t doff = block_threads / g.inner * plane + di;
    const auto advance = [&] {
        i += di;
        off += doff;
        if (i >= g.inner) {
            i -= g.inner;
            off += plane - g.inner;
        }
    };
    for (; k + 3 * block_threads < b; k += 4 * block_threads) {
        std::size_t at[4];
        typename Op::regs r[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            at[u] = off;
            op.load(off, r[u]);
            advance();
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
            op.apply(at[u], r[u]);
    }
    for (; k < b; k += block_threads) {
        typename Op::regs r;
        op.load(off, r);
        op.apply(off, r);
        advance();
    }
}

/// Tensor offsets a, a + stride, a + 2 stride, ... with their channel, stepped without a
/// division per value (the flat elementwise kernels).
struct flat_walk {
    std::size_t off;
    std::size_t i; ///< off % inner
    std::size_t c; ///< off / inner % channels
    std::size_t stride, di, dc, inner, channels;
    __device__ flat_walk(const channel_geometry& g, std::size_t a, std::size_t stride_)
        : off(a), stride(stride_), inner(g.inner), channels(g.channels) {
        const std::size_t q = a / inner;
        i = a - q * inner;
        c = q % channels;
        const std::size_t sq = stride / inner;
        di = stride - sq * inner;
        dc = sq % channels;
    }
    __device__ __forceinline__ void next() {
        off += stride;
        i += di;
        c += dc;
        if (i >= inner) {
            i -= inner;
            ++c;
        }
        if (c >= channels)
            c -= channels;
    }
};

/// The block's arrival at `counter`, one of `expected` blocks: true in the last block to arrive,
/// which also resets the counter to 0 (so the workspace needs no clearing between launches).
/// Every thread fences its own writes first, so the last block sees every block's partials
/// (read them with __ldcg: L1 is not coherent).
__device__ __forceinline__ bool arrive_last(unsigned* counter, std::size_t expected) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned ticket = atomicAdd(counter, 1u);
        last = ticket + 1 == expected;
        if (last)
            atomicExch(counter, 0u);
    }
    __syncthreads();
    if (last)
        __threadfence();
    return last;
}

/// op-fold of load(0), ..., load(count - 1) in index order, across the block: thread t folds the
/// contiguous range [count t / B, count (t + 1) / B), then neighbours are combined pairwise
/// (t with t + s for s = 1, 2, 4, ...), so only adjacent ranges are ever merged and the
/// result depends on count alone. ensures: the result in every thread.
template <class V, class Load, class Op>
__device__ V ordered_fold(std::size_t count, Load load, Op op) {
    __shared__ alignas(V) unsigned char raw[sizeof(V) * block_threads];
    V* s = reinterpret_cast<V*>(raw);
    const unsigned t = threadIdx.x;
    V v{};
    for (std::size_t q = count * t / block_threads; q < count * (t + 1) / block_threads; ++q)
        v = op(v, load(q));
    s[t] = v;
    __syncthreads();
    for (unsigned step = 1; step < block_threads; step *= 2) {
        if (t % (2 * step) == 0)
            s[t] = op(s[t], s[t + step]);
        __syncthreads();
    }
    const V r = s[0];
    __syncthreads();
    return r;
}

/// The rows kernels' last block: the fold over partitions [0, parts) of each of the `tile`
/// channels of a channel tile (tile a power of two <= block_threads). lanes = block_threads /
/// tile threads share a channel: thread t takes channel t / lanes and folds the contiguous
/// partitions [parts g / lanes, parts (g + 1) / lanes) of it, g = t % lanes, with
/// range(channel, q0, q1); then a channel's lanes are combined pairwise (g with g + s for
/// s = 1, 2, 4, ...), so only adjacent ranges merge and the order depends on (parts, tile) alone.
/// ensures: the channel's fold in its threads with g == 0 (leader); channel = t / lanes.
template <class V>
struct channel_fold_result {
    V value;
    unsigned channel;
    bool leader;
};
template <class V, class Range, class Op>
__device__ channel_fold_result<V> channel_fold(unsigned tile, std::size_t parts, Range range,
                                               Op op) {
    __shared__ alignas(V) unsigned char raw[sizeof(V) * block_threads];
    V* s = reinterpret_cast<V*>(raw);
    const unsigned t = threadIdx.x;
    const unsigned lanes = block_threads / tile;
    const unsigned j = t / lanes;
    const unsigned g = t % lanes;
    V v = range(j, parts * g / lanes, parts * (g + 1) / lanes);
    s[t] = v;
    __syncthreads();
    for (unsigned step = 1; step < lanes; step *= 2) {
        if (g % (2 * step) == 0) {
            v = op(v, s[t + step]);
            s[t] = v;
        }
        __syncthreads();
    }
    return {v, j, g == 0};
}

/// Partitions whose partials a rows fold loads before it uses them (batched_partials).
inline constexpr int partial_batch = 8;

/// Calls use(at[2 q stride], at[(2 q + 1) stride]) for q = q0, ..., q1 - 1 in that order (the
/// rows kernels' [partition][first | second][channel] partials of one channel), with the loads of
/// partial_batch partitions issued before their uses, so a fold waits for L2 once a batch rather
/// than once a partition (its adds depend on each other; its loads do not). __ldcg: the
/// partials were written by other blocks (L1 is not coherent).
template <class Acc, class Use>
__device__ __forceinline__ void batched_partials(const Acc* at, std::size_t stride, std::size_t q0,
                                                 std::size_t q1, Use use) {
    std::size_t q = q0;
    for (; q + partial_batch <= q1; q += partial_batch) {
        Acc a[partial_batch];
        Acc b[partial_batch];
#pragma unroll
        for (int u = 0; u < partial_batch; ++u) {
            a[u] = __ldcg(at + 2 * (q + u) * stride);
            b[u] = __ldcg(at + (2 * (q + u) + 1) * stride);
        }
#pragma unroll
        for (int u = 0; u < partial_batch; ++u)
            use(a[u], b[u]);
    }
    for (; q < q1; ++q)
        use(__ldcg(at + 2 * q * stride), __ldcg(at + (2 * q + 1) * stride));
}

/// The row boundaries outer * q / parts of the row partitions, q = q0, q0 + 1, ..., stepped
/// without a division per step.
struct partition_walk {
    std::size_t at;    ///< outer * q / parts
    std::size_t rem;   ///< outer * q % parts
    std::size_t quot;  ///< outer / parts
    std::size_t extra; ///< outer % parts
    std::size_t parts;
    __device__ partition_walk(std::size_t outer, std::size_t parts_, std::size_t q0)
        : at(outer * q0 / parts_), rem(outer * q0 % parts_), quot(outer / parts_),
          extra(outer % parts_), parts(parts_) {}
    /// Rows of partition q, advancing to q + 1.
    __device__ std::size_t next() {
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
#endif

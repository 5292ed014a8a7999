// lockstep/kernels/detail/bn_cuda_walks.cuh: how the CUDA batch-norm reductions walk a channel
// (flat, by block) and fold partials in a fixed order (ordered_fold, channel_fold).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_cuda_device.cuh"
#include "lockstep/kernels/detail/bn_steps.hpp"

#include <cstddef>

namespace lockstep::kernels::cuda_path::detail {

/// The block's threads walk a channel's units k in [a, b) (values, or vectors with op's V: the
/// vectors inside its planes, pv) flat: thread t takes k = a + t, a + t + block_threads, ...
/// (consecutive threads, consecutive units: coalesced whatever the plane size), a batch of B at
/// a time: op.load(offset, r[u]) for the batch's units before op.apply(r, count) takes them
/// (count < B only in a thread's last batch), the offset stepped without a division
/// (channel_walk). The full batches run without a guard per unit (count is the constant B there).
template <int B, class Op>
__device__ __forceinline__ void flat_channel(const plane_vectors& pv, std::size_t a, std::size_t b,
                                             Op& op) {
    constexpr std::size_t span = std::size_t{B} * block_threads;
    std::size_t k = a + threadIdx.x;
    if (k >= b)
        return;
    channel_walk w(pv, k, block_threads);
    for (; k + (span - block_threads) < b; k += span) { // the batch's last unit is below b
        typename Op::regs r[B];
#pragma unroll
        for (int u = 0; u < B; ++u) {
            op.load(w.off, r[u]);
            w.next();
        }
        op.apply(r, B);
    }
    if (k >= b)
        return;
    const int count = static_cast<int>((b - k + block_threads - 1) / block_threads);
    typename Op::regs r[B];
#pragma unroll
    for (int u = 0; u < B; ++u) {
        if (u < count)
            op.load(w.off, r[u]);
        w.next();
    }
    op.apply(r, count);
}

/// The block's threads take the edge values (plane_vectors) of the channel's planes in samples
/// [s0, s1), thread t the t-th, (t + block_threads)-th, ... in sample order: use(tensor offset).
/// Nothing where planes are whole vectors.
template <class Use>
__device__ __forceinline__ void plane_edges(const plane_vectors& pv, std::size_t s0, std::size_t s1,
                                            Use use) {
    const std::size_t e = pv.head + pv.tail;
    if (e == 0)
        return;
    for (std::size_t k = threadIdx.x; k < (s1 - s0) * e; k += block_threads) {
        const std::size_t s = k / e;
        use(pv.edge(s0 + s, k - s * e));
    }
}

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
    alignas(V) __shared__ unsigned char raw[sizeof(V) * block_threads];
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
    alignas(V) __shared__ unsigned char raw[sizeof(V) * block_threads];
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

} // namespace lockstep::kernels::cuda_path::detail
#endif

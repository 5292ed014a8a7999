// lockstep/kernels/detail/bn_cuda_device.cuh: device building blocks of the CUDA batch-norm kernels
// (vector loads, run walkers, per-thread accumulators, ordered merges). SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep::kernels::cuda_path {

/// Threads per block of every batch-norm kernel.
inline constexpr int block_threads = 256;
/// Warps per block.
inline constexpr int block_warps = block_threads / 32;

/// The CUDA type of a storage type: lockstep::half and lockstep::bfloat16 are layout-compatible
/// with __half and __nv_bfloat16 and are processed as those.
template <class T>
struct native_type {
    using type = T;
};
template <>
struct native_type<lockstep::half> {
    using type = __half;
};
template <>
struct native_type<lockstep::bfloat16> {
    using type = __nv_bfloat16;
};
template <class T>
using native_t = typename native_type<T>::type;

namespace detail {

/// Values of T in one 16-byte vector access.
template <class T>
inline constexpr int vector_width = static_cast<int>(16 / sizeof(T));

__device__ __forceinline__ std::size_t smin(std::size_t a, std::size_t b) {
    return a < b ? a : b;
}

template <class Acc, class T>
__device__ __forceinline__ Acc to_acc(T v) {
    if constexpr (std::is_same_v<T, __half>)
        return __half2float(v);
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat162float(v);
    else
        return static_cast<Acc>(v);
}

/// Rounds to nearest even, as the generic path's static_cast<T> does.
template <class T, class Acc>
__device__ __forceinline__ T from_acc(Acc v) {
    if constexpr (std::is_same_v<T, __half>)
        return __float2half_rn(v);
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __float2bfloat16_rn(v);
    else
        return static_cast<T>(v);
}

/// The register form of V consecutive values of T: T itself for V == 1, else one 16-byte vector
/// (float4, double2, or uint4 holding 4 half2 / bfloat162).
template <int V, class T>
using raw_t = std::conditional_t<
    V == 1, T,
    std::conditional_t<std::is_same_v<T, float>, float4,
                       std::conditional_t<std::is_same_v<T, double>, double2, uint4>>>;

/// V consecutive values at p, unconverted: one 16-byte load when V > 1, which requires p to be
/// 16-byte aligned. Kept apart from unpack so loads stay in flight in few registers.
template <int V, class T>
__device__ __forceinline__ raw_t<V, T> load_raw(const T* p) {
    static_assert(V == 1 || V == vector_width<T>);
    if constexpr (V == 1)
        return p[0];
    else
        return __ldg(reinterpret_cast<const raw_t<V, T>*>(p));
}

/// The V values of q as Acc.
template <int V, class T, class Acc>
__device__ __forceinline__ void unpack(const raw_t<V, T>& q, Acc (&v)[V]) {
    if constexpr (V == 1) {
        v[0] = to_acc<Acc>(q);
    } else if constexpr (std::is_same_v<T, float>) {
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else if constexpr (std::is_same_v<T, double>) {
        v[0] = q.x, v[1] = q.y;
    } else {
        const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float2 f;
            if constexpr (std::is_same_v<T, __half>) {
                __half2 h;
                static_assert(sizeof h == sizeof(unsigned));
                __builtin_memcpy(&h, &words[j], sizeof h);
                f = __half22float2(h);
            } else {
                __nv_bfloat162 h;
                static_assert(sizeof h == sizeof(unsigned));
                __builtin_memcpy(&h, &words[j], sizeof h);
                f = __bfloat1622float2(h);
            }
            v[2 * j] = f.x;
            v[2 * j + 1] = f.y;
        }
    }
}

/// V consecutive values at p as Acc (load_raw, then unpack).
template <int V, class T, class Acc>
__device__ __forceinline__ void load(const T* p, Acc (&v)[V]) {
    unpack<V, T>(load_raw<V>(p), v);
}

/// Stores V values at p (rounded as from_acc does); one 16-byte store when V > 1.
template <int V, class T, class Acc>
__device__ __forceinline__ void store(T* p, const Acc (&v)[V]) {
    if constexpr (V == 1) {
        p[0] = from_acc<T>(v[0]);
    } else if constexpr (std::is_same_v<T, float>) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else if constexpr (std::is_same_v<T, double>) {
        *reinterpret_cast<double2*>(p) = make_double2(v[0], v[1]);
    } else {
        unsigned words[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if constexpr (std::is_same_v<T, __half>) {
                const __half2 h = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
                __builtin_memcpy(&words[j], &h, sizeof h);
            } else {
                const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
                __builtin_memcpy(&words[j], &h, sizeof h);
            }
        }
        *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
    }
}

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

/// Calls f(offset, length, channel) for the runs of tensor offsets [a, b) cut at plane
/// boundaries: one division per call and one modulo per plane.
template <class F>
__device__ __forceinline__ void plane_runs(const channel_geometry& g, std::size_t a, std::size_t b,
                                           F&& f) {
    std::size_t q = a / g.inner;
    std::size_t i = a - q * g.inner;
    while (a < b) {
        const std::size_t len = smin(b - a, g.inner - i);
        f(a, len, q % g.channels);
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

/// Per-thread Welford moments: V lanes that step together (one reciprocal per vector) and one
/// scalar accumulator for unaligned heads and tails.
template <class T, class Acc, int V>
struct moments_op {
    using regs = raw_t<V, T>;
    const T* x;
    Acc mean[V] = {};
    Acc m2[V] = {};
    Acc steps = 0;
    moments<Acc> single{};

    __device__ __forceinline__ void load(std::size_t off, regs& r) const {
        r = load_raw<V>(x + off);
    }
    __device__ __forceinline__ void apply(std::size_t, const regs& r) {
        Acc v[V];
        unpack<V, T>(r, v);
        steps += Acc(1);
        const Acc inv = Acc(1) / steps;
#pragma unroll
        for (int j = 0; j < V; ++j)
            welford_accumulate(mean[j], m2[j], v[j], inv);
    }
    __device__ __forceinline__ void scalar(std::size_t off) {
        welford_update(single, to_acc<Acc>(x[off]));
    }
    /// The moments of everything this thread saw.
    __device__ __forceinline__ moments<Acc> result() const {
        return merge_lanes(single, mean, m2, steps > Acc(0) ? V : 0, steps);
    }
};

/// Sums of (dy, dy * (x - mean)) as one value for the block reductions.
template <class Acc>
struct dy_sums {
    Acc dy = 0;
    Acc dyx = 0;
};
struct add_dy_sums {
    template <class Acc>
    __host__ __device__ dy_sums<Acc> operator()(const dy_sums<Acc>& a,
                                                const dy_sums<Acc>& b) const {
        return {a.dy + b.dy, a.dyx + b.dyx};
    }
};

/// Per-thread backward sums of one channel (mean mu): V lane pairs and a scalar pair.
template <class T, class Acc, int V>
struct sums_op {
    struct regs {
        raw_t<V, T> dy;
        raw_t<V, T> x;
    };
    const T* dy;
    const T* x;
    Acc mu;
    Acc sdy[V] = {};
    Acc sdyx[V] = {};
    dy_sums<Acc> single{};

    __device__ __forceinline__ void load(std::size_t off, regs& r) const {
        r.dy = load_raw<V>(dy + off);
        r.x = load_raw<V>(x + off);
    }
    __device__ __forceinline__ void apply(std::size_t, const regs& r) {
        Acc d[V], v[V];
        unpack<V, T>(r.dy, d);
        unpack<V, T>(r.x, v);
#pragma unroll
        for (int j = 0; j < V; ++j)
            backward_accumulate(sdy[j], sdyx[j], d[j], v[j], mu);
    }
    __device__ __forceinline__ void scalar(std::size_t off) {
        backward_accumulate(single.dy, single.dyx, to_acc<Acc>(dy[off]), to_acc<Acc>(x[off]), mu);
    }
    __device__ __forceinline__ dy_sums<Acc> result() const {
        dy_sums<Acc> s = single;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            s.dy += sdy[j];
            s.dyx += sdyx[j];
        }
        return s;
    }
};

/// y = normalize_value(x) over a run of one channel.
template <class T, class Acc, int V>
struct normalize_op {
    using regs = raw_t<V, T>;
    const T* x;
    T* y;
    Acc mean, scale, beta;

    __device__ __forceinline__ void load(std::size_t off, regs& r) const {
        r = load_raw<V>(x + off);
    }
    __device__ __forceinline__ void apply(std::size_t off, const regs& r) const {
        Acc v[V];
        unpack<V, T>(r, v);
#pragma unroll
        for (int j = 0; j < V; ++j)
            v[j] = normalize_value(v[j], mean, scale, beta);
        detail::store<V>(y + off, v);
    }
    __device__ __forceinline__ void scalar(std::size_t off) const {
        y[off] = from_acc<T>(normalize_value(to_acc<Acc>(x[off]), mean, scale, beta));
    }
};

/// dx = input_gradient(dy, x) over a run of one channel.
template <class T, class Acc, int V>
struct gradient_op {
    struct regs {
        raw_t<V, T> dy;
        raw_t<V, T> x;
    };
    const T* dy;
    const T* x;
    T* dx;
    Acc mean, k, a, b;

    __device__ __forceinline__ void load(std::size_t off, regs& r) const {
        r.dy = load_raw<V>(dy + off);
        r.x = load_raw<V>(x + off);
    }
    __device__ __forceinline__ void apply(std::size_t off, const regs& r) const {
        Acc d[V], v[V];
        unpack<V, T>(r.dy, d);
        unpack<V, T>(r.x, v);
#pragma unroll
        for (int j = 0; j < V; ++j)
            d[j] = input_gradient(d[j], v[j], mean, k, a, b);
        detail::store<V>(dx + off, d);
    }
    __device__ __forceinline__ void scalar(std::size_t off) const {
        dx[off] =
            from_acc<T>(input_gradient(to_acc<Acc>(dy[off]), to_acc<Acc>(x[off]), mean, k, a, b));
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

} // namespace detail
} // namespace lockstep::kernels::cuda_path
#endif

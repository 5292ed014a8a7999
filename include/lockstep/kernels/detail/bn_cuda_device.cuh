// lockstep/kernels/detail/bn_cuda_device.cuh: device building blocks of the CUDA batch-norm kernels
// (native types, vector loads and stores, per-thread accumulators). SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_launch_plan.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep::kernels::cuda_path {

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

/// True for the widths the rows kernels read: the plan never gives them an 8-byte vector, and
/// cuda_path::detail::launch refuses one, so no rows kernel is compiled for it.
template <class N, int W>
inline constexpr bool rows_width = W == 1 || W == vector_width<N>;

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
/// (float4, double2, or uint4 holding 4 half2 / bfloat162) or, for 16-bit T, one 8-byte vector
/// of 4 values (uint2).
template <int V, class T>
using raw_t = std::conditional_t<
    V == 1, T,
    std::conditional_t<std::is_same_v<T, float>, float4,
                       std::conditional_t<std::is_same_v<T, double>, double2,
                                          std::conditional_t<V * sizeof(T) == 8, uint2, uint4>>>>;

/// V consecutive values at p, unconverted: one 16-byte (or 8-byte) load when V > 1, which
/// requires p to be aligned to it. Kept apart from unpack so loads stay in flight in few
/// registers.
template <int V, class T>
__device__ __forceinline__ raw_t<V, T> load_raw(const T* p) {
    static_assert(V == 1 || V == vector_width<T> || (sizeof(T) == 2 && V == 4));
    if constexpr (V == 1)
        return p[0];
    else
        return __ldg(reinterpret_cast<const raw_t<V, T>*>(p));
}

/// The 32-bit words of a vector of 16-bit values (2 values each).
__device__ __forceinline__ void vector_words(const uint4& q, unsigned (&w)[4]) {
    w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
}
__device__ __forceinline__ void vector_words(const uint2& q, unsigned (&w)[2]) {
    w[0] = q.x, w[1] = q.y;
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
        unsigned words[V / 2];
        vector_words(q, words);
#pragma unroll
        for (int j = 0; j < V / 2; ++j) {
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

/// Stores V values at p (rounded as from_acc does); one 16-byte (or 8-byte) store when V > 1.
template <int V, class T, class Acc>
__device__ __forceinline__ void store(T* p, const Acc (&v)[V]) {
    if constexpr (V == 1) {
        p[0] = from_acc<T>(v[0]);
    } else if constexpr (std::is_same_v<T, float>) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else if constexpr (std::is_same_v<T, double>) {
        *reinterpret_cast<double2*>(p) = make_double2(v[0], v[1]);
    } else {
        unsigned words[V / 2];
#pragma unroll
        for (int j = 0; j < V / 2; ++j) {
            if constexpr (std::is_same_v<T, __half>) {
                const __half2 h = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
                __builtin_memcpy(&words[j], &h, sizeof h);
            } else {
                const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
                __builtin_memcpy(&words[j], &h, sizeof h);
            }
        }
        if constexpr (V == 8)
            *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
        else
            *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
    }
}

/// Per-thread moments of units of V values (offsets in units): V lanes, a batch of units at a
/// time (batched_lanes: one division a batch).
template <class T, class Acc, int V>
struct moments_op {
    using regs = raw_t<V, T>;
    const T* x;
    batched_lanes<Acc, V> lanes{};

    __device__ __forceinline__ void load(std::size_t unit, regs& r) const {
        r = load_raw<V>(x + unit * V);
    }
    /// Adds the units r[0], ..., r[count - 1] (0 < count <= B).
    template <int B>
    __device__ __forceinline__ void apply(const regs (&r)[B], int count) {
        lanes.template add<B>(count, [&](int u, Acc(&v)[V]) { unpack<V, T>(r[u], v); });
    }
    /// The moments of everything this thread saw.
    __device__ __forceinline__ moments<Acc> result() const { return lanes.result(); }
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

/// Per-thread backward sums over units of V values: V lane pairs, of one channel (mean mu[0],
/// M = 1) or of a channel per lane (mean mu[j] for lane j, M = V: the channel tiles).
template <class T, class Acc, int V, int M = 1>
struct sums_op {
    static_assert(M == 1 || M == V);
    struct regs {
        raw_t<V, T> dy;
        raw_t<V, T> x;
    };
    const T* dy;
    const T* x;
    Acc mu[M];
    Acc sdy[V] = {};
    Acc sdyx[V] = {};

    __device__ __forceinline__ void load(std::size_t unit, regs& r) const {
        r.dy = load_raw<V>(dy + unit * V);
        r.x = load_raw<V>(x + unit * V);
    }
    /// Adds the units r[0], ..., r[count - 1] in that order.
    template <int B>
    __device__ __forceinline__ void apply(const regs (&r)[B], int count) {
#pragma unroll
        for (int u = 0; u < B; ++u) {
            if (u < count) {
                Acc d[V], v[V];
                unpack<V, T>(r[u].dy, d);
                unpack<V, T>(r[u].x, v);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    backward_accumulate(sdy[j], sdyx[j], d[j], v[j], mu[M == 1 ? 0 : j]);
            }
        }
    }
    __device__ __forceinline__ dy_sums<Acc> result() const {
        dy_sums<Acc> s;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            s.dy += sdy[j];
            s.dyx += sdyx[j];
        }
        return s;
    }
};

} // namespace detail
} // namespace lockstep::kernels::cuda_path
#endif

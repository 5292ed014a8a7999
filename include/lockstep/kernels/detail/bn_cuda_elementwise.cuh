// lockstep/kernels/detail/bn_cuda_elementwise.cuh: the CUDA batch-norm elementwise
// kernels (K3 normalize, K5 fused dx) over planes and rows. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/detail/bn_cuda_device.cuh"
#include "lockstep/kernels/detail/bn_steps.hpp"

#include <cstddef>

namespace lockstep::kernels::cuda_path::detail {

/// f(c) once for every channel c < C over the grid: a grid-stride loop by global thread index.
template <class F>
__device__ __forceinline__ void grid_channels(std::size_t C, F&& f) {
    const std::size_t threads = std::size_t(gridDim.x) * gridDim.y * block_threads;
    for (std::size_t c =
             (std::size_t(blockIdx.y) * gridDim.x + blockIdx.x) * block_threads + threadIdx.x;
         c < C; c += threads)
        f(c);
}

/// The normalization coefficients and beta of the planes (or channels) a block touches, in
/// shared memory: entry e of at most Entries.
template <class Acc, std::size_t Entries>
struct block_coefficients {
    Acc mean[Entries];
    Acc scale[Entries];
    Acc beta[Entries];
};

/// The K3 kernels' start: where the coefficient source writes the coefficients
/// (Coef::finishes: finish_statistics_fn, eval_coefficients_fn), one thread per channel of the
/// grid runs coef(c); then the block's threads fill entries [0, count) of s, entry e for channel
/// channel_of(e), from coef.coefficients (the arithmetic of coef(c)), and meet at a barrier.
/// Every thread of the block calls it. requires: count <= Entries.
template <class Acc, std::size_t Entries, class Coef, class ChannelOf>
__device__ __forceinline__ void begin_normalize(block_coefficients<Acc, Entries>& s, std::size_t C,
                                                const Coef& coef, const Acc* beta,
                                                std::size_t count, ChannelOf channel_of) {
    if constexpr (Coef::finishes)
        grid_channels(C, [&](std::size_t c) { coef(c); });
    for (std::size_t e = threadIdx.x; e < count; e += block_threads) {
        const std::size_t c = channel_of(e);
        const channel_coefficients<Acc> k = coef.coefficients(c);
        s.mean[e] = k.mean;
        s.scale[e] = k.scale;
        s.beta[e] = beta[c];
    }
    __syncthreads();
}

/// Units a thread of an elementwise planes kernel loads before it uses them (vectors 4, single
/// values twice as many).
template <int V>
inline constexpr int elementwise_batch = V == 1 ? 8 : 4;

/// Where a vector of V values from tensor offset w.off lies: its lanes j < split in plane w.plane
/// (channel w.c), the others in the next plane (only when a plane is not whole vectors: planes
/// of at least 2 V values, so a vector straddles at most two).
template <int V>
__device__ __forceinline__ unsigned vector_split(const tensor_walk& w) {
    if constexpr (V == 1) {
        return 1; // known at compile time: single values keep no second plane's coefficients
    } else {
        const std::size_t left = w.inner - w.i;
        return left < V ? static_cast<unsigned>(left) : V;
    }
}

/// K3, planes: block b normalizes the values [b F V, (b + 1) F V) of the tensor (F =
/// block_units) in vectors of V values, thread t the vectors from b F V + t V by block_threads V
/// (consecutive threads, consecutive vectors); elementwise_batch vectors in flight; each lane's
/// coefficients from the block's table (a vector's lanes take at most two entries).
template <class T, class Acc, int V, class Coef>
__global__ void __launch_bounds__(block_threads, 5)
    normalize_planes_kernel(const T* __restrict__ x, T* __restrict__ y, channel_geometry g,
                            Coef coef, const Acc* beta) {
    __shared__ block_coefficients<Acc, planes_block_entries> s;
    constexpr std::size_t span = block_units * V;
    const std::size_t first = std::size_t(blockIdx.x) * span;
    const block_planes planes(g, first, span);
    begin_normalize(s, g.channels, coef, beta, planes.count,
                    [&](std::size_t e) { return (planes.first + e) % g.channels; });
    const std::size_t end = smin(first + span, g.size());
    const std::size_t start = first + std::size_t{threadIdx.x} * V;
    if (start >= end)
        return;
    tensor_walk w(g, start, std::size_t{block_threads} * V);
    while (w.off < end) {
        const std::size_t at = w.off;
        raw_t<V, T> r[elementwise_batch<V>];
        unsigned e[elementwise_batch<V>];
        unsigned split[elementwise_batch<V>];
#pragma unroll
        for (int u = 0; u < elementwise_batch<V>; ++u) {
            e[u] = static_cast<unsigned>(w.plane - planes.first);
            split[u] = vector_split<V>(w);
            if (w.off < end)
                r[u] = load_raw<V>(x + w.off);
            w.next();
        }
#pragma unroll
        for (int u = 0; u < elementwise_batch<V>; ++u) {
            const std::size_t offset = at + u * std::size_t{block_threads} * V;
            if (offset < end) {
                const unsigned e1 = split[u] < V ? e[u] + 1 : e[u];
                Acc v[V];
                unpack<V, T>(r[u], v);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const unsigned k = j < static_cast<int>(split[u]) ? e[u] : e1;
                    v[j] = normalize_value(v[j], s.mean[k], s.scale[k], s.beta[k]);
                }
                store<V>(y + offset, v);
            }
        }
    }
}

/// K3, rows: thread (tx, ty) normalizes channel vector tx of rows ty, ty + ty_count, ...;
/// the coefficients of the block's channel tile come from its table.
template <class T, class Acc, int V, class Coef>
__global__ void __launch_bounds__(block_threads, 5)
    normalize_rows_kernel(const T* __restrict__ x, T* __restrict__ y, channel_geometry g,
                          unsigned tx_count, Coef coef, const Acc* beta) {
    __shared__ block_coefficients<Acc, block_threads> s;
    const std::size_t C = g.channels;
    const std::size_t tile = std::size_t(tx_count) * V; // <= 32 * 8 = block_threads
    const std::size_t first = std::size_t(blockIdx.x) * tile;
    begin_normalize(s, C, coef, beta, first < C ? smin(tile, C - first) : 0,
                    [&](std::size_t e) { return first + e; });
    const unsigned ty_count = block_threads / tx_count;
    const std::size_t e0 = std::size_t(threadIdx.x % tx_count) * V;
    const std::size_t c0 = first + e0;
    if (c0 >= C)
        return;
    Acc mu[V], sc[V], be[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        mu[j] = s.mean[e0 + j];
        sc[j] = s.scale[e0 + j];
        be[j] = s.beta[e0 + j];
    }
    const std::size_t stride = std::size_t(gridDim.y) * ty_count;
    std::size_t r = std::size_t(blockIdx.y) * ty_count + threadIdx.x / tx_count;
    for (; r + 3 * stride < g.outer; r += 4 * stride) {
        raw_t<V, T> q[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            q[u] = load_raw<V>(x + (r + u * stride) * C + c0);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            Acc v[V];
            unpack<V, T>(q[u], v);
#pragma unroll
            for (int j = 0; j < V; ++j)
                v[j] = normalize_value(v[j], mu[j], sc[j], be[j]);
            store<V>(y + (r + u * stride) * C + c0, v);
        }
    }
    for (; r < g.outer; r += stride) {
        Acc v[V];
        load<V>(x + r * C + c0, v);
#pragma unroll
        for (int j = 0; j < V; ++j)
            v[j] = normalize_value(v[j], mu[j], sc[j], be[j]);
        store<V>(y + r * C + c0, v);
    }
}

/// The inputs of the fused dx kernels.
template <class Acc>
struct fused_gradient_args {
    const Acc* totals;
    const Acc* local;
    const double* count;
    const Acc* gamma;
    const Acc* mean;
    const Acc* invstd;
    Acc* dgamma;
    Acc* dbeta;
};

/// dgamma/dbeta once per channel: a grid-stride loop over the channels by global thread index.
template <class Acc>
__device__ __forceinline__ void parameter_gradients(std::size_t C,
                                                    const fused_gradient_args<Acc>& f) {
    if (f.dgamma == nullptr && f.dbeta == nullptr)
        return;
    grid_channels(C, [&](std::size_t c) {
        add_parameter_gradients(c, C, f.local, f.invstd, f.dgamma, f.dbeta);
    });
}

/// K5, planes: the grid's threads walk the tensor in vectors of V values by the grid's stride,
/// elementwise_batch vectors in flight, each lane's coefficients computed from its channel (a
/// vector's lanes take at most two; 1 / count taken once per thread).
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads, V == 1 ? 4 : 3)
    gradient_planes_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                           channel_geometry g, fused_gradient_args<Acc> f) {
    parameter_gradients(g.channels, f);
    const std::size_t size = g.size();
    const std::size_t a = (std::size_t(blockIdx.x) * block_threads + threadIdx.x) * V;
    if (a >= size)
        return;
    const Acc per = gradient_reciprocal<Acc>(*f.count);
    tensor_walk w(g, a, std::size_t(gridDim.x) * block_threads * V);
    while (w.off < size) {
        const std::size_t at = w.off;
        raw_t<V, T> rd[elementwise_batch<V>], rx[elementwise_batch<V>];
        std::size_t c[elementwise_batch<V>];
        unsigned split[elementwise_batch<V>];
#pragma unroll
        for (int u = 0; u < elementwise_batch<V>; ++u) {
            c[u] = w.c;
            split[u] = vector_split<V>(w);
            if (w.off < size) {
                rd[u] = load_raw<V>(dy + w.off);
                rx[u] = load_raw<V>(x + w.off);
            }
            w.next();
        }
#pragma unroll
        for (int u = 0; u < elementwise_batch<V>; ++u) {
            const std::size_t offset = at + u * w.stride;
            if (offset < size) {
                const auto coefficients = [&](std::size_t ch) {
                    return fused_gradient_coefficients_per(ch, g.channels, f.totals, per, f.gamma,
                                                           f.invstd);
                };
                const std::size_t c1 = c[u] + 1 == g.channels ? 0 : c[u] + 1;
                const gradient_coefficients<Acc> co0 = coefficients(c[u]);
                const gradient_coefficients<Acc> co1 = split[u] < V ? coefficients(c1) : co0;
                const Acc mu0 = f.mean[c[u]];
                const Acc mu1 = split[u] < V ? f.mean[c1] : mu0;
                Acc d[V], v[V];
                unpack<V, T>(rd[u], d);
                unpack<V, T>(rx[u], v);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const bool second = j >= static_cast<int>(split[u]);
                    const gradient_coefficients<Acc>& co = second ? co1 : co0;
                    d[j] = input_gradient(d[j], v[j], second ? mu1 : mu0, co.k, co.a, co.b);
                }
                store<V>(dx + offset, d);
            }
        }
    }
}

/// K5, rows: as normalize_rows_kernel with dx.
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads)
    gradient_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                         channel_geometry g, unsigned tx_count, fused_gradient_args<Acc> f) {
    parameter_gradients(g.channels, f);
    const std::size_t C = g.channels;
    const unsigned ty_count = block_threads / tx_count;
    const std::size_t c0 = (std::size_t(blockIdx.x) * tx_count + threadIdx.x % tx_count) * V;
    if (c0 >= C)
        return;
    const double count = *f.count;
    Acc mu[V], k[V], a[V], b[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const gradient_coefficients<Acc> co =
            fused_gradient_coefficients(c0 + j, C, f.totals, count, f.gamma, f.invstd);
        mu[j] = f.mean[c0 + j];
        k[j] = co.k;
        a[j] = co.a;
        b[j] = co.b;
    }
    const std::size_t stride = std::size_t(gridDim.y) * ty_count;
    std::size_t r = std::size_t(blockIdx.y) * ty_count + threadIdx.x / tx_count;
    for (; r + 3 * stride < g.outer; r += 4 * stride) {
        raw_t<V, T> qd[4], qx[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            qd[u] = load_raw<V>(dy + (r + u * stride) * C + c0);
            qx[u] = load_raw<V>(x + (r + u * stride) * C + c0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            Acc d[V], v[V];
            unpack<V, T>(qd[u], d);
            unpack<V, T>(qx[u], v);
#pragma unroll
            for (int j = 0; j < V; ++j)
                d[j] = input_gradient(d[j], v[j], mu[j], k[j], a[j], b[j]);
            store<V>(dx + (r + u * stride) * C + c0, d);
        }
    }
    for (; r < g.outer; r += stride) {
        Acc d[V], v[V];
        load<V>(dy + r * C + c0, d);
        load<V>(x + r * C + c0, v);
#pragma unroll
        for (int j = 0; j < V; ++j)
            d[j] = input_gradient(d[j], v[j], mu[j], k[j], a[j], b[j]);
        store<V>(dx + r * C + c0, d);
    }
}

} // namespace lockstep::kernels::cuda_path::detail
#endif

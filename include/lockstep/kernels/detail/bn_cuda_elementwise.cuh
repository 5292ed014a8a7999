// lockstep/kernels/detail/bn_cuda_elementwise.cuh: the CUDA batch-norm elementwise
// kernels (K3 normalize, K5 fused dx) over planes and rows. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/detail/bn_cuda_device.cuh"
#include "lockstep/kernels/detail/bn_cuda_walks.cuh"

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

/// K3, planes: warp w of the grid normalizes tensor offsets [w I, (w + 1) I), I = item_values;
/// the block's coefficients come from its table.
template <class T, class Acc, int V, class Coef>
__global__ void __launch_bounds__(block_threads, 5)
    normalize_planes_kernel(const T* __restrict__ x, T* __restrict__ y, channel_geometry g,
                            Coef coef, const Acc* beta) {
    __shared__ block_coefficients<Acc, planes_block_entries> s;
    constexpr std::size_t span = block_values(bn_mapping::planes, V);
    const std::size_t first = std::size_t(blockIdx.x) * span;
    const block_planes planes(g, first, span);
    begin_normalize(s, g.channels, coef, beta, planes.count,
                    [&](std::size_t e) { return (planes.first + e) % g.channels; });
    const std::size_t a = first + threadIdx.x / 32 * item_values(V);
    const std::size_t size = g.size();
    if (a >= size)
        return;
    const unsigned lane = threadIdx.x % 32;
    plane_runs(g, a, smin(a + item_values(V), size),
               [&](std::size_t off, std::size_t len, std::size_t q) {
                   const std::size_t e = q - planes.first;
                   normalize_op<T, Acc, V> op{x, y, s.mean[e], s.scale[e], s.beta[e]};
                   warp_run<V>(op, x, off, len, lane);
               });
}

/// K3, small planes: block b normalizes tensor offsets [b F, (b + 1) F), F = block_threads *
/// flat_values, thread t the offsets b F + t, b F + t + block_threads, ... (consecutive threads,
/// consecutive offsets); four values in flight; coefficients from the block's table.
template <class T, class Acc, class Coef>
__global__ void __launch_bounds__(block_threads, 6)
    normalize_flat_kernel(const T* __restrict__ x, T* __restrict__ y, channel_geometry g, Coef coef,
                          const Acc* beta) {
    __shared__ block_coefficients<Acc, flat_block_entries> s;
    constexpr std::size_t span = block_values(bn_mapping::flat, 1);
    const std::size_t first = std::size_t(blockIdx.x) * span;
    const block_planes planes(g, first, span);
    begin_normalize(s, g.channels, coef, beta, planes.count,
                    [&](std::size_t e) { return (planes.first + e) % g.channels; });
    const std::size_t end = smin(first + span, g.size());
    std::size_t off = first + threadIdx.x;
    if (off >= end)
        return;
    // entry e and in-plane index i of off, stepped by block_threads without a division
    std::size_t e = off / g.inner;
    std::size_t i = off - e * g.inner;
    e -= planes.first;
    const std::size_t de = block_threads / g.inner;
    const std::size_t di = block_threads % g.inner;
    const auto next = [&] {
        off += block_threads;
        e += de;
        i += di;
        if (i >= g.inner) {
            i -= g.inner;
            ++e;
        }
    };
    const auto value = [&](T v, std::size_t at) {
        return from_acc<T>(normalize_value(to_acc<Acc>(v), s.mean[at], s.scale[at], s.beta[at]));
    };
    while (off + 3 * block_threads < end) {
        std::size_t at[4], en[4];
        T v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            at[u] = off;
            en[u] = e;
            v[u] = x[off];
            next();
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
            y[at[u]] = value(v[u], en[u]);
    }
    for (; off < end; next())
        y[off] = value(x[off], e);
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

/// K5, planes: as normalize_planes_kernel with dx, coefficients computed per run.
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads)
    gradient_planes_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                           channel_geometry g, fused_gradient_args<Acc> f) {
    parameter_gradients(g.channels, f);
    const std::size_t a =
        (std::size_t(blockIdx.x) * block_warps + threadIdx.x / 32) * item_values(V);
    const std::size_t size = g.size();
    if (a >= size)
        return;
    const unsigned lane = threadIdx.x % 32;
    const double count = *f.count;
    plane_runs(
        g, a, smin(a + item_values(V), size), [&](std::size_t off, std::size_t len, std::size_t q) {
            const std::size_t c = q % g.channels;
            const gradient_coefficients<Acc> co =
                fused_gradient_coefficients(c, g.channels, f.totals, count, f.gamma, f.invstd);
            gradient_op<T, Acc, V> op{dy, x, dx, f.mean[c], co.k, co.a, co.b};
            warp_run<V>(op, x, off, len, lane);
        });
}

/// K5, small planes: as normalize_flat_kernel with dx (1 / count taken once per thread).
template <class T, class Acc>
__global__ void __launch_bounds__(block_threads)
    gradient_flat_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                         channel_geometry g, fused_gradient_args<Acc> f) {
    parameter_gradients(g.channels, f);
    const std::size_t size = g.size();
    const std::size_t a = std::size_t(blockIdx.x) * block_threads + threadIdx.x;
    if (a >= size)
        return;
    const Acc per = gradient_reciprocal<Acc>(*f.count);
    const auto grad = [&](T d, T v, std::size_t c) {
        const gradient_coefficients<Acc> co =
            fused_gradient_coefficients_per(c, g.channels, f.totals, per, f.gamma, f.invstd);
        return from_acc<T>(
            input_gradient(to_acc<Acc>(d), to_acc<Acc>(v), f.mean[c], co.k, co.a, co.b));
    };
    flat_walk w(g, a, std::size_t(gridDim.x) * block_threads);
    while (w.off + 3 * w.stride < size) {
        std::size_t at[4], c[4];
        T d[4], v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            at[u] = w.off;
            c[u] = w.c;
            d[u] = dy[w.off];
            v[u] = x[w.off];
            w.next();
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
            dx[at[u]] = grad(d[u], v[u], c[u]);
    }
    for (; w.off < size; w.next())
        dx[w.off] = grad(dy[w.off], x[w.off], w.c);
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

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

/// K3, planes: warp w of the grid normalizes tensor offsets [w I, (w + 1) I), I = item_values.
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads)
    normalize_planes_kernel(const T* __restrict__ x, T* __restrict__ y, channel_geometry g,
                            const Acc* mean, const Acc* scale, const Acc* beta) {
    const std::size_t a =
        (std::size_t(blockIdx.x) * block_warps + threadIdx.x / 32) * item_values(V);
    const std::size_t size = g.size();
    if (a >= size)
        return;
    const unsigned lane = threadIdx.x % 32;
    plane_runs(g, a, smin(a + item_values(V), size),
               [&](std::size_t off, std::size_t len, std::size_t c) {
                   normalize_op<T, Acc, V> op{x, y, mean[c], scale[c], beta[c]};
                   warp_run<V>(op, x, off, len, lane);
               });
}

/// K3, small planes: thread t of the grid normalizes tensor offsets t, t + S, ... (S the grid's
/// threads): consecutive threads, consecutive offsets; four values in flight.
template <class T, class Acc>
__global__ void __launch_bounds__(block_threads)
    normalize_flat_kernel(const T* __restrict__ x, T* __restrict__ y, channel_geometry g,
                          const Acc* mean, const Acc* scale, const Acc* beta) {
    const std::size_t size = g.size();
    const std::size_t a = std::size_t(blockIdx.x) * block_threads + threadIdx.x;
    if (a >= size)
        return;
    flat_walk w(g, a, std::size_t(gridDim.x) * block_threads);
    while (w.off + 3 * w.stride < size) {
        std::size_t at[4], c[4];
        T v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            at[u] = w.off;
            c[u] = w.c;
            v[u] = x[w.off];
            w.next();
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
            y[at[u]] = from_acc<T>(
                normalize_value(to_acc<Acc>(v[u]), mean[c[u]], scale[c[u]], beta[c[u]]));
    }
    for (; w.off < size; w.next())
        y[w.off] =
            from_acc<T>(normalize_value(to_acc<Acc>(x[w.off]), mean[w.c], scale[w.c], beta[w.c]));
}

/// K3, rows: thread (tx, ty) normalizes channel vector tx of rows ty, ty + ty_count, ...
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads)
    normalize_rows_kernel(const T* __restrict__ x, T* __restrict__ y, channel_geometry g,
                          unsigned tx_count, const Acc* mean, const Acc* scale, const Acc* beta) {
    const std::size_t C = g.channels;
    const unsigned ty_count = block_threads / tx_count;
    const std::size_t c0 = (std::size_t(blockIdx.x) * tx_count + threadIdx.x % tx_count) * V;
    if (c0 >= C)
        return;
    Acc mu[V], sc[V], be[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        mu[j] = mean[c0 + j];
        sc[j] = scale[c0 + j];
        be[j] = beta[c0 + j];
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
    const std::size_t threads = std::size_t(gridDim.x) * gridDim.y * block_threads;
    for (std::size_t c =
             (std::size_t(blockIdx.y) * gridDim.x + blockIdx.x) * block_threads + threadIdx.x;
         c < C; c += threads)
        add_parameter_gradients(c, C, f.local, f.invstd, f.dgamma, f.dbeta);
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
        g, a, smin(a + item_values(V), size), [&](std::size_t off, std::size_t len, std::size_t c) {
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

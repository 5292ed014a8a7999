// lockstep/kernels/detail/bn_cuda_reductions.cuh: the CUDA batch-norm reductions
// (K1 moments, K4 backward sums) over planes and rows. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/detail/bn_cuda_device.cuh"
#include "lockstep/kernels/detail/bn_cuda_walks.cuh"

#include <cstddef>

#include <cub/block/block_reduce.cuh>

namespace lockstep::kernels::cuda_path::detail {

/// The header of the packed forward block, written once per launch.
template <class Acc>
struct block_header {
    Acc status;
    Acc count_hi;
    Acc count_lo;
};

template <class Acc>
__device__ __forceinline__ void write_header(Acc* block, const block_header<Acc>& h) {
    block[packed_moments::status] = h.status;
    block[packed_moments::count_hi] = h.count_hi;
    block[packed_moments::count_lo] = h.count_lo;
}

/// Units a thread of a planes reduction loads before it uses them (vectors: 8 in the moments, 4
/// of 8 values, whose lanes take more registers; 4 pairs in the sums; twice as many single
/// values), and the blocks per SM their registers are held to.
template <int V>
inline constexpr int moments_batch = V == 1   ? 16
                                     : V == 8 ? 4
                                              : 8;
template <int V>
inline constexpr int sums_batch = V == 1 ? 8 : 4;
template <int V>
inline constexpr int planes_reduction_blocks = V == 1 ? 4 : 3;

/// The moments of one channel from its partitions' partials (mean, M2 at mine[2 q], mine[2 q + 1]
/// for q < parts, partition q of count(q) values; written by other blocks, read with __ldcg),
/// Chan-merged in double in ordered_fold's order (fixed by parts). ensures: in every thread.
template <class Acc, class Count>
__device__ moments<double> fold_moment_partials(const Acc* mine, std::size_t parts, Count count) {
    return ordered_fold<moments<double>>(
        parts,
        [&](std::size_t q) {
            return moments<double>{count(q), static_cast<double>(__ldcg(mine + 2 * q)),
                                   static_cast<double>(__ldcg(mine + 2 * q + 1))};
        },
        chan_merge{});
}

/// The backward sums of one channel from its partitions' partials (sum dy, sum dy (x - mean) at
/// mine[2 q], mine[2 q + 1]), added in double in ordered_fold's order.
template <class Acc>
__device__ dy_sums<double> fold_sum_partials(const Acc* mine, std::size_t parts) {
    return ordered_fold<dy_sums<double>>(
        parts,
        [&](std::size_t q) {
            return dy_sums<double>{static_cast<double>(__ldcg(mine + 2 * q)),
                                   static_cast<double>(__ldcg(mine + 2 * q + 1))};
        },
        add_dy_sums{});
}

/// Values a planes reduction's plane_vectors count a vector as: V with edges (g counts values),
/// else 1 (g counts units).
template <int V, bool Edges>
inline constexpr std::size_t plane_vector_values = Edges ? std::size_t{V} : std::size_t{1};

/// K1, planes: block = (channel c, partition p) of cuda_partitions(g) partitions of the channel's
/// units, the vectors of V values inside its planes (plane_vectors), walked flat (flat_channel).
/// Without Edges the planes are whole vectors and g counts units (unit_geometry); with Edges g
/// counts values, and the block also reads the planes' edges (the values outside those vectors)
/// of its share of the samples one at a time (plane_edges), after the walk.
template <class T, class Acc, int V, bool Edges = false>
__global__ void __launch_bounds__(block_threads, planes_reduction_blocks<V>)
    moments_planes_kernel(const T* __restrict__ x, channel_geometry g, std::size_t parts,
                          Acc* partials, unsigned* counters, block_header<Acc> header, Acc* block) {
    using reduce_t = cub::BlockReduce<moments<Acc>, block_threads>;
    __shared__ typename reduce_t::TempStorage tmp;
    const std::size_t c = blockIdx.x / parts;
    const std::size_t p = blockIdx.x - c * parts;
    const plane_vectors pv(g, c, plane_vector_values<V, Edges>);
    const std::size_t n = g.outer * pv.units;
    moments_op<T, Acc, V> op{x};
    flat_channel<moments_batch<V>>(pv, n * p / parts, n * (p + 1) / parts, op);
    moments<Acc> mine = op.result();
    if constexpr (Edges) {
        batched_lanes<Acc, 1> e{};
        plane_edges(pv, g.outer * p / parts, g.outer * (p + 1) / parts, [&](std::size_t off) {
            e.template add<1>(1, [&](int, Acc(&v)[1]) { v[0] = to_acc<Acc>(x[off]); });
        });
        mine = chan_merge{}(mine, e.result());
    }
    const moments<Acc> m = reduce_t(tmp).Reduce(mine, chan_merge{});
    if (threadIdx.x == 0) {
        partials[std::size_t{2} * blockIdx.x] = m.mean;
        partials[std::size_t{2} * blockIdx.x + 1] = m.m2;
    }
    if (!arrive_last(counters + c, parts))
        return;
    const moments<double> total =
        fold_moment_partials(partials + 2 * c * parts, parts, [&](std::size_t q) {
            const std::size_t units = n * (q + 1) / parts - n * q / parts; // q's share of n
            if constexpr (!Edges)
                return static_cast<double>(units * V);
            const std::size_t samples = g.outer * (q + 1) / parts - g.outer * q / parts;
            return static_cast<double>(units * V + samples * (pv.head + pv.tail));
        });
    if (threadIdx.x == 0) {
        block[packed_moments::mean(c)] = static_cast<Acc>(total.mean);
        block[packed_moments::m2(c)] = static_cast<Acc>(total.m2);
        if (c == 0)
            write_header(block, header);
    }
}

/// K1, rows: block = (channel tile of tx_count * V channels, row partition blockIdx.y).
/// partials hold [partition][mean | m2][channel].
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads)
    moments_rows_kernel(const T* __restrict__ x, channel_geometry g, unsigned tx_count,
                        std::size_t parts, Acc* partials, unsigned* counters,
                        block_header<Acc> header, Acc* block) {
    __shared__ Acc s_mean[block_threads * V];
    __shared__ Acc s_m2[block_threads * V];
    __shared__ Acc s_n[block_threads];
    const std::size_t C = g.channels;
    const unsigned ty_count = block_threads / tx_count;
    const unsigned tx = threadIdx.x % tx_count;
    const unsigned ty = threadIdx.x / tx_count;
    const std::size_t tile = std::size_t(tx_count) * V;
    const std::size_t c0 = blockIdx.x * tile + std::size_t{tx} * V;
    const std::size_t p = blockIdx.y;
    const std::size_t r1 = g.outer * (p + 1) / parts;
    // rows r, r + ty_count, ... of the partition, 4 loads in flight, merged 4 at a time
    batched_lanes<Acc, V> lanes{};
    if (c0 < C) {
        const T* col = x + c0;
        for (std::size_t r = g.outer * p / parts + ty; r < r1; r += std::size_t{4} * ty_count) {
            const std::size_t left = (r1 - r + ty_count - 1) / ty_count;
            const int count = left < 4 ? static_cast<int>(left) : 4;
            raw_t<V, T> q[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (u < count)
                    q[u] = load_raw<V>(col + (r + std::size_t(u) * ty_count) * C);
            lanes.template add<4>(count, [&](int u, Acc(&v)[V]) { unpack<V, T>(q[u], v); });
        }
    }
    Acc& n = lanes.count;
    Acc(&mean)[V] = lanes.mean;
    Acc(&m2)[V] = lanes.m2;
    // fold the rows of the block: ty with ty + s for s = 1, 2, 4, ... (fixed order)
    const chan_merge merge;
    s_n[threadIdx.x] = n;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        s_mean[threadIdx.x * V + j] = mean[j];
        s_m2[threadIdx.x * V + j] = m2[j];
    }
    __syncthreads();
    for (unsigned s = 1; s < ty_count; s *= 2) {
        if (ty % (2 * s) == 0) {
            const unsigned o = threadIdx.x + s * tx_count;
            const Acc on = s_n[o];
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const moments<Acc> r = merge(moments<Acc>{n, mean[j], m2[j]},
                                             moments<Acc>{on, s_mean[o * V + j], s_m2[o * V + j]});
                mean[j] = r.mean;
                m2[j] = r.m2;
            }
            n += on;
            s_n[threadIdx.x] = n;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                s_mean[threadIdx.x * V + j] = mean[j];
                s_m2[threadIdx.x * V + j] = m2[j];
            }
        }
        __syncthreads();
    }
    if (ty == 0 && c0 < C) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            partials[2 * p * C + c0 + j] = mean[j];
            partials[(2 * p + 1) * C + c0 + j] = m2[j];
        }
    }
    if (!arrive_last(counters + blockIdx.x, parts))
        return;
    // Each channel's partitions about its first partition's mean (shifted_moments: no division
    // per partition, the loads batched), in an order fixed by (parts, tile).
    const std::size_t first = blockIdx.x * tile;
    const auto total = channel_fold<shifted_moments>(
        static_cast<unsigned>(tile), parts,
        [&](std::size_t j, std::size_t q0, std::size_t q1) {
            const std::size_t c = first + j;
            if (c >= C)
                return shifted_moments{};
            shifted_moments m{static_cast<double>(__ldcg(partials + c))};
            partition_walk rows(g.outer, parts, q0);
            batched_partials(partials + c, C, q0, q1, [&](Acc mean_q, Acc m2_q) {
                m.add(static_cast<double>(rows.next()), static_cast<double>(mean_q),
                      static_cast<double>(m2_q));
            });
            return m;
        },
        [](const shifted_moments& a, const shifted_moments& b) { return a + b; });
    if (total.leader && first + total.channel < C) {
        const std::size_t c = first + total.channel;
        const moments<double> m = total.value.result();
        block[packed_moments::mean(c)] = static_cast<Acc>(m.mean);
        block[packed_moments::m2(c)] = static_cast<Acc>(m.m2);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        write_header(block, header);
}

/// The header alone (no channels).
template <class Acc>
__global__ void header_kernel(block_header<Acc> header, Acc* block) {
    write_header(block, header);
}

/// K4, planes: block = (channel c, partition p), as moments_planes_kernel; partials hold
/// (sum dy, sum dy (x - mean)).
template <class T, class Acc, int V, bool Edges = false>
__global__ void __launch_bounds__(block_threads, planes_reduction_blocks<V>)
    sums_planes_kernel(const T* __restrict__ dy, const T* __restrict__ x, channel_geometry g,
                       std::size_t parts, const Acc* mean, Acc status, Acc* partials,
                       unsigned* counters, Acc* sums) {
    using reduce_t = cub::BlockReduce<dy_sums<Acc>, block_threads>;
    __shared__ typename reduce_t::TempStorage tmp;
    const std::size_t c = blockIdx.x / parts;
    const std::size_t p = blockIdx.x - c * parts;
    const plane_vectors pv(g, c, plane_vector_values<V, Edges>);
    const std::size_t n = g.outer * pv.units;
    sums_op<T, Acc, V> op{dy, x, {mean[c]}};
    flat_channel<sums_batch<V>>(pv, n * p / parts, n * (p + 1) / parts, op);
    if constexpr (Edges)
        plane_edges(pv, g.outer * p / parts, g.outer * (p + 1) / parts, [&](std::size_t off) {
            backward_accumulate(op.sdy[0], op.sdyx[0], to_acc<Acc>(dy[off]), to_acc<Acc>(x[off]),
                                op.mu[0]);
        });
    const dy_sums<Acc> s = reduce_t(tmp).Reduce(op.result(), add_dy_sums{});
    if (threadIdx.x == 0) {
        partials[std::size_t{2} * blockIdx.x] = s.dy;
        partials[std::size_t{2} * blockIdx.x + 1] = s.dyx;
    }
    if (!arrive_last(counters + c, parts))
        return;
    const dy_sums<double> total = fold_sum_partials(partials + 2 * c * parts, parts);
    if (threadIdx.x == 0) {
        sums[c] = static_cast<Acc>(total.dy);
        sums[g.channels + c] = static_cast<Acc>(total.dyx);
        if (c == 0)
            sums[packed_sums::status(g.channels)] = status;
    }
}

/// K4, rows: as moments_rows_kernel with the backward sums.
template <class T, class Acc, int V>
__global__ void __launch_bounds__(block_threads)
    sums_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x, channel_geometry g,
                     unsigned tx_count, std::size_t parts, const Acc* mean, Acc status,
                     Acc* partials, unsigned* counters, Acc* sums) {
    __shared__ Acc s_dy[block_threads * V];
    __shared__ Acc s_dyx[block_threads * V];
    const std::size_t C = g.channels;
    const unsigned ty_count = block_threads / tx_count;
    const unsigned tx = threadIdx.x % tx_count;
    const unsigned ty = threadIdx.x / tx_count;
    const std::size_t tile = std::size_t(tx_count) * V;
    const std::size_t c0 = blockIdx.x * tile + std::size_t{tx} * V;
    const std::size_t p = blockIdx.y;
    const std::size_t r1 = g.outer * (p + 1) / parts;
    Acc sdy[V] = {};
    Acc sdyx[V] = {};
    if (c0 < C) {
        Acc mu[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
            mu[j] = mean[c0 + j];
        std::size_t r = g.outer * p / parts + ty;
        for (; r + std::size_t{3} * ty_count < r1; r += std::size_t{4} * ty_count) {
            raw_t<V, T> qd[4], qx[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                qd[u] = load_raw<V>(dy + (r + std::size_t(u) * ty_count) * C + c0);
                qx[u] = load_raw<V>(x + (r + std::size_t(u) * ty_count) * C + c0);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                Acc d[V], v[V];
                unpack<V, T>(qd[u], d);
                unpack<V, T>(qx[u], v);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    backward_accumulate(sdy[j], sdyx[j], d[j], v[j], mu[j]);
            }
        }
        for (; r < r1; r += ty_count) {
            Acc d[V], v[V];
            load<V>(dy + r * C + c0, d);
            load<V>(x + r * C + c0, v);
#pragma unroll
            for (int j = 0; j < V; ++j)
                backward_accumulate(sdy[j], sdyx[j], d[j], v[j], mu[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
        s_dy[threadIdx.x * V + j] = sdy[j];
        s_dyx[threadIdx.x * V + j] = sdyx[j];
    }
    __syncthreads();
    for (unsigned s = 1; s < ty_count; s *= 2) {
        if (ty % (2 * s) == 0) {
            const unsigned o = threadIdx.x + s * tx_count;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                sdy[j] += s_dy[o * V + j];
                sdyx[j] += s_dyx[o * V + j];
                s_dy[threadIdx.x * V + j] = sdy[j];
                s_dyx[threadIdx.x * V + j] = sdyx[j];
            }
        }
        __syncthreads();
    }
    if (ty == 0 && c0 < C) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            partials[2 * p * C + c0 + j] = sdy[j];
            partials[(2 * p + 1) * C + c0 + j] = sdyx[j];
        }
    }
    if (!arrive_last(counters + blockIdx.x, parts))
        return;
    const std::size_t first = blockIdx.x * tile;
    const auto total = channel_fold<dy_sums<double>>(
        static_cast<unsigned>(tile), parts,
        [&](std::size_t j, std::size_t q0, std::size_t q1) {
            dy_sums<double> d;
            const std::size_t c = first + j;
            if (c >= C)
                return d;
            batched_partials(partials + c, C, q0, q1, [&](Acc dy_q, Acc dyx_q) {
                d.dy += static_cast<double>(dy_q);
                d.dyx += static_cast<double>(dyx_q);
            });
            return d;
        },
        add_dy_sums{});
    if (total.leader && first + total.channel < C) {
        const std::size_t c = first + total.channel;
        sums[c] = static_cast<Acc>(total.value.dy);
        sums[C + c] = static_cast<Acc>(total.value.dyx);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        sums[packed_sums::status(C)] = status;
}

/// The status alone (no channels).
template <class Acc>
__global__ void status_kernel(Acc status, Acc* sums) {
    sums[0] = status;
}

} // namespace lockstep::kernels::cuda_path::detail
#endif

// lockstep/kernels/bn_cub.cuh: the CUDA fast path of the batch-norm reductions: one thread
// block per (channel, partition), Welford per thread, Chan merge in a CUB block reduction.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>
#include <span>

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime_api.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep::kernels::cub_path {

/// Threads per block of the reduction kernels.
inline constexpr int block_threads = 256;

/// Partitions per channel: about 8 values per thread, at most generic_partitions(g) so the
/// generic path's workspace size serves both paths.
inline std::size_t partitions(const channel_geometry& g) {
    const std::size_t per_block = static_cast<std::size_t>(block_threads) * 8;
    std::size_t p = (g.per_channel() + per_block - 1) / per_block;
    const std::size_t cap = generic_partitions(g);
    if (p > cap)
        p = cap;
    return p == 0 ? 1 : p;
}

/// Sums of (dy, dy * (x - mean)) as one value for the block reduction.
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

template <class T, class Acc>
__global__ void __launch_bounds__(block_threads)
    partial_moments_kernel(const T* x, channel_geometry g, std::size_t parts,
                           moments<Acc>* partials) {
    using reduce_t = cub::BlockReduce<moments<Acc>, block_threads>;
    __shared__ typename reduce_t::TempStorage tmp;
    const std::size_t t = blockIdx.x;
    const std::size_t c = t / parts;
    const std::size_t p = t % parts;
    const std::size_t n = g.per_channel();
    moments<Acc> m;
    for (std::size_t k = n * p / parts + threadIdx.x; k < n * (p + 1) / parts; k += block_threads)
        welford_update(m, static_cast<Acc>(x[g.offset(c, k)]));
    m = reduce_t(tmp).Reduce(m, chan_merge{});
    if (threadIdx.x == 0)
        partials[t] = m;
}

template <class T, class Acc>
__global__ void __launch_bounds__(block_threads)
    partial_backward_kernel(const T* dy, const T* x, channel_geometry g, std::size_t parts,
                            const Acc* mean, Acc* partials) {
    using reduce_t = cub::BlockReduce<dy_sums<Acc>, block_threads>;
    __shared__ typename reduce_t::TempStorage tmp;
    const std::size_t t = blockIdx.x;
    const std::size_t c = t / parts;
    const std::size_t p = t % parts;
    const std::size_t n = g.per_channel();
    const Acc mu = mean[c];
    dy_sums<Acc> s;
    for (std::size_t k = n * p / parts + threadIdx.x; k < n * (p + 1) / parts; k += block_threads) {
        const std::size_t i = g.offset(c, k);
        backward_accumulate(s.dy, s.dyx, static_cast<Acc>(dy[i]), static_cast<Acc>(x[i]), mu);
    }
    s = reduce_t(tmp).Reduce(s, add_dy_sums{});
    if (threadIdx.x == 0) {
        partials[2 * t] = s.dy;
        partials[2 * t + 1] = s.dyx;
    }
}

/// As kernels::channel_moments_generic, with a CUB block reduction per (channel, partition);
/// the partials are merged by the shared merge_partials_fn. Asynchronous on sys.stream().
template <class T, class Acc, class System>
void channel_moments(const System& sys, std::span<const T> x, channel_geometry g,
                     std::span<moments<Acc>> out, std::span<moments<Acc>> workspace) {
    const std::size_t parts = partitions(g);
    const std::size_t tasks = g.channels * parts;
    if (g.channels == 0)
        return;
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(sys.device()));
    partial_moments_kernel<T, Acc>
        <<<static_cast<unsigned>(tasks), block_threads, 0, sys.stream()>>>(x.data(), g, parts,
                                                                           workspace.data());
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(g.channels),
                     merge_partials_fn<Acc>{workspace.data(), parts, out.data()});
}

/// As kernels::backward_sums_generic, with a CUB block reduction per (channel, partition).
template <class T, class Acc, class System>
void backward_sums(const System& sys, std::span<const T> dy, std::span<const T> x,
                   channel_geometry g, std::span<const Acc> mean, std::span<Acc> sums,
                   std::span<Acc> workspace) {
    const std::size_t parts = partitions(g);
    const std::size_t tasks = g.channels * parts;
    if (g.channels == 0)
        return;
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(sys.device()));
    partial_backward_kernel<T, Acc>
        <<<static_cast<unsigned>(tasks), block_threads, 0, sys.stream()>>>(
            dy.data(), x.data(), g, parts, mean.data(), workspace.data());
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(g.channels),
                     merge_backward_fn<Acc>{workspace.data(), parts, g.channels, sums.data()});
}

} // namespace lockstep::kernels::cub_path
#endif

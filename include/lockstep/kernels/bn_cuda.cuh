// lockstep/kernels/bn_cuda.cuh: the CUDA fast path of batch norm: host launchers of the fused
// moments, normalize, backward-sums and dx kernels on a cuda_system's stream.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_cuda_kernels.cuh"
#include "lockstep/kernels/detail/bn_launch_plan.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include <cuda_runtime_api.h>

// Every launcher enqueues on `stream` (of the current device) and returns: no synchronisation, no
// allocation; the cuda_system overloads below set the device and pass the system's stream. T is
// float, double, __half or __nv_bfloat16 (or lockstep::half / lockstep::bfloat16, processed as
// the CUDA types); Acc is double for double data and float otherwise. Pointers are device
// pointers of the current device, naturally aligned for their type; 16-byte aligned data (as every
// cuda_system allocation is) with planes of whole 16-byte vectors (NCHW; 8-byte ones of 16-bit
// values too; the normalize and dx kernels also where vectors straddle planes, the reductions
// channel tiles of whole vectors where planes are not, or the vectors inside each plane with its
// edges by value) or channels of them (NHWC) takes a vector path, anything else a scalar path
// (same arithmetic per value; reductions agree to rounding): which kernel and grid, the plan of
// kernels/detail/bn_launch_plan.hpp says. Launch errors throw lockstep::error (errc::cuda).
namespace lockstep::kernels::cuda_path {

namespace detail {

template <class T, class Acc>
constexpr void check_types() {
    using N = native_t<T>;
    static_assert(std::is_same_v<N, float> || std::is_same_v<N, double> ||
                      std::is_same_v<N, __half> || std::is_same_v<N, __nv_bfloat16>,
                  "the CUDA batch-norm kernels take float, double, half or bfloat16 data.");
    static_assert(std::is_same_v<Acc, accumulation_t<N>>,
                  "the CUDA batch-norm kernels accumulate double data in double and everything "
                  "else in float: use Acc = kernels::accumulation_t<T>.");
}

/// Launches kernel k on grid x block threads on `stream` with the arguments a: the one place a
/// batch-norm kernel is launched. LOCKSTEP_KERNEL_LAUNCH_HOOK, when defined (only by the CPU
/// block emulator of the tests, tests/support/cuda_emulator.hpp), runs it instead, so the host
/// test runs these very launchers.
template <class... P, class... A>
void launch_kernel(void (*k)(P...), dim3 grid, unsigned block, cudaStream_t stream, const A&... a) {
#ifdef LOCKSTEP_KERNEL_LAUNCH_HOOK
    (void)stream;
    LOCKSTEP_KERNEL_LAUNCH_HOOK(k, grid, block, a...);
#else
    k<<<grid, block, 0, stream>>>(a...);
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
#endif
}

/// Launches the plan's kernel: f(grid, width) with width a std::integral_constant<int, W>, W =
/// p.width values of native type N per access (1, the 16-byte vector's V, or the 8-byte vector's
/// V / 2 of 16-bit values, which only the planes kernels read; the tiles kernels read V only);
/// f picks the kernel of p.mapping. throws lockstep::error (errc::internal) for any other width,
/// a width the mapping's kernels do not take, or edges with any but the planes kernels' V:
/// nothing would be launched.
template <class N, class F>
void launch(const bn_launch& p, F&& f) {
    constexpr int V = vector_width<N>;
    const dim3 grid(p.grid_x, p.grid_y);
    LOCKSTEP_REQUIRE(!p.edges || (p.mapping == bn_mapping::planes && p.width == V), errc::internal,
                     -1, "batch-norm launch", "the launch plan's edges come with width ", p.width,
                     ": only the planes reductions of ", V, " values a vector read edges");
    if (p.width == 1 && p.mapping != bn_mapping::tiles)
        return f(grid, std::integral_constant<int, 1>{});
    if (p.width == V)
        return f(grid, std::integral_constant<int, V>{});
    if constexpr (V / 2 >= 4) {
        if (p.width == V / 2 && p.mapping == bn_mapping::planes)
            return f(grid, std::integral_constant<int, V / 2>{});
    }
    const char* mapping = p.mapping == bn_mapping::planes ? "planes"
                          : p.mapping == bn_mapping::rows ? "rows"
                                                          : "tiles";
    LOCKSTEP_REQUIRE(false, errc::internal, -1, "batch-norm launch", "the launch plan's width ",
                     p.width, " fits no ", mapping, " kernel of ", sizeof(N), "-byte values");
}

/// The reductions' workspace: the arrival counters, then the partials (bn_workspace_bytes).
template <class Acc>
struct workspace_parts {
    unsigned* counters;
    Acc* partials;
    workspace_parts(channel_geometry g, void* workspace)
        : counters(static_cast<unsigned*>(workspace)),
          partials(reinterpret_cast<Acc*>(static_cast<std::byte*>(workspace) +
                                          kernels::detail::counter_bytes(g))) {}
};

} // namespace detail

/// K1: this replica's packed statistics block (packed_moments layout) in one launch:
/// block[status] = status, the exact count g.per_channel() in (count_hi, count_lo), and each
/// channel's Welford mean and M2 (per-(channel, partition) blocks, partials folded in a fixed
/// order in double with exact counts by the last block of each channel or tile: Chan merges
/// for NCHW, sums about a shift for NHWC rows, kernels::shifted_moments).
/// requires: x holds g.size() values; block holds packed_moments::size(g.channels) values;
///           workspace holds bn_workspace_bytes<T, Acc>(g) bytes, zero-filled before its first
///           use and not used concurrently by another launch.
/// ensures: the workspace's counters are zero again when the kernel ends.
template <class T, class Acc>
void pack_local_moments(cudaStream_t stream, const T* x, channel_geometry g, Acc status, Acc* block,
                        void* workspace) {
    detail::check_types<T, Acc>();
    using N = native_t<T>;
    const N* xn = reinterpret_cast<const N*>(x);
    detail::block_header<Acc> header{status, 0, 0};
    packed_moments::split_count(g.per_channel(), header.count_hi, header.count_lo);
    if (g.channels == 0) {
        detail::launch_kernel(detail::header_kernel<Acc>, dim3(1), 1, stream, header, block);
        return;
    }
    const detail::workspace_parts<Acc> w(g, workspace);
    const detail::bn_launch p = detail::plan_bn_launch(
        g, sizeof(T), kernels::detail::cuda_partitions(g, sizeof(T)), 0, {x});
    detail::launch<N>(p, [&](dim3 grid, auto width) {
        constexpr int W = decltype(width)::value;
        if (p.mapping == detail::bn_mapping::planes && !p.edges) {
            detail::launch_kernel(detail::moments_planes_kernel<N, Acc, W>, grid, block_threads,
                                  stream, xn, detail::unit_geometry(g, W), p.parts, w.partials,
                                  w.counters, header, block);
        } else if (p.mapping != detail::bn_mapping::rows) { // edges or tiles: 16-byte vectors
            if constexpr (W == detail::vector_width<N>) {
                if (p.edges)
                    detail::launch_kernel(detail::moments_planes_kernel<N, Acc, W, true>, grid,
                                          block_threads, stream, xn, g, p.parts, w.partials,
                                          w.counters, header, block);
                else
                    detail::launch_kernel(detail::moments_tiles_kernel<N, Acc, W>, grid,
                                          block_threads, stream, xn, g, p.tile, p.parts, w.partials,
                                          w.counters, header, block);
            }
        } else if constexpr (detail::rows_width<N, W>) {
            detail::launch_kernel(detail::moments_rows_kernel<N, Acc, W>, grid, block_threads,
                                  stream, xn, g, p.tx, p.parts, w.partials, w.counters, header,
                                  block);
        }
    });
}

namespace detail {

/// K3 over g with the coefficients of `coef` (coefficient_arrays, eval_coefficients_fn,
/// finish_statistics_fn): the plan's normalize kernel; a source that finishes (Coef::finishes)
/// also runs coef(c) for every channel in the same launch, so it launches for an empty batch
/// too.
template <class T, class Acc, class Coef>
void launch_normalize(cudaStream_t stream, const T* x, T* y, channel_geometry g, const Coef& coef,
                      const Acc* beta) {
    check_types<T, Acc>();
    using N = native_t<T>;
    const N* xn = reinterpret_cast<const N*>(x);
    N* yn = reinterpret_cast<N*>(y);
    if (g.channels == 0 || (!Coef::finishes && g.size() == 0))
        return;
    const bn_launch p = plan_bn_launch(g, sizeof(T), 0, 0, {x, y});
    launch<N>(p, [&](dim3 grid, auto width) {
        constexpr int W = decltype(width)::value;
        if (p.mapping == bn_mapping::planes)
            launch_kernel(normalize_planes_kernel<N, Acc, W, Coef>, grid, block_threads, stream, xn,
                          yn, g, coef, beta);
        else if constexpr (rows_width<N, W>)
            launch_kernel(normalize_rows_kernel<N, Acc, W, Coef>, grid, block_threads, stream, xn,
                          yn, g, p.tx, coef, beta);
    });
}

} // namespace detail

/// K3: y = normalize_value(x, mean_c, scale_c, beta_c) for every value of channel c.
/// requires: x and y hold g.size() values and do not overlap; mean, scale, beta hold
///           g.channels values.
template <class T, class Acc>
void normalize(cudaStream_t stream, const T* x, T* y, channel_geometry g, const Acc* mean,
               const Acc* scale, const Acc* beta) {
    detail::launch_normalize(stream, x, y, g, coefficient_arrays<Acc>{mean, scale}, beta);
}

/// F2 + K3 in one launch: fin(c) for every channel c (one thread each; fin writes the
/// coefficients fin.mean, fin.scale and what else it keeps), and y normalized with the
/// coefficients each block computes for the channels it touches with fin.coefficients, the
/// arithmetic of fin(c). requires: as normalize for x, y and beta; fin's arrays do not overlap
/// them (g.size() may be 0).
template <class T, class Acc, class Finish>
void finish_and_normalize(cudaStream_t stream, const Finish& fin, const T* x, T* y,
                          channel_geometry g, const Acc* beta) {
    static_assert(Finish::finishes);
    detail::launch_normalize(stream, x, y, g, fin, beta);
}

/// K4: the backward sums with a status slot (packed_sums layout) in one launch:
/// sums[c] = sum dy, sums[C + c] = sum dy * (x - mean_c) (backward_accumulate), sums[2 C] =
/// status. Partials per (channel, partition) are added in a fixed tree order (in double) by the
/// last block of each channel or tile: no floating-point atomics, the same bits on every run.
/// requires: dy and x hold g.size() values; mean g.channels; sums packed_sums::size(g.channels);
///           workspace as for pack_local_moments (the two may share one workspace).
template <class T, class Acc>
void pack_backward_sums(cudaStream_t stream, const T* dy, const T* x, channel_geometry g,
                        const Acc* mean, Acc status, Acc* sums, void* workspace) {
    detail::check_types<T, Acc>();
    using N = native_t<T>;
    const N* dyn = reinterpret_cast<const N*>(dy);
    const N* xn = reinterpret_cast<const N*>(x);
    if (g.channels == 0) {
        detail::launch_kernel(detail::status_kernel<Acc>, dim3(1), 1, stream, status, sums);
        return;
    }
    const detail::workspace_parts<Acc> w(g, workspace);
    const detail::bn_launch p = detail::plan_bn_launch(
        g, sizeof(T), kernels::detail::cuda_partitions(g, sizeof(T)), 0, {dy, x});
    detail::launch<N>(p, [&](dim3 grid, auto width) {
        constexpr int W = decltype(width)::value;
        if (p.mapping == detail::bn_mapping::planes && !p.edges) {
            detail::launch_kernel(detail::sums_planes_kernel<N, Acc, W>, grid, block_threads,
                                  stream, dyn, xn, detail::unit_geometry(g, W), p.parts, mean,
                                  status, w.partials, w.counters, sums);
        } else if (p.mapping != detail::bn_mapping::rows) { // edges or tiles: 16-byte vectors
            if constexpr (W == detail::vector_width<N>) {
                if (p.edges)
                    detail::launch_kernel(detail::sums_planes_kernel<N, Acc, W, true>, grid,
                                          block_threads, stream, dyn, xn, g, p.parts, mean, status,
                                          w.partials, w.counters, sums);
                else
                    detail::launch_kernel(detail::sums_tiles_kernel<N, Acc, W>, grid, block_threads,
                                          stream, dyn, xn, g, p.tile, p.parts, mean, status,
                                          w.partials, w.counters, sums);
            }
        } else if constexpr (detail::rows_width<N, W>) {
            detail::launch_kernel(detail::sums_rows_kernel<N, Acc, W>, grid, block_threads, stream,
                                  dyn, xn, g, p.tx, p.parts, mean, status, w.partials, w.counters,
                                  sums);
        }
    });
}

/// K5: dx = input_gradient(dy, x, mean_c, k, a, b) with fused_gradient_coefficients (k = gamma
/// invstd, a = totals[c] / count, b = invstd^2 totals[C + c] / count, a = b = 0 when
/// *count == 0), and once per channel dgamma[c] += local[C + c] * invstd[c],
/// dbeta[c] += local[c] (skipped for a null dgamma / dbeta), in one launch.
/// requires: dy, x, dx hold g.size() values, dx overlaps neither; totals and local hold
///           2 g.channels values (packed_sums layout; local is this replica's pack_backward_sums,
///           totals their sum over the replicas the statistics were taken over); count points
///           to one double in device memory; gamma, mean, invstd, dgamma, dbeta g.channels.
template <class T, class Acc>
void input_gradient_fused(cudaStream_t stream, const T* dy, const T* x, T* dx, channel_geometry g,
                          const Acc* totals, const Acc* local, const double* count,
                          const Acc* gamma, const Acc* mean, const Acc* invstd, Acc* dgamma,
                          Acc* dbeta) {
    detail::check_types<T, Acc>();
    using N = native_t<T>;
    const N* dyn = reinterpret_cast<const N*>(dy);
    const N* xn = reinterpret_cast<const N*>(x);
    N* dxn = reinterpret_cast<N*>(dx);
    const detail::fused_gradient_args<Acc> args{totals, local,  count,  gamma,
                                                mean,   invstd, dgamma, dbeta};
    if (g.channels == 0)
        return;
    // The planes kernel gives each channel's parameter gradients to one thread.
    const std::size_t channel_blocks = (g.channels + block_threads - 1) / block_threads;
    const detail::bn_launch p =
        detail::plan_bn_launch(g, sizeof(T), 0, channel_blocks, {dy, x, dx});
    detail::launch<N>(p, [&](dim3 grid, auto width) {
        constexpr int W = decltype(width)::value;
        if (p.mapping == detail::bn_mapping::planes)
            detail::launch_kernel(detail::gradient_planes_kernel<N, Acc, W>, grid, block_threads,
                                  stream, dyn, xn, dxn, g, args);
        else if constexpr (detail::rows_width<N, W>)
            detail::launch_kernel(detail::gradient_rows_kernel<N, Acc, W>, grid, block_threads,
                                  stream, dyn, xn, dxn, g, p.tx, args);
    });
}

} // namespace lockstep::kernels::cuda_path

// cuda_system's batch-norm operations: overloads on const cuda_system& in lockstep::gpu (the
// namespace of cuda_system's base, system/cuda_system.hpp), found by argument-dependent lookup
// on a cuda_system only, from the public kernels (kernels/bn_forward.hpp, bn_backward.hpp) once
// those have checked the spans. channel_moments, backward_sums and input_gradient have none
// here: on the CUDA system they run the generic Thrust path.
namespace lockstep::gpu {

namespace detail {
/// Makes sys's device current and returns its stream, for the cuda_path launchers.
inline cudaStream_t bn_stream(const cuda_system& sys) {
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(sys.device()));
    return sys.stream();
}
} // namespace detail

/// The packed statistics block in one launch (cuda_path::pack_local_moments).
template <class T, class Acc>
void bn_pack_local_moments(const cuda_system& sys, std::span<const T> x,
                           kernels::channel_geometry g, Acc status, std::span<Acc> block,
                           std::span<std::byte> workspace) {
    kernels::cuda_path::pack_local_moments(detail::bn_stream(sys), x.data(), g, status,
                                           block.data(), workspace.data());
}

/// The normalization in one launch (cuda_path::normalize).
template <class T, class Acc>
void bn_normalize(const cuda_system& sys, std::span<const T> x, std::span<T> y,
                  kernels::channel_geometry g, std::span<const Acc> mean,
                  std::span<const Acc> scale, std::span<const Acc> beta) {
    kernels::cuda_path::normalize(detail::bn_stream(sys), x.data(), y.data(), g, mean.data(),
                                  scale.data(), beta.data());
}

/// The finish of every channel and the normalization in one launch
/// (cuda_path::finish_and_normalize).
template <class T, class Acc, class Finish>
void bn_finish_normalize(const cuda_system& sys, const Finish& fin, std::span<const T> x,
                         std::span<T> y, kernels::channel_geometry g, std::span<const Acc> beta) {
    kernels::cuda_path::finish_and_normalize(detail::bn_stream(sys), fin, x.data(), y.data(), g,
                                             beta.data());
}

/// The packed backward sums in one deterministic launch (cuda_path::pack_backward_sums).
template <class T, class Acc>
void bn_pack_backward_sums(const cuda_system& sys, std::span<const T> dy, std::span<const T> x,
                           kernels::channel_geometry g, std::span<const Acc> mean, Acc status,
                           std::span<Acc> sums, std::span<std::byte> workspace) {
    kernels::cuda_path::pack_backward_sums(detail::bn_stream(sys), dy.data(), x.data(), g,
                                           mean.data(), status, sums.data(), workspace.data());
}

/// dx and the parameter gradients in one launch (cuda_path::input_gradient_fused).
template <class T, class Acc>
void bn_input_gradient_fused(const cuda_system& sys, std::span<const T> dy, std::span<const T> x,
                             std::span<T> dx, kernels::channel_geometry g,
                             std::span<const Acc> totals, std::span<const Acc> local,
                             const double* count, std::span<const Acc> gamma,
                             std::span<const Acc> mean, std::span<const Acc> invstd,
                             std::span<Acc> dgamma, std::span<Acc> dbeta) {
    kernels::cuda_path::input_gradient_fused(
        detail::bn_stream(sys), dy.data(), x.data(), dx.data(), g, totals.data(), local.data(),
        count, gamma.data(), mean.data(), invstd.data(), dgamma.empty() ? nullptr : dgamma.data(),
        dbeta.empty() ? nullptr : dbeta.data());
}

} // namespace lockstep::gpu
#endif

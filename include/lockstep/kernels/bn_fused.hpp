// lockstep/kernels/bn_fused.hpp: the exchange formats and shared arithmetic of the fused batch-norm
// entry points (packed moments block, workspace, fused dx coefficients). SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/moments.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>

namespace lockstep::kernels {

/// The packed statistics block one replica contributes to the forward all_gather, for C
/// channels: {status, count_hi, count_lo, mean_0, m2_0, mean_1, m2_1, ...}. The count of
/// values per channel is count_hi * 2^24 + count_lo: both halves are integers below 2^24, so
/// each is exact in float and the count stays exact up to 2^48 whatever Acc is.
struct packed_moments {
    static constexpr std::size_t status = 0;   ///< index of the replica's status
    static constexpr std::size_t count_hi = 1; ///< index of count / 2^24
    static constexpr std::size_t count_lo = 2; ///< index of count % 2^24
    /// Index of channel c's mean; its M2 follows at mean(c) + 1.
    LOCKSTEP_HOST_DEVICE static constexpr std::size_t mean(std::size_t c) { return 3 + 2 * c; }
    /// Index of channel c's M2 (sum of squared deviations from its mean).
    LOCKSTEP_HOST_DEVICE static constexpr std::size_t m2(std::size_t c) { return 4 + 2 * c; }
    /// Values in the block of `channels` channels.
    LOCKSTEP_HOST_DEVICE static constexpr std::size_t size(std::size_t channels) {
        return 3 + 2 * channels;
    }

    /// The two halves of count. requires: count < 2^48.
    template <class Acc>
    LOCKSTEP_HOST_DEVICE static constexpr void split_count(std::uint64_t count, Acc& hi, Acc& lo) {
        hi = static_cast<Acc>(count >> 24);
        lo = static_cast<Acc>(count & 0xffffffu);
    }
    /// The count a block carries, exactly (in double, exact below 2^53).
    template <class Acc>
    LOCKSTEP_HOST_DEVICE static double count(const Acc* block) {
        return static_cast<double>(block[count_hi]) * 16777216.0 +
               static_cast<double>(block[count_lo]);
    }
};

/// The layout of backward_sums with a status slot: sums[c] = sum dy, sums[C + c] =
/// sum dy * (x - mean_c), sums[2 C] = status (the exchange format of the backward all_reduce).
struct packed_sums {
    /// Values in the block of `channels` channels.
    LOCKSTEP_HOST_DEVICE static constexpr std::size_t size(std::size_t channels) {
        return 2 * channels + 1;
    }
    /// Index of the status.
    LOCKSTEP_HOST_DEVICE static constexpr std::size_t status(std::size_t channels) {
        return 2 * channels;
    }
};

/// The per-channel coefficients of dx = input_gradient(dy, x, mean, k, a, b).
template <class Acc>
struct gradient_coefficients {
    Acc k; ///< gamma * invstd
    Acc a; ///< totals[c] / count
    Acc b; ///< invstd^2 * totals[C + c] / count
};

/// The factor 1 / count of every channel's dx coefficients (0 when count is 0), in Acc.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline Acc gradient_reciprocal(double count) {
    return count > 0.0 ? static_cast<Acc>(1.0 / count) : Acc(0);
}

/// Channel c's dx coefficients from the (replica-combined) sums `totals` (laid out as
/// packed_sums) and per = gradient_reciprocal<Acc>(count): k = gamma * invstd,
/// a = totals[c] / count, b = invstd^2 * totals[C + c] / count, and a = b = 0 when count is 0.
/// Every path (host, generic, CUDA) computes them here, so all produce the same bits.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline gradient_coefficients<Acc>
fused_gradient_coefficients_per(std::size_t c, std::size_t channels, const Acc* totals, Acc per,
                                const Acc* gamma, const Acc* invstd) {
    const Acc inv = invstd[c];
    return {gamma[c] * inv, totals[c] * per, inv * inv * totals[channels + c] * per};
}

/// fused_gradient_coefficients_per over `count` values (the reciprocal taken here).
template <class Acc>
LOCKSTEP_HOST_DEVICE inline gradient_coefficients<Acc>
fused_gradient_coefficients(std::size_t c, std::size_t channels, const Acc* totals, double count,
                            const Acc* gamma, const Acc* invstd) {
    return fused_gradient_coefficients_per(c, channels, totals, gradient_reciprocal<Acc>(count),
                                           gamma, invstd);
}

/// Channel c: dgamma[c] += local[C + c] * invstd[c], dbeta[c] += local[c] (this replica's
/// parameter gradients); a null pointer skips it.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline void add_parameter_gradients(std::size_t c, std::size_t channels,
                                                         const Acc* local, const Acc* invstd,
                                                         Acc* dgamma, Acc* dbeta) {
    if (dgamma != nullptr)
        dgamma[c] += local[channels + c] * invstd[c];
    if (dbeta != nullptr)
        dbeta[c] += local[c];
}

/// Task c of packing the forward block from per-channel moments (generic and host paths):
/// task c < C writes channel c and task 0 the header, so run it over max(C, 1) tasks.
template <class Acc>
struct pack_block_fn {
    const moments<Acc>* local;
    std::size_t channels;
    Acc status;
    Acc count_hi;
    Acc count_lo;
    Acc* block;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        if (c == 0) {
            block[packed_moments::status] = status;
            block[packed_moments::count_hi] = count_hi;
            block[packed_moments::count_lo] = count_lo;
        }
        if (c < channels) {
            block[packed_moments::mean(c)] = local[c].mean;
            block[packed_moments::m2(c)] = local[c].m2;
        }
    }
};

/// Value i of the generic fused dx: dx[i] = input_gradient with channel c's coefficients from
/// fused_gradient_coefficients (recomputed per value: the generic path has no scratch for them).
template <class T, class Acc>
struct fused_input_gradient_fn {
    const T* dy;
    const T* x;
    T* dx;
    channel_geometry g;
    const Acc* totals;
    const double* count;
    const Acc* gamma;
    const Acc* mean;
    const Acc* invstd;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        const std::size_t c = g.channel_of(i);
        const gradient_coefficients<Acc> co =
            fused_gradient_coefficients(c, g.channels, totals, *count, gamma, invstd);
        dx[i] = static_cast<T>(input_gradient(static_cast<Acc>(dy[i]), static_cast<Acc>(x[i]),
                                              mean[c], co.k, co.a, co.b));
    }
};

/// Channel c: add_parameter_gradients (generic path).
template <class Acc>
struct parameter_gradients_fn {
    std::size_t channels;
    const Acc* local;
    const Acc* invstd;
    Acc* dgamma;
    Acc* dbeta;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        add_parameter_gradients(c, channels, local, invstd, dgamma, dbeta);
    }
};

namespace detail {

/// Bytes at the start of a fused workspace reserved for the per-channel arrival counters of the
/// CUDA kernels (256-byte aligned, so the scratch after them is aligned for any Acc).
inline std::size_t counter_bytes(const channel_geometry& g) {
    return (g.channels * sizeof(unsigned) + 255) / 256 * 256;
}

/// The part of a fused workspace after the counters, as an array of U.
template <class U>
U* workspace_scratch(std::span<std::byte> workspace, const channel_geometry& g) {
    return reinterpret_cast<U*>(workspace.data() + counter_bytes(g));
}

/// How the CUDA reductions split the work for a value type of `value_bytes` bytes: per
/// (channel, partition) blocks over planes (inner > 1), or (channel tile, row partition)
/// blocks over rows (inner == 1). Depends on the geometry and the value size only, so the
/// workspace size and the rounding of the results do too. Every partition holds at most 2^22
/// values, so per-block counts stay exact in float.
inline std::size_t cuda_partitions(const channel_geometry& g, std::size_t value_bytes) {
    const std::size_t C = std::max<std::size_t>(g.channels, 1);
    const std::size_t exact = std::size_t(1) << 22;
    if (g.inner > 1) {
        // 32 KiB of input a block: eight 16-byte loads a thread (smaller partitions leave
        // threads idle; the channels x partitions blocks fill the device)
        const std::size_t target = 32768 / value_bytes;
        const std::size_t n = g.per_channel();
        const std::size_t p = std::clamp<std::size_t>((n + target - 1) / target, 1, 1024);
        return std::max(p, (n + exact - 1) / exact);
    }
    const std::size_t target = 16384 / value_bytes; // values per block: 16 KiB of input
    const std::size_t rows = g.outer;
    const std::size_t width = std::min<std::size_t>(C, 128); // channels a block covers, about
    const std::size_t tiles = (C + 127) / 128;
    std::size_t p = (rows * width + target - 1) / target;
    p = std::max(p, std::min((1024 + tiles - 1) / tiles, (rows + 31) / 32));
    p = std::clamp<std::size_t>(p, 1, 256);
    return std::min<std::size_t>(std::max(p, (rows + exact - 1) / exact), 65535);
}

/// Channels a tile of the CUDA reductions holds when planes of `inner` values are read in vectors
/// of v values (v a power of two): the fewest whose planes of one sample are whole vectors.
inline std::size_t tile_channels(std::size_t inner, std::size_t v) {
    return v / std::gcd(inner, v);
}

/// How the CUDA reductions' channel tiles (NCHW planes of no whole 16-byte vectors, read
/// tile_channels at a time, kernels/detail/bn_launch_plan.hpp) split the samples: about 32 KiB
/// of input a (tile, partition) block, at most 2^22 values of a channel a partition. Depends on
/// the geometry and the value size only.
inline std::size_t cuda_tile_partitions(const channel_geometry& g, std::size_t value_bytes) {
    const std::size_t exact = std::size_t(1) << 22;
    const std::size_t target = 32768 / value_bytes;
    const std::size_t n = g.per_channel();
    const std::size_t tile = tile_channels(std::max<std::size_t>(g.inner, 1), 16 / value_bytes);
    const std::size_t p = std::clamp<std::size_t>((tile * n + target - 1) / target, 1,
                                                  std::max<std::size_t>(g.outer, 1));
    return std::max(p, (n + exact - 1) / exact);
}

} // namespace detail

/// Bytes of workspace pack_local_moments and pack_backward_sums need for values of type T
/// (on any system; the same workspace serves both).
/// The workspace must be zero-filled before its first use; the kernels leave the counters at
/// its start zero again, so it is never cleared again (the calls are CUDA-graph safe).
template <class T, class Acc = accumulation_t<T>>
std::size_t bn_workspace_bytes(const channel_geometry& g) {
    const std::size_t C = g.channels;
    const std::size_t parts = generic_partitions(g);
    const std::size_t generic_moments = (C * parts + C) * sizeof(moments<Acc>);
    const std::size_t generic_sums = 2 * C * parts * sizeof(Acc);
    const std::size_t cuda_parts =
        std::max(detail::cuda_partitions(g, sizeof(T)),
                 g.inner > 1 ? detail::cuda_tile_partitions(g, sizeof(T)) : std::size_t{0});
    const std::size_t cuda = 2 * C * cuda_parts * sizeof(Acc);
    return detail::counter_bytes(g) + std::max({generic_moments, generic_sums, cuda});
}

} // namespace lockstep::kernels

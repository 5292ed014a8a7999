// lockstep/kernels/bn_pack.hpp: the batch-norm passes in the form a layer composes them: the
// local statistics packed for the exchange, the backward sums packed with a status, and dx with
// the coefficients computed from device-resident totals. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/bn_statistics.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

namespace lockstep::kernels {

/// Moments pack_local_moments needs as workspace for geometry g.
inline std::size_t pack_moments_workspace_size(const channel_geometry& g) {
    return g.channels + moments_workspace_size(g);
}

/// Writes this replica's statistics block (see stats_block) for x: per-channel moments and the
/// exact count g.per_channel(), with `status` in the header.
/// requires: x.size() == g.size(); block.size() >= stats_block::size(g.channels);
/// workspace.size() >= pack_moments_workspace_size(g); all in sys's memory.
template <class T, class Acc, class System>
void pack_local_moments(const System& sys, std::span<const T> x, channel_geometry g, Acc status,
                        std::span<Acc> block, std::span<moments<Acc>> workspace) {
    LOCKSTEP_REQUIRE(block.size() >= stats_block::size(g.channels) &&
                         workspace.size() >= pack_moments_workspace_size(g),
                     errc::shape_mismatch, -1, "kernels::pack_local_moments", "block has ",
                     block.size(), " values for ", stats_block::size(g.channels), ", workspace ",
                     workspace.size(), " for ", pack_moments_workspace_size(g));
    std::span<moments<Acc>> local = workspace.first(g.channels);
    channel_moments(sys, x, g, local, workspace.subspan(g.channels));
    detail::for_each_index(sys, g.channels,
                           pack_block_fn<Acc>{local.data(), status,
                                              static_cast<std::uint64_t>(g.per_channel()),
                                              block.data()});
}

/// Index i < 2C: the sums of an empty input are 0; index 2C: the status slot.
template <class Acc>
struct empty_sums_fn {
    Acc* sums;
    std::size_t channels;
    Acc status;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        sums[i] = i == 2 * channels ? status : Acc(0);
    }
};
/// The backward sums' status slot (one task).
template <class Acc>
struct set_status_fn {
    Acc* sums;
    std::size_t channels;
    Acc status;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const { sums[2 * channels] = status; }
};

/// sums[c] = sum dy, sums[C + c] = sum dy * (x - mean[c]) over channel c, sums[2C] = status.
/// requires: dy.size() == x.size() == g.size(); mean holds C values; sums.size() >= 2C + 1;
/// workspace.size() >= backward_workspace_size(g).
template <class T, class Acc, class System>
void pack_backward_sums(const System& sys, std::span<const T> dy, std::span<const T> x,
                        channel_geometry g, std::span<const Acc> mean, Acc status,
                        std::span<Acc> sums, std::span<Acc> workspace) {
    LOCKSTEP_REQUIRE(sums.size() >= 2 * g.channels + 1, errc::shape_mismatch, -1,
                     "kernels::pack_backward_sums", "sums has ", sums.size(), " values for ",
                     2 * g.channels + 1);
    if (g.size() == 0) {
        detail::for_each_index(sys, 2 * g.channels + 1,
                               empty_sums_fn<Acc>{sums.data(), g.channels, status});
        return;
    }
    backward_sums(sys, dy, x, g, mean, sums.first(2 * g.channels), workspace);
    detail::for_each_index(sys, 1, set_status_fn<Acc>{sums.data(), g.channels, status});
}

/// Channel c: the dx coefficients from device-resident totals over *count values, and
/// dgamma += local sum(dy * xhat), dbeta += local sum(dy) (as backward_coefficients_fn).
template <class Acc>
struct device_backward_coefficients_fn {
    const Acc* totals;
    const Acc* local;
    std::size_t channels;
    const double* count;
    const Acc* gamma;
    const Acc* invstd;
    Acc* k;
    Acc* a;
    Acc* b;
    Acc* dgamma;
    Acc* dbeta;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        backward_coefficients_fn<Acc>{totals, local,  channels, static_cast<Acc>(*count),
                                      gamma,  invstd, k,        a,
                                      b,      dgamma, dbeta}(c);
    }
};

/// dx = input_gradient(dy, x, mean, k, a, b) with k = gamma invstd, a = totals[c] / count,
/// b = invstd^2 totals[C + c] / count (count: a device scalar), and dgamma[c] +=
/// local[C + c] invstd[c], dbeta[c] += local[c] when they are non-null.
/// requires: dy, x, dx hold g.size() values; totals and local 2C; mean, invstd, gamma C;
/// scratch 3C values of sys's memory.
template <class T, class Acc, class System>
void input_gradient_fused(const System& sys, std::span<const T> dy, std::span<const T> x,
                          std::span<T> dx, channel_geometry g, const Acc* totals, const Acc* local,
                          const double* count, const Acc* gamma, const Acc* mean, const Acc* invstd,
                          Acc* dgamma, Acc* dbeta, std::span<Acc> scratch) {
    const std::size_t C = g.channels;
    LOCKSTEP_REQUIRE(scratch.size() >= 3 * C, errc::shape_mismatch, -1,
                     "kernels::input_gradient_fused", "scratch has ", scratch.size(),
                     " values for ", 3 * C);
    Acc* k = scratch.data();
    Acc* a = k + C;
    Acc* b = a + C;
    detail::for_each_index(sys, C,
                           device_backward_coefficients_fn<Acc>{totals, local, C, count, gamma,
                                                                invstd, k, a, b, dgamma, dbeta});
    if (g.size() != 0)
        input_gradient(sys, dy, x, dx, g, backward_coefficients<Acc>{mean, k, a, b});
}

} // namespace lockstep::kernels

// lockstep/kernels/bn_forward.hpp: batch-norm forward kernels: per-channel moments in one pass
// (Welford + Chan) and the normalization, on any system. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_host_loops.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>
#include <span>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/bn_cub.cuh"
#endif

namespace lockstep::kernels {

namespace detail {
/// Runs f(i) for i in [0, n) with the system's Thrust policy.
template <class System, class F>
void for_each_index(const System& sys, std::size_t n, F f) {
    if (n == 0)
        return;
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(n), f);
}
} // namespace detail

/// Moments the generic moments kernel needs as workspace for geometry g.
inline std::size_t moments_workspace_size(const channel_geometry& g) {
    return g.channels * generic_partitions(g);
}

/// Per-channel (count, mean, M2) of x on any system, through Thrust: Welford over
/// channels x partitions, then Chan's merge of each channel's partials in partition order.
/// requires: x.size() == g.size(); out.size() >= g.channels;
///           workspace.size() >= moments_workspace_size(g); all spans in sys's memory.
/// ensures: out[c] = moments of the g.per_channel() values of channel c.
template <class T, class Acc, class System>
void channel_moments_generic(const System& sys, std::span<const T> x, channel_geometry g,
                             std::span<moments<Acc>> out, std::span<moments<Acc>> workspace) {
    LOCKSTEP_REQUIRE(x.size() == g.size() && out.size() >= g.channels &&
                         workspace.size() >= moments_workspace_size(g),
                     errc::shape_mismatch, -1, "kernels::channel_moments", "x has ", x.size(),
                     " values for ", g.size(), ", out ", out.size(), " for ", g.channels,
                     " channels, workspace ", workspace.size(), " for ", moments_workspace_size(g));
    const std::size_t parts = generic_partitions(g);
    detail::for_each_index(sys, g.channels * parts,
                           partial_moments_fn<T, Acc>{x.data(), g, parts, workspace.data()});
    detail::for_each_index(sys, g.channels,
                           merge_partials_fn<Acc>{workspace.data(), parts, out.data()});
}

/// As channel_moments_generic, with the system's fast path: on a host system the vectorized
/// OpenMP loops (same functors, another partitioning, so results agree to rounding; the
/// workspace is unused), on the CUDA system a CUB block reduction per (channel, partition).
template <class T, class Acc, class System>
void channel_moments(const System& sys, std::span<const T> x, channel_geometry g,
                     std::span<moments<Acc>> out, std::span<moments<Acc>> workspace) {
    if constexpr (System::is_host) {
        LOCKSTEP_REQUIRE(x.size() == g.size() && out.size() >= g.channels, errc::shape_mismatch, -1,
                         "kernels::channel_moments", "x has ", x.size(), " values for ", g.size(),
                         ", out ", out.size(), " for ", g.channels, " channels");
        detail::host_channel_moments(sys.threads(), x.data(), g, out.data());
    } else {
#if LOCKSTEP_HAS_CUDA
        if constexpr (requires { sys.stream(); }) {
            LOCKSTEP_REQUIRE(x.size() == g.size() && out.size() >= g.channels &&
                                 workspace.size() >= moments_workspace_size(g),
                             errc::shape_mismatch, -1, "kernels::channel_moments", "x has ",
                             x.size(), " values for ", g.size(), ", out ", out.size(), " for ",
                             g.channels, " channels, workspace ", workspace.size(), " for ",
                             moments_workspace_size(g));
            cub_path::channel_moments(sys, x, g, out, workspace);
            return;
        }
#endif
        channel_moments_generic(sys, x, g, out, workspace);
    }
}

/// y = (x - mean[c]) * scale[c] + beta[c] for every value of channel c (generic Thrust path).
/// requires: x.size() == y.size() == g.size(); mean, scale, beta hold g.channels values.
/// x and y must not overlap.
template <class T, class Acc, class System>
void normalize_generic(const System& sys, std::span<const T> x, std::span<T> y, channel_geometry g,
                       std::span<const Acc> mean, std::span<const Acc> scale,
                       std::span<const Acc> beta) {
    LOCKSTEP_REQUIRE(x.size() == g.size() && y.size() == g.size() && mean.size() >= g.channels &&
                         scale.size() >= g.channels && beta.size() >= g.channels,
                     errc::shape_mismatch, -1, "kernels::normalize", "x has ", x.size(),
                     " values, y ", y.size(), ", expected ", g.size());
    detail::for_each_index(
        sys, g.size(),
        normalize_fn<T, Acc>{x.data(), y.data(), g, mean.data(), scale.data(), beta.data()});
}

/// As normalize_generic; the host system runs the vectorized OpenMP loops.
template <class T, class Acc, class System>
void normalize(const System& sys, std::span<const T> x, std::span<T> y, channel_geometry g,
               std::span<const Acc> mean, std::span<const Acc> scale, std::span<const Acc> beta) {
    if constexpr (System::is_host) {
        LOCKSTEP_REQUIRE(x.size() == g.size() && y.size() == g.size() &&
                             mean.size() >= g.channels && scale.size() >= g.channels &&
                             beta.size() >= g.channels,
                         errc::shape_mismatch, -1, "kernels::normalize", "x has ", x.size(),
                         " values, y ", y.size(), ", expected ", g.size());
        detail::host_normalize(sys.threads(), x.data(), y.data(), g, mean.data(), scale.data(),
                               beta.data());
    } else {
        normalize_generic(sys, x, y, g, mean, scale, beta);
    }
}

} // namespace lockstep::kernels

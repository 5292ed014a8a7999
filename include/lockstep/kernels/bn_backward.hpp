// lockstep/kernels/bn_backward.hpp: batch-norm backward kernels: per-channel sums of dy and
// dy * (x - mean) in one pass, and the elementwise dx. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_host_loops.hpp"

#include <cstddef>
#include <span>

namespace lockstep::kernels {

/// Accumulators the generic backward-sums kernel needs as workspace for geometry g.
inline std::size_t backward_workspace_size(const channel_geometry& g) {
    return 2 * g.channels * generic_partitions(g);
}

/// sums[c] = sum of dy over channel c, sums[C + c] = sum of dy * (x - mean[c]) (generic Thrust
/// path: channels x partitions, partials added in partition order).
/// requires: dy.size() == x.size() == g.size(); mean holds g.channels values;
///           sums.size() >= 2 * g.channels; workspace.size() >= backward_workspace_size(g).
template <class T, class Acc, class System>
void backward_sums_generic(const System& sys, std::span<const T> dy, std::span<const T> x,
                           channel_geometry g, std::span<const Acc> mean, std::span<Acc> sums,
                           std::span<Acc> workspace) {
    LOCKSTEP_REQUIRE(dy.size() == g.size() && x.size() == g.size() && mean.size() >= g.channels &&
                         sums.size() >= 2 * g.channels &&
                         workspace.size() >= backward_workspace_size(g),
                     errc::shape_mismatch, -1, "kernels::backward_sums", "dy has ", dy.size(),
                     " values, x ", x.size(), ", expected ", g.size());
    const std::size_t parts = generic_partitions(g);
    detail::for_each_index(
        sys, g.channels * parts,
        partial_backward_fn<T, Acc>{dy.data(), x.data(), g, parts, mean.data(), workspace.data()});
    detail::for_each_index(
        sys, g.channels, merge_backward_fn<Acc>{workspace.data(), parts, g.channels, sums.data()});
}

/// As backward_sums_generic, with the system's fast path (host: vectorized OpenMP loops; CUDA:
/// a CUB block reduction per (channel, partition)).
template <class T, class Acc, class System>
void backward_sums(const System& sys, std::span<const T> dy, std::span<const T> x,
                   channel_geometry g, std::span<const Acc> mean, std::span<Acc> sums,
                   std::span<Acc> workspace) {
    if constexpr (System::is_host) {
        LOCKSTEP_REQUIRE(dy.size() == g.size() && x.size() == g.size() &&
                             mean.size() >= g.channels && sums.size() >= 2 * g.channels,
                         errc::shape_mismatch, -1, "kernels::backward_sums", "dy has ", dy.size(),
                         " values, x ", x.size(), ", expected ", g.size());
        detail::host_backward_sums(sys.threads(), dy.data(), x.data(), g, mean.data(), sums.data());
    } else {
#if LOCKSTEP_HAS_CUDA
        if constexpr (requires { sys.stream(); }) {
            LOCKSTEP_REQUIRE(dy.size() == g.size() && x.size() == g.size() &&
                                 mean.size() >= g.channels && sums.size() >= 2 * g.channels &&
                                 workspace.size() >= backward_workspace_size(g),
                             errc::shape_mismatch, -1, "kernels::backward_sums", "dy has ",
                             dy.size(), " values, x ", x.size(), ", expected ", g.size());
            cub_path::backward_sums(sys, dy, x, g, mean, sums, workspace);
            return;
        }
#endif
        backward_sums_generic(sys, dy, x, g, mean, sums, workspace);
    }
}

/// dx = k[c] * (dy - a[c] - (x - mean[c]) * b[c]) for every value (generic Thrust path).
/// requires: dy, x, dx hold g.size() values; the coefficients g.channels each; dx
/// overlaps neither dy nor x.
template <class T, class Acc, class System>
void input_gradient_generic(const System& sys, std::span<const T> dy, std::span<const T> x,
                            std::span<T> dx, channel_geometry g, backward_coefficients<Acc> co) {
    LOCKSTEP_REQUIRE(dy.size() == g.size() && x.size() == g.size() && dx.size() == g.size(),
                     errc::shape_mismatch, -1, "kernels::input_gradient", "dy has ", dy.size(),
                     " values, x ", x.size(), ", dx ", dx.size(), ", expected ", g.size());
    detail::for_each_index(sys, g.size(),
                           input_gradient_fn<T, Acc>{dy.data(), x.data(), dx.data(), g, co});
}

/// As input_gradient_generic; the host system runs the vectorized OpenMP loops.
template <class T, class Acc, class System>
void input_gradient(const System& sys, std::span<const T> dy, std::span<const T> x, std::span<T> dx,
                    channel_geometry g, backward_coefficients<Acc> co) {
    if constexpr (System::is_host) {
        LOCKSTEP_REQUIRE(dy.size() == g.size() && x.size() == g.size() && dx.size() == g.size(),
                         errc::shape_mismatch, -1, "kernels::input_gradient", "dy has ", dy.size(),
                         " values, x ", x.size(), ", dx ", dx.size(), ", expected ", g.size());
        detail::host_input_gradient(sys.threads(), dy.data(), x.data(), dx.data(), g, co);
    } else {
        input_gradient_generic(sys, dy, x, dx, g, co);
    }
}

} // namespace lockstep::kernels

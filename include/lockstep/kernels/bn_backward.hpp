// lockstep/kernels/bn_backward.hpp: batch-norm backward kernels: per-channel sums of dy and
// dy * (x - mean) in one pass, and the elementwise dx. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_host_path.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/system/system.hpp"

#include <cstddef>
#include <span>

namespace lockstep::kernels {

/// Accumulators the generic backward-sums kernel needs as workspace for geometry g.
inline std::size_t backward_workspace_size(const channel_geometry& g) {
    return 2 * g.channels * generic_partitions(g);
}

namespace detail {
/// Writes the status slot of a packed_sums block.
template <class Acc>
struct write_status_fn {
    Acc* sums;
    std::size_t channels;
    Acc status;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        sums[packed_sums::status(channels)] = status;
    }
};

template <class Acc>
Acc* data_or_null(std::span<Acc> s) {
    return s.empty() ? nullptr : s.data();
}
} // namespace detail

// The generic versions of the backward operations (see bn_forward.hpp for how the public
// kernels choose between them and a system's own overloads).

/// Generic backward sums: channels x partitions into the workspace, partials added in
/// partition order.
template <class T, class Acc, execution_system System>
void bn_backward_sums(const System& sys, std::span<const T> dy, std::span<const T> x,
                      channel_geometry g, std::span<const Acc> mean, std::span<Acc> sums,
                      std::span<Acc> workspace) {
    const std::size_t parts = generic_partitions(g);
    kernels::for_each_index(
        sys, g.channels * parts,
        partial_backward_fn<T, Acc>{dy.data(), x.data(), g, parts, mean.data(), workspace.data()});
    kernels::for_each_index(
        sys, g.channels, merge_backward_fn<Acc>{workspace.data(), parts, g.channels, sums.data()});
}

/// Generic packed backward sums: bn_backward_sums' passes into the workspace's scratch, then
/// the status slot.
template <class T, class Acc, execution_system System>
void bn_pack_backward_sums(const System& sys, std::span<const T> dy, std::span<const T> x,
                           channel_geometry g, std::span<const Acc> mean, Acc status,
                           std::span<Acc> sums, std::span<std::byte> workspace) {
    const std::size_t parts = generic_partitions(g);
    Acc* partials = detail::workspace_scratch<Acc>(workspace, g);
    kernels::for_each_index(
        sys, g.channels * parts,
        partial_backward_fn<T, Acc>{dy.data(), x.data(), g, parts, mean.data(), partials});
    kernels::for_each_index(sys, g.channels,
                            merge_backward_fn<Acc>{partials, parts, g.channels, sums.data()});
    kernels::for_each_index(sys, 1, detail::write_status_fn<Acc>{sums.data(), g.channels, status});
}

/// Generic input gradient: one task per value.
template <class T, class Acc, execution_system System>
void bn_input_gradient(const System& sys, std::span<const T> dy, std::span<const T> x,
                       std::span<T> dx, channel_geometry g, backward_coefficients<Acc> co) {
    kernels::for_each_index(sys, g.size(),
                            input_gradient_fn<T, Acc>{dy.data(), x.data(), dx.data(), g, co});
}

/// Generic fused input gradient: one task per value (coefficients recomputed per value), then
/// one per channel for the parameter gradients when either is wanted.
template <class T, class Acc, execution_system System>
void bn_input_gradient_fused(const System& sys, std::span<const T> dy, std::span<const T> x,
                             std::span<T> dx, channel_geometry g, std::span<const Acc> totals,
                             std::span<const Acc> local, const double* count,
                             std::span<const Acc> gamma, std::span<const Acc> mean,
                             std::span<const Acc> invstd, std::span<Acc> dgamma,
                             std::span<Acc> dbeta) {
    kernels::for_each_index(sys, g.size(),
                            fused_input_gradient_fn<T, Acc>{dy.data(), x.data(), dx.data(), g,
                                                            totals.data(), count, gamma.data(),
                                                            mean.data(), invstd.data()});
    if (!dgamma.empty() || !dbeta.empty())
        kernels::for_each_index(sys, g.channels,
                                parameter_gradients_fn<Acc>{g.channels, local.data(), invstd.data(),
                                                            detail::data_or_null(dgamma),
                                                            detail::data_or_null(dbeta)});
}

namespace detail {
template <class T, class Acc>
void require_backward_sums(std::span<const T> dy, std::span<const T> x, const channel_geometry& g,
                           std::span<const Acc> mean, std::span<Acc> sums,
                           std::span<Acc> workspace) {
    const std::size_t n = checked_size(g, "kernels::backward_sums");
    LOCKSTEP_REQUIRE(dy.size() == n && x.size() == n && mean.size() >= g.channels &&
                         sums.size() >= 2 * g.channels &&
                         workspace.size() >= backward_workspace_size(g),
                     errc::shape_mismatch, -1, "kernels::backward_sums", "dy has ", dy.size(),
                     " values, x ", x.size(), ", expected ", n);
}

template <class T, class Acc>
void require_pack_sums(std::span<const T> dy, std::span<const T> x, const channel_geometry& g,
                       std::span<const Acc> mean, std::span<Acc> sums,
                       std::span<std::byte> workspace) {
    const std::size_t n = checked_size(g, "kernels::pack_backward_sums");
    const std::size_t need = bn_workspace_bytes<T, Acc>(g);
    LOCKSTEP_REQUIRE(dy.size() == n && x.size() == n && mean.size() >= g.channels &&
                         sums.size() >= packed_sums::size(g.channels) && workspace.size() >= need,
                     errc::shape_mismatch, -1, "kernels::pack_backward_sums", "dy has ", dy.size(),
                     " values, x ", x.size(), ", expected ", n, "; sums ", sums.size(), " for ",
                     packed_sums::size(g.channels), ", workspace ", workspace.size(), " bytes for ",
                     need);
}

// What is wrong when dx shares memory with dy or x (the kernels read them through restrict
// pointers), or "": the fix names dx, the output (x is the forward's input, kept for backward).
template <class T>
std::string gradient_overlap(std::span<const T> dy, std::span<const T> x, std::span<T> dx) {
    std::string p = lockstep::detail::overlap_problem(dy, "dy", dx, "dx");
    return p.empty() ? lockstep::detail::overlap_problem(x, "x", dx, "dx") : p;
}

template <class T>
void require_input_gradient(std::span<const T> dy, std::span<const T> x, std::span<T> dx,
                            const channel_geometry& g) {
    const std::size_t n = checked_size(g, "kernels::input_gradient");
    LOCKSTEP_REQUIRE(dy.size() == n && x.size() == n && dx.size() == n, errc::shape_mismatch, -1,
                     "kernels::input_gradient", "dy has ", dy.size(), " values, x ", x.size(),
                     ", dx ", dx.size(), ", expected ", n);
    const std::string overlap = gradient_overlap(dy, x, dx);
    LOCKSTEP_REQUIRE(overlap.empty(), errc::invalid_argument, -1, "kernels::input_gradient",
                     overlap);
}

template <class T, class Acc>
void require_fused_gradient(std::span<const T> dy, std::span<const T> x, std::span<T> dx,
                            const channel_geometry& g, std::span<const Acc> totals,
                            std::span<const Acc> local, const double* count,
                            std::span<const Acc> gamma, std::span<const Acc> mean,
                            std::span<const Acc> invstd, std::span<Acc> dgamma,
                            std::span<Acc> dbeta) {
    const std::size_t n = checked_size(g, "kernels::input_gradient_fused");
    const std::size_t C = g.channels;
    LOCKSTEP_REQUIRE(dy.size() == n && x.size() == n && dx.size() == n, errc::shape_mismatch, -1,
                     "kernels::input_gradient_fused", "dy has ", dy.size(), " values, x ", x.size(),
                     ", dx ", dx.size(), ", expected ", n);
    const std::string overlap = gradient_overlap(dy, x, dx);
    LOCKSTEP_REQUIRE(overlap.empty(), errc::invalid_argument, -1, "kernels::input_gradient_fused",
                     overlap);
    LOCKSTEP_REQUIRE(totals.size() >= 2 * C && local.size() >= 2 * C && count != nullptr &&
                         gamma.size() >= C && mean.size() >= C && invstd.size() >= C &&
                         (dgamma.empty() || dgamma.size() >= C) &&
                         (dbeta.empty() || dbeta.size() >= C),
                     errc::shape_mismatch, -1, "kernels::input_gradient_fused", "totals has ",
                     totals.size(), " values, local ", local.size(), ", gamma ", gamma.size(),
                     ", mean ", mean.size(), ", invstd ", invstd.size(), ", dgamma ", dgamma.size(),
                     ", dbeta ", dbeta.size(), " for ", C, " channels");
}
} // namespace detail

/// sums[c] = sum of dy over channel c, sums[C + c] = sum of dy * (x - mean[c]) (generic Thrust
/// path: channels x partitions, partials added in partition order).
/// requires: dy.size() == x.size() == g.size(); mean holds g.channels values;
///           sums.size() >= 2 * g.channels; workspace.size() >= backward_workspace_size(g).
template <class T, class Acc, execution_system System>
void backward_sums_generic(const System& sys, std::span<const T> dy, std::span<const T> x,
                           channel_geometry g, std::span<const Acc> mean, std::span<Acc> sums,
                           std::span<Acc> workspace) {
    detail::require_backward_sums(dy, x, g, mean, sums, workspace);
    kernels::bn_backward_sums(sys, dy, x, g, mean, sums, workspace);
}

/// As backward_sums_generic, with the system's bn_backward_sums: the vectorized OpenMP loops on
/// a host system (the workspace is unused there); systems without one run the generic path
/// (the CUDA fast path is pack_backward_sums).
template <class T, class Acc, execution_system System>
void backward_sums(const System& sys, std::span<const T> dy, std::span<const T> x,
                   channel_geometry g, std::span<const Acc> mean, std::span<Acc> sums,
                   std::span<Acc> workspace) {
    detail::require_backward_sums(dy, x, g, mean, sums, workspace);
    bn_backward_sums(sys, dy, x, g, mean, sums, workspace);
}

/// This replica's backward sums with a status slot (packed_sums: sums[c] = sum dy,
/// sums[C + c] = sum dy * (x - mean[c]), sums[2 C] = status), the exchange format of the
/// backward all_reduce, through the generic Thrust path.
/// requires: dy.size() == x.size() == g.size(); mean holds g.channels values;
///           sums.size() >= packed_sums::size(g.channels);
///           workspace.size() >= bn_workspace_bytes<T, Acc>(g).
template <class T, class Acc, execution_system System>
void pack_backward_sums_generic(const System& sys, std::span<const T> dy, std::span<const T> x,
                                channel_geometry g, std::span<const Acc> mean, Acc status,
                                std::span<Acc> sums, std::span<std::byte> workspace) {
    detail::require_pack_sums(dy, x, g, mean, sums, workspace);
    kernels::bn_pack_backward_sums(sys, dy, x, g, mean, status, sums, workspace);
}

/// As pack_backward_sums_generic with the system's bn_pack_backward_sums: the host loops of
/// backward_sums on a host system, one deterministic kernel launch on the CUDA system
/// (cuda_path::pack_backward_sums). The workspace is shared with pack_local_moments (same
/// size, zero-filled before its first use).
template <class T, class Acc, execution_system System>
void pack_backward_sums(const System& sys, std::span<const T> dy, std::span<const T> x,
                        channel_geometry g, std::span<const Acc> mean, Acc status,
                        std::span<Acc> sums, std::span<std::byte> workspace) {
    detail::require_pack_sums(dy, x, g, mean, sums, workspace);
    bn_pack_backward_sums(sys, dy, x, g, mean, status, sums, workspace);
}

/// dx = k[c] * (dy - a[c] - (x - mean[c]) * b[c]) for every value (generic Thrust path).
/// requires: dy, x, dx hold g.size() values; the coefficients g.channels each; dx
/// overlaps neither dy nor x.
template <class T, class Acc, execution_system System>
void input_gradient_generic(const System& sys, std::span<const T> dy, std::span<const T> x,
                            std::span<T> dx, channel_geometry g, backward_coefficients<Acc> co) {
    detail::require_input_gradient(dy, x, dx, g);
    kernels::bn_input_gradient(sys, dy, x, dx, g, co);
}

/// As input_gradient_generic with the system's bn_input_gradient: the host system runs the
/// vectorized OpenMP loops.
template <class T, class Acc, execution_system System>
void input_gradient(const System& sys, std::span<const T> dy, std::span<const T> x, std::span<T> dx,
                    channel_geometry g, const backward_coefficients<Acc>& co) {
    detail::require_input_gradient(dy, x, dx, g);
    bn_input_gradient(sys, dy, x, dx, g, co);
}

/// dx with the coefficients of fused_gradient_coefficients (k = gamma * invstd,
/// a = totals[c] / *count, b = invstd^2 * totals[C + c] / *count; a = b = 0 when *count is 0)
/// and dgamma[c] += local[C + c] * invstd[c], dbeta[c] += local[c] (skipped for an empty
/// span), through the generic Thrust path (coefficients recomputed per value).
/// requires: dy, x, dx hold g.size() values, dx overlaps neither; totals and local hold at
///           least 2 g.channels values (packed_sums layout: local is this replica's
///           pack_backward_sums, totals their sum over the replicas the statistics came from);
///           count points to one double in sys's memory, the number of values the statistics
///           were taken over; gamma, mean, invstd and non-empty dgamma/dbeta hold g.channels.
template <class T, class Acc, execution_system System>
void input_gradient_fused_generic(const System& sys, std::span<const T> dy, std::span<const T> x,
                                  std::span<T> dx, channel_geometry g, std::span<const Acc> totals,
                                  std::span<const Acc> local, const double* count,
                                  std::span<const Acc> gamma, std::span<const Acc> mean,
                                  std::span<const Acc> invstd, std::span<Acc> dgamma,
                                  std::span<Acc> dbeta) {
    detail::require_fused_gradient(dy, x, dx, g, totals, local, count, gamma, mean, invstd, dgamma,
                                   dbeta);
    kernels::bn_input_gradient_fused(sys, dy, x, dx, g, totals, local, count, gamma, mean, invstd,
                                     dgamma, dbeta);
}

/// As input_gradient_fused_generic with the system's bn_input_gradient_fused: on a host system
/// the coefficients per channel, then the vectorized dx loops; on the CUDA system one launch
/// (cuda_path::input_gradient_fused). Every path computes the coefficients with
/// fused_gradient_coefficients (the same bits on all of them) and each value with
/// input_gradient; dx has the same bits on the host and generic paths of a host system, and on
/// CUDA equals them within one rounding of Acc (nvcc contracts the value's multiply and add
/// into one fused multiply-add; docs/gpu_batch_norm.md).
template <class T, class Acc, execution_system System>
void input_gradient_fused(const System& sys, std::span<const T> dy, std::span<const T> x,
                          std::span<T> dx, channel_geometry g, std::span<const Acc> totals,
                          std::span<const Acc> local, const double* count,
                          std::span<const Acc> gamma, std::span<const Acc> mean,
                          std::span<const Acc> invstd, std::span<Acc> dgamma,
                          std::span<Acc> dbeta) {
    detail::require_fused_gradient(dy, x, dx, g, totals, local, count, gamma, mean, invstd, dgamma,
                                   dbeta);
    bn_input_gradient_fused(sys, dy, x, dx, g, totals, local, count, gamma, mean, invstd, dgamma,
                            dbeta);
}

} // namespace lockstep::kernels

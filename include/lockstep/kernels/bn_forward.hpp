// lockstep/kernels/bn_forward.hpp: batch-norm forward kernels: per-channel moments in one pass
// (Welford + Chan) and the normalization, on any system. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_host_path.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/system/system.hpp"

#include <algorithm>
#include <cstddef>
#include <span>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

// The CUDA system's overloads of the bn_* operations (found by argument-dependent lookup).
#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/bn_cuda.cuh"
#endif

namespace lockstep::kernels {

/// Moments the generic moments kernel needs as workspace for geometry g.
inline std::size_t moments_workspace_size(const channel_geometry& g) {
    return g.channels * generic_partitions(g);
}

// The batch-norm operations each system may provide. Every public kernel below checks its
// preconditions once and then calls bn_<kernel>(sys, ...) unqualified: ordinary lookup finds
// the generic Thrust version here, argument-dependent lookup adds the overloads on const S& in
// the system type's namespace (host_system: kernels/detail/bn_host_path.hpp; cuda_system:
// kernels/bn_cuda.cuh), and overload resolution takes the exact system type over the generic
// one. The generic versions run on any execution_system: channels x generic_partitions(g)
// tasks, partials merged in partition order, so their results depend on the geometry only.

/// Generic per-channel moments: Welford over channels x partitions into the workspace, then
/// Chan's merge of each channel's partials in partition order.
template <class T, class Acc, execution_system System>
void bn_channel_moments(const System& sys, std::span<const T> x, channel_geometry g,
                        std::span<moments<Acc>> out, std::span<moments<Acc>> workspace) {
    const std::size_t parts = generic_partitions(g);
    kernels::for_each_index(sys, g.channels * parts,
                            partial_moments_fn<T, Acc>{x.data(), g, parts, workspace.data()});
    kernels::for_each_index(sys, g.channels,
                            merge_partials_fn<Acc>{workspace.data(), parts, out.data()});
}

/// Generic packed statistics block: bn_channel_moments' passes into the workspace's scratch,
/// then packing.
template <class T, class Acc, execution_system System>
void bn_pack_local_moments(const System& sys, std::span<const T> x, channel_geometry g, Acc status,
                           std::span<Acc> block, std::span<std::byte> workspace) {
    moments<Acc>* local = detail::workspace_scratch<moments<Acc>>(workspace, g);
    const std::size_t parts = generic_partitions(g);
    kernels::for_each_index(sys, g.channels * parts,
                            partial_moments_fn<T, Acc>{x.data(), g, parts, local + g.channels});
    kernels::for_each_index(sys, g.channels,
                            merge_partials_fn<Acc>{local + g.channels, parts, local});
    pack_block_fn<Acc> pack{local, g.channels, status, 0, 0, block.data()};
    packed_moments::split_count(g.per_channel(), pack.count_hi, pack.count_lo);
    kernels::for_each_index(sys, std::max<std::size_t>(g.channels, 1), pack);
}

/// Generic normalization: one task per value.
template <class T, class Acc, execution_system System>
void bn_normalize(const System& sys, std::span<const T> x, std::span<T> y, channel_geometry g,
                  std::span<const Acc> mean, std::span<const Acc> scale,
                  std::span<const Acc> beta) {
    kernels::for_each_index(
        sys, g.size(),
        normalize_fn<T, Acc>{x.data(), y.data(), g, mean.data(), scale.data(), beta.data()});
}

/// Generic finish and normalization: fin(c) for every channel (writing fin.mean and fin.scale),
/// then bn_normalize with them (the system's, so the host system runs its vectorized loops).
template <class T, class Acc, execution_system System, class Finish>
void bn_finish_normalize(const System& sys, const Finish& fin, std::span<const T> x, std::span<T> y,
                         channel_geometry g, std::span<const Acc> beta) {
    kernels::for_each_index(sys, g.channels, fin, fin.elements(g.channels));
    bn_normalize(sys, x, y, g, std::span<const Acc>(fin.mean, g.channels),
                 std::span<const Acc>(fin.scale, g.channels), beta);
}

namespace detail {
template <class T, class Acc>
void require_channel_moments(std::span<const T> x, const channel_geometry& g,
                             std::span<moments<Acc>> out, std::span<moments<Acc>> workspace) {
    const std::size_t n = checked_size(g, "kernels::channel_moments");
    LOCKSTEP_REQUIRE(x.size() == n && out.size() >= g.channels &&
                         workspace.size() >= moments_workspace_size(g),
                     errc::shape_mismatch, -1, "kernels::channel_moments", "x has ", x.size(),
                     " values for ", n, ", out ", out.size(), " for ", g.channels,
                     " channels, workspace ", workspace.size(), " for ", moments_workspace_size(g));
}

template <class T, class Acc>
void require_pack_moments(std::span<const T> x, const channel_geometry& g, std::span<Acc> block,
                          std::span<std::byte> workspace) {
    const std::size_t n = checked_size(g, "kernels::pack_local_moments");
    const std::size_t need = bn_workspace_bytes<T, Acc>(g);
    LOCKSTEP_REQUIRE(x.size() == n && block.size() >= packed_moments::size(g.channels) &&
                         workspace.size() >= need,
                     errc::shape_mismatch, -1, "kernels::pack_local_moments", "x has ", x.size(),
                     " values for ", n, ", block ", block.size(), " for ",
                     packed_moments::size(g.channels), ", workspace ", workspace.size(),
                     " bytes for ", need);
}

template <class T, class Acc>
void require_normalize(std::span<const T> x, std::span<T> y, const channel_geometry& g,
                       std::span<const Acc> mean, std::span<const Acc> scale,
                       std::span<const Acc> beta) {
    const std::size_t n = checked_size(g, "kernels::normalize");
    LOCKSTEP_REQUIRE(x.size() == n && y.size() == n && mean.size() >= g.channels &&
                         scale.size() >= g.channels && beta.size() >= g.channels,
                     errc::shape_mismatch, -1, "kernels::normalize", "x has ", x.size(),
                     " values, y ", y.size(), ", expected ", n);
    const std::string overlap = lockstep::detail::overlap_problem(x, "x", y, "y");
    LOCKSTEP_REQUIRE(overlap.empty(), errc::invalid_argument, -1, "kernels::normalize", overlap);
}
} // namespace detail

/// Per-channel (count, mean, M2) of x on any system, through Thrust: Welford over
/// channels x partitions, then Chan's merge of each channel's partials in partition order.
/// requires: x.size() == g.size(); out.size() >= g.channels;
///           workspace.size() >= moments_workspace_size(g); all spans in sys's memory.
/// ensures: out[c] = moments of the g.per_channel() values of channel c.
template <class T, class Acc, execution_system System>
void channel_moments_generic(const System& sys, std::span<const T> x, channel_geometry g,
                             std::span<moments<Acc>> out, std::span<moments<Acc>> workspace) {
    detail::require_channel_moments(x, g, out, workspace);
    kernels::bn_channel_moments(sys, x, g, out, workspace);
}

/// As channel_moments_generic, with the system's bn_channel_moments: on a host system the
/// vectorized OpenMP loops (same functors, another partitioning, so results agree to rounding;
/// the workspace is unused). Systems without one run the generic path (the CUDA fast path is
/// pack_local_moments).
template <class T, class Acc, execution_system System>
void channel_moments(const System& sys, std::span<const T> x, channel_geometry g,
                     std::span<moments<Acc>> out, std::span<moments<Acc>> workspace) {
    detail::require_channel_moments(x, g, out, workspace);
    bn_channel_moments(sys, x, g, out, workspace);
}

/// This replica's packed statistics block (the forward all_gather's exchange format, see
/// packed_moments) through the generic Thrust path: channel_moments_generic, then packing.
/// requires: x.size() == g.size(); block.size() >= packed_moments::size(g.channels);
///           workspace.size() >= bn_workspace_bytes<T, Acc>(g); all in sys's memory.
/// ensures: block = {status, count_hi, count_lo, (mean_c, m2_c)...} with count_hi * 2^24 +
///          count_lo == g.per_channel() exactly.
template <class T, class Acc, execution_system System>
void pack_local_moments_generic(const System& sys, std::span<const T> x, channel_geometry g,
                                Acc status, std::span<Acc> block, std::span<std::byte> workspace) {
    detail::require_pack_moments(x, g, block, workspace);
    kernels::bn_pack_local_moments(sys, x, g, status, block, workspace);
}

/// As pack_local_moments_generic with the system's bn_pack_local_moments: the host loops of
/// channel_moments on a host system, one kernel launch on the CUDA system
/// (cuda_path::pack_local_moments: asynchronous on the stream, graph-capturable).
/// The workspace must be zero-filled before its first use (the CUDA kernel's arrival counters
/// live at its start and are left zero); one workspace serves pack_backward_sums too.
template <class T, class Acc, execution_system System>
void pack_local_moments(const System& sys, std::span<const T> x, channel_geometry g, Acc status,
                        std::span<Acc> block, std::span<std::byte> workspace) {
    detail::require_pack_moments(x, g, block, workspace);
    bn_pack_local_moments(sys, x, g, status, block, workspace);
}

/// y = (x - mean[c]) * scale[c] + beta[c] for every value of channel c (generic Thrust path).
/// requires: x.size() == y.size() == g.size(); mean, scale, beta hold g.channels values.
/// x and y must not overlap (refused with errc::invalid_argument).
template <class T, class Acc, execution_system System>
void normalize_generic(const System& sys, std::span<const T> x, std::span<T> y, channel_geometry g,
                       std::span<const Acc> mean, std::span<const Acc> scale,
                       std::span<const Acc> beta) {
    detail::require_normalize(x, y, g, mean, scale, beta);
    kernels::bn_normalize(sys, x, y, g, mean, scale, beta);
}

/// As normalize_generic with the system's bn_normalize: the host system runs the vectorized
/// OpenMP loops, the CUDA system cuda_path::normalize (vectorized, one launch).
template <class T, class Acc, execution_system System>
void normalize(const System& sys, std::span<const T> x, std::span<T> y, channel_geometry g,
               std::span<const Acc> mean, std::span<const Acc> scale, std::span<const Acc> beta) {
    detail::require_normalize(x, y, g, mean, scale, beta);
    bn_normalize(sys, x, y, g, mean, scale, beta);
}

/// The coefficients of every channel finished by `fin` (finish_statistics_fn after the forward's
/// exchange, eval_coefficients_fn for inference: fin(c) writes channel c's fin.mean[c],
/// fin.scale[c] and what else it keeps), then y normalized with them. The CUDA system does both
/// in one launch (cuda_path::finish_and_normalize: the blocks compute the coefficients of the
/// channels they touch with fin.coefficients, the arithmetic of fin(c), while one thread per
/// channel runs fin(c)); other systems run the two passes.
/// requires: x.size() == y.size() == g.size() (g.size() may be 0: fin still runs for every
///           channel); beta holds g.channels values; fin's arrays hold g.channels values and do
///           not overlap x, y or beta.
template <class T, class Acc, execution_system System, class Finish>
void finish_and_normalize(const System& sys, const Finish& fin, std::span<const T> x,
                          std::span<T> y, channel_geometry g, std::span<const Acc> beta) {
    const std::size_t n = checked_size(g, "kernels::finish_and_normalize");
    LOCKSTEP_REQUIRE(x.size() == n && y.size() == n && beta.size() >= g.channels,
                     errc::shape_mismatch, -1, "kernels::finish_and_normalize", "x has ", x.size(),
                     " values, y ", y.size(), ", expected ", n, "; beta ", beta.size(), " for ",
                     g.channels, " channels");
    const std::string overlap = lockstep::detail::overlap_problem(x, "x", y, "y");
    LOCKSTEP_REQUIRE(overlap.empty(), errc::invalid_argument, -1, "kernels::finish_and_normalize",
                     overlap);
    bn_finish_normalize(sys, fin, x, y, g, beta);
}

} // namespace lockstep::kernels

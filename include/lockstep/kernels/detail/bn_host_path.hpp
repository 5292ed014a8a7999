// lockstep/kernels/detail/bn_host_path.hpp: host_system's batch-norm operations, overloads on
// const host_system& that kernels find by argument-dependent lookup. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_host_loops.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

// These live in namespace lockstep::host, host_system's own namespace (an associated namespace
// of host_system through its base host::adl_tag, system/host_system.hpp), so that the
// unqualified calls of the public kernels (kernels/bn_forward.hpp, bn_backward.hpp) find them
// by argument-dependent lookup next to the generic versions in lockstep::kernels, and prefer
// them for a host_system; lookup on other lockstep types does not see them.
// Each takes spans the public kernel has already checked (no precondition is repeated here).
// All of them run the vectorized OpenMP loops of bn_host_loops.hpp (on the calling thread alone
// below kernels::host_serial_below elements): the same functors as the
// generic path with another partitioning, so reductions agree with it to rounding and
// elementwise results bit for bit.

namespace lockstep::host {

/// Host per-channel moments into out (the workspace is unused).
template <class T, class Acc>
void bn_channel_moments(const host_system& sys, std::span<const T> x, kernels::channel_geometry g,
                        std::span<kernels::moments<Acc>> out,
                        std::span<kernels::moments<Acc>> /*workspace*/) {
    kernels::detail::host_channel_moments(kernels::threads_for(sys, g.size()), x.data(), g,
                                          out.data());
}

/// Host packed statistics block: host moments into the workspace's scratch, then packing.
template <class T, class Acc>
void bn_pack_local_moments(const host_system& sys, std::span<const T> x,
                           kernels::channel_geometry g, Acc status, std::span<Acc> block,
                           std::span<std::byte> workspace) {
    using kernels::moments;
    using kernels::packed_moments;
    moments<Acc>* local = kernels::detail::workspace_scratch<moments<Acc>>(workspace, g);
    kernels::detail::host_channel_moments(kernels::threads_for(sys, g.size()), x.data(), g, local);
    kernels::pack_block_fn<Acc> pack{local, g.channels, status, 0, 0, block.data()};
    packed_moments::split_count(g.per_channel(), pack.count_hi, pack.count_lo);
    for (std::size_t c = 0; c < std::max<std::size_t>(g.channels, 1); ++c)
        pack(c);
}

/// Host normalization.
template <class T, class Acc>
void bn_normalize(const host_system& sys, std::span<const T> x, std::span<T> y,
                  kernels::channel_geometry g, std::span<const Acc> mean,
                  std::span<const Acc> scale, std::span<const Acc> beta) {
    kernels::detail::host_normalize(kernels::threads_for(sys, g.size()), x.data(), y.data(), g,
                                    mean.data(), scale.data(), beta.data());
}

/// Host backward sums (the workspace is unused).
template <class T, class Acc>
void bn_backward_sums(const host_system& sys, std::span<const T> dy, std::span<const T> x,
                      kernels::channel_geometry g, std::span<const Acc> mean, std::span<Acc> sums,
                      std::span<Acc> /*workspace*/) {
    kernels::detail::host_backward_sums(kernels::threads_for(sys, g.size()), dy.data(), x.data(), g,
                                        mean.data(), sums.data());
}

/// Host packed backward sums: the backward sums, then the status slot.
template <class T, class Acc>
void bn_pack_backward_sums(const host_system& sys, std::span<const T> dy, std::span<const T> x,
                           kernels::channel_geometry g, std::span<const Acc> mean, Acc status,
                           std::span<Acc> sums, std::span<std::byte> /*workspace*/) {
    kernels::detail::host_backward_sums(kernels::threads_for(sys, g.size()), dy.data(), x.data(), g,
                                        mean.data(), sums.data());
    sums[kernels::packed_sums::status(g.channels)] = status;
}

/// Host input gradient with given coefficients.
template <class T, class Acc>
void bn_input_gradient(const host_system& sys, std::span<const T> dy, std::span<const T> x,
                       std::span<T> dx, kernels::channel_geometry g,
                       kernels::backward_coefficients<Acc> co) {
    kernels::detail::host_input_gradient(kernels::threads_for(sys, g.size()), dy.data(), x.data(),
                                         dx.data(), g, co);
}

/// Host fused input gradient: the coefficients (and parameter gradients) per channel, then the
/// vectorized dx loops.
template <class T, class Acc>
void bn_input_gradient_fused(const host_system& sys, std::span<const T> dy, std::span<const T> x,
                             std::span<T> dx, kernels::channel_geometry g,
                             std::span<const Acc> totals, std::span<const Acc> local,
                             const double* count, std::span<const Acc> gamma,
                             std::span<const Acc> mean, std::span<const Acc> invstd,
                             std::span<Acc> dgamma, std::span<Acc> dbeta) {
    const std::size_t C = g.channels;
    std::vector<Acc> k(C), a(C), b(C);
    Acc* const dg = dgamma.empty() ? nullptr : dgamma.data();
    Acc* const db = dbeta.empty() ? nullptr : dbeta.data();
    for (std::size_t c = 0; c < C; ++c) {
        const kernels::gradient_coefficients<Acc> co = kernels::fused_gradient_coefficients(
            c, C, totals.data(), *count, gamma.data(), invstd.data());
        k[c] = co.k;
        a[c] = co.a;
        b[c] = co.b;
        kernels::add_parameter_gradients(c, C, local.data(), invstd.data(), dg, db);
    }
    kernels::detail::host_input_gradient(
        kernels::threads_for(sys, g.size()), dy.data(), x.data(), dx.data(), g,
        kernels::backward_coefficients<Acc>{mean.data(), k.data(), a.data(), b.data()});
}

} // namespace lockstep::host

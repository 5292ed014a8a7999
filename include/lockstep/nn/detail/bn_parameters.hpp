// lockstep/nn/detail/bn_parameters.hpp: a batch-norm layer's construction-time checks and where
// its gamma, beta and their gradients live (its own buffer or the caller's spans).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/nn/batch_norm_params.hpp"
#include "lockstep/nn/detail/bn_state.hpp"

#include <cstddef>
#include <limits>
#include <span>

namespace lockstep::nn::detail {

/// channels, checked before any buffer is sized from it: throws lockstep::error
/// (invalid_argument, naming replica `rank`: -1 for a layer built without a communicator)
/// unless channels >= 1, eps finite and at least the smallest normal value of the layer's Acc as
/// Acc holds it (1e39 is inf and 1e-60 is 0 in float), 0 <= momentum <= 1 (written so that NaN
/// fails every comparison; eps = inf would make every output 0, eps = 0 a constant channel NaN,
/// and a subnormal eps too: backward's invstd^2 = 1 / eps overflows).
template <class Acc>
std::size_t validated_channels(std::size_t channels, const batch_norm_params& p, int rank) {
    const Acc eps = static_cast<Acc>(p.eps);
    const Acc smallest = std::numeric_limits<Acc>::min();
    LOCKSTEP_REQUIRE(
        channels >= 1 && p.eps > 0 && is_finite(p.eps) && eps >= smallest && is_finite(eps) &&
            p.momentum >= 0 && p.momentum <= 1,
        errc::invalid_argument, rank, "batch_norm", "channels = ", channels, ", eps = ", p.eps,
        " (", eps, " as the layer computes), momentum = ", p.momentum,
        " (need channels >= 1, finite eps > 0 in the layer's precision and no "
        "smaller than its smallest normal value ",
        smallest, ", since backward's 1 / eps must not overflow, and 0 <= momentum <= 1)");
    // The layer keeps 4 values per channel in one buffer (gamma, beta and their gradients).
    (void)checked_bytes(checked_mul(4, channels, rank, "batch_norm", "4 * channels"), sizeof(Acc),
                        rank, "batch_norm", "the parameter buffer");
    return channels;
}

/// Points s's gamma, beta, dgamma and dbeta at its own buffer (ext == nullptr) or at the
/// caller's spans, checks and initialises them as batch_norm's constructors promise: gamma = 1,
/// beta = 0 unless ext->values == initial_values::keep, fresh spans that hold a non-zero value
/// refused, dgamma = dbeta = 0. The running statistics are left to the layer. Errors name
/// replica `rank` (-1: a layer built without a communicator).
template <class Acc, class System>
void bind_parameters(bn_state<Acc, System>& s, const batch_norm_params& p,
                     const batch_norm_spans<Acc>* ext, int rank) {
    auto own = s.own.span();
    if (ext == nullptr || !p.affine) {
        s.gamma = own.first(s.channels);
        s.beta = own.subspan(s.channels, s.channels);
        if (p.affine) {
            s.dgamma = own.subspan(2 * s.channels, s.channels);
            s.dbeta = own.subspan(3 * s.channels, s.channels);
        }
    }
    if (ext != nullptr) {
        LOCKSTEP_REQUIRE(
            p.affine && ext->gamma.size() == s.channels && ext->beta.size() == s.channels &&
                ext->dgamma.size() == s.channels && ext->dbeta.size() == s.channels,
            errc::shape_mismatch, rank, "batch_norm", "external parameters need affine = true and ",
            s.channels, " values each, got gamma ", ext->gamma.size(), ", beta ", ext->beta.size(),
            ", dgamma ", ext->dgamma.size(), ", dbeta ", ext->dbeta.size());
        s.gamma = ext->gamma;
        s.beta = ext->beta;
        s.dgamma = ext->dgamma;
        s.dbeta = ext->dbeta;
    }
    if (ext != nullptr && ext->values == initial_values::fresh) {
        // Values the caller set (e.g. initialised in the registry before finalize) are never
        // silently overwritten: fresh spans must still hold the registry's zero fill.
        const std::size_t set = count_nonzero(s.sys, std::span<const Acc>(s.gamma)) +
                                count_nonzero(s.sys, std::span<const Acc>(s.beta));
        LOCKSTEP_REQUIRE(set == 0, errc::invalid_argument, rank, "batch_norm",
                         "gamma and beta over caller spans already hold ", set,
                         " non-zero value(s) of ", 2 * s.channels,
                         " (set by the caller, or by another layer over the same spans?); a "
                         "layer over fresh spans would overwrite them with gamma = 1, beta = 0: "
                         "give each layer spans of its own, or pass parameter_spans{..., .values "
                         "= nn::initial_values::keep} to train from the values set, or "
                         "initial_values::reset to overwrite them");
    }
    if (ext == nullptr || ext->values != initial_values::keep) {
        fill(s.sys, s.gamma, Acc(1));
        fill(s.sys, s.beta, Acc(0));
    }
    fill(s.sys, s.dgamma, Acc(0));
    fill(s.sys, s.dbeta, Acc(0));
}

} // namespace lockstep::nn::detail

// lockstep/train/rng.hpp: rng_stream, a host-side handle on the counter-based Philox streams.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/philox.hpp"

#include <cmath>
#include <cstdint>

namespace lockstep {

/// A (seed, stream) pair naming one family of random numbers; element e of global sample i is
/// a pure function of (seed, stream, i, e) (Philox-4x32-10, see kernels/philox.hpp), so every
/// replica computes the same numbers for the same sample whatever the replica count. A cheap
/// value type: copy it into functors (its members are usable in device code through the
/// kernels:: functions it forwards to).
/// Typical use: one stream per purpose (stream 0 dropout layer 1, stream 1 augmentation, ...).
struct rng_stream {
    std::uint64_t seed = 0;   ///< the run's seed (the Philox key)
    std::uint32_t stream = 0; ///< which family of numbers (dropout site, augmentation, ...)

    /// Another stream under the same seed (e.g. rng.substream(layer_id)).
    constexpr rng_stream substream(std::uint32_t s) const noexcept { return {seed, s}; }

    /// 32 random bits for element `element` of global sample `sample`.
    LOCKSTEP_HOST_DEVICE std::uint32_t bits(std::uint64_t sample, std::uint64_t element) const {
        return kernels::philox_bits(seed, stream, sample, element);
    }
    /// A uniform float in [0, 1) for element `element` of global sample `sample`.
    LOCKSTEP_HOST_DEVICE float uniform(std::uint64_t sample, std::uint64_t element) const {
        return kernels::uniform_float(seed, stream, sample, element);
    }
    /// A uniform double in [0, 1) for element `element` of global sample `sample`.
    LOCKSTEP_HOST_DEVICE double uniform_double(std::uint64_t sample, std::uint64_t element) const {
        return kernels::uniform_double(seed, stream, sample, element);
    }
    /// Dropout's keep decision (P(keep) = 1 - p). requires: 0 <= p <= 1.
    LOCKSTEP_HOST_DEVICE bool keep(std::uint64_t sample, std::uint64_t element, float p) const {
        return kernels::dropout_keep(seed, stream, sample, element, p);
    }
    /// A standard normal double (Box-Muller on the uniforms of elements 2e and 2e + 1, so the
    /// normals of one sample use disjoint counters).
    LOCKSTEP_HOST_DEVICE double normal(std::uint64_t sample, std::uint64_t element) const {
        const double u1 = 1.0 - uniform_double(sample, 2 * element); // (0, 1]: log is finite
        const double u2 = uniform_double(sample, 2 * element + 1);
        return ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
    }
};

} // namespace lockstep

// lockstep/kernels/philox.hpp: Philox-4x32-10 counter-based random numbers, usable in device code.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <cstdint>

namespace lockstep::kernels {

/// Four 32-bit words: a Philox counter or a Philox output block.
struct philox_block {
    std::uint32_t v[4];
};

/// A Philox-4x32 key (two 32-bit words).
struct philox_key {
    std::uint32_t k[2];
};

namespace detail {
inline constexpr std::uint32_t philox_m0 = 0xD2511F53u; ///< multiplier of words 0/1
inline constexpr std::uint32_t philox_m1 = 0xCD9E8D57u; ///< multiplier of words 2/3
inline constexpr std::uint32_t philox_w0 = 0x9E3779B9u; ///< key bump (golden ratio)
inline constexpr std::uint32_t philox_w1 = 0xBB67AE85u; ///< key bump (sqrt(3) - 1)

LOCKSTEP_HOST_DEVICE inline void mulhilo32(std::uint32_t a, std::uint32_t b, std::uint32_t& hi,
                                           std::uint32_t& lo) {
    const std::uint64_t p = static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b);
    hi = static_cast<std::uint32_t>(p >> 32);
    lo = static_cast<std::uint32_t>(p);
}

LOCKSTEP_HOST_DEVICE inline philox_block philox_round(philox_block c, philox_key k) {
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(philox_m0, c.v[0], hi0, lo0);
    mulhilo32(philox_m1, c.v[2], hi1, lo1);
    return {{hi1 ^ c.v[1] ^ k.k[0], lo1, hi0 ^ c.v[3] ^ k.k[1], lo0}};
}
} // namespace detail

/// Philox-4x32 with 10 rounds (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
/// 1, 2, 3", SC'11), bit-identical to Random123's philox4x32_R(10, ctr, key), curand's Philox
/// and PyTorch's philox engine core.
/// ensures: a bijection of the counter for each key; the same (counter, key) gives the same
/// block on every host and device.
LOCKSTEP_HOST_DEVICE inline philox_block philox4x32_10(philox_block counter, philox_key key) {
    counter = detail::philox_round(counter, key);
    for (int r = 1; r < 10; ++r) {
        key.k[0] += detail::philox_w0;
        key.k[1] += detail::philox_w1;
        counter = detail::philox_round(counter, key);
    }
    return counter;
}

/// The Philox key of a 64-bit seed: {low word, high word}.
LOCKSTEP_HOST_DEVICE inline philox_key philox_seed_key(std::uint64_t seed) {
    return {{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}};
}

/// The counter lockstep uses for (stream, global sample index, block): word 0 = block (the
/// element index / 4 within the sample), word 1 = stream, words 2/3 = the 64-bit global sample
/// index (low, high). Nothing in it depends on the replica count or the rank, so a sample's
/// random numbers are the same however the global batch is split.
LOCKSTEP_HOST_DEVICE inline philox_block
philox_counter(std::uint32_t stream, std::uint64_t sample_index, std::uint32_t block) {
    return {{block, stream, static_cast<std::uint32_t>(sample_index),
             static_cast<std::uint32_t>(sample_index >> 32)}};
}

/// The 32 random bits of element `element` of sample `sample_index` in stream `stream` under
/// `seed`: word element % 4 of philox4x32_10(philox_counter(stream, sample, element / 4), seed).
/// requires: element / 4 < 2^32.
LOCKSTEP_HOST_DEVICE inline std::uint32_t philox_bits(std::uint64_t seed, std::uint32_t stream,
                                                      std::uint64_t sample_index,
                                                      std::uint64_t element) {
    const philox_block r =
        philox4x32_10(philox_counter(stream, sample_index, static_cast<std::uint32_t>(element / 4)),
                      philox_seed_key(seed));
    return r.v[element % 4];
}

/// A uniform float in [0, 1) from 32 random bits: the top 24 bits times 2^-24 (exact, every
/// value a multiple of 2^-24).
LOCKSTEP_HOST_DEVICE inline float uniform_float(std::uint32_t bits) {
    return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

/// A uniform double in [0, 1) from 64 random bits (hi, lo): the top 53 bits times 2^-53.
LOCKSTEP_HOST_DEVICE inline double uniform_double(std::uint32_t hi, std::uint32_t lo) {
    const std::uint64_t x = (static_cast<std::uint64_t>(hi) << 32) | lo;
    return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);
}

/// A uniform float in [0, 1) for (seed, stream, global sample index, element).
LOCKSTEP_HOST_DEVICE inline float uniform_float(std::uint64_t seed, std::uint32_t stream,
                                                std::uint64_t sample_index, std::uint64_t element) {
    return uniform_float(philox_bits(seed, stream, sample_index, element));
}

/// A uniform double in [0, 1) for (seed, stream, global sample index, element): words
/// 2 * (element % 2) and 2 * (element % 2) + 1 of block element / 2 give the 64 bits.
/// requires: element / 2 < 2^32.
LOCKSTEP_HOST_DEVICE inline double uniform_double(std::uint64_t seed, std::uint32_t stream,
                                                  std::uint64_t sample_index,
                                                  std::uint64_t element) {
    const philox_block r =
        philox4x32_10(philox_counter(stream, sample_index, static_cast<std::uint32_t>(element / 2)),
                      philox_seed_key(seed));
    const unsigned j = static_cast<unsigned>(element % 2) * 2;
    return uniform_double(r.v[j], r.v[j + 1]);
}

/// Inverted dropout's keep decision for one element: true (keep, scale by 1 / (1 - p)) when
/// uniform_float(seed, stream, sample_index, element) >= p, so P(keep) = 1 - p up to the 2^-24
/// resolution of the uniform. The decision depends only on its arguments, never on the replica
/// count or rank: pass the GLOBAL sample index.
/// requires: 0 <= p <= 1 (p = 0 keeps everything, p = 1 drops everything).
LOCKSTEP_HOST_DEVICE inline bool dropout_keep(std::uint64_t seed, std::uint32_t stream,
                                              std::uint64_t sample_index, std::uint64_t element,
                                              float p) {
    return uniform_float(seed, stream, sample_index, element) >= p;
}

} // namespace lockstep::kernels

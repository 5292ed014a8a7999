// lockstep/kernels/detail/anchored_tile_host.hpp: what the host's float anchored sums compute for
// one tile of elements read straight from their arrays of terms (a double sum where every term lies
// near the anchor, one float addition for two terms, and which elements are left to
// anchored_sum_fn), in loops with no data-dependent branch; the x86 loops
// (anchored_x86_host.hpp) compute the same, element for element. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/kernels/anchored_sum.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace lockstep::kernels::detail {

/// Elements per tile: the tile's anchors, sums and flags live in registers or L1.
inline constexpr std::size_t anchored_tile = 256;

/// Bit 31 set exactly when x is not finite (its exponent field all ones; the field plus one unit
/// carries into bit 31), so OR-ing it over values and shifting right by 31 flags a range in a
/// loop the compiler can vectorise.
[[gnu::always_inline]] inline std::uint32_t anchored_non_finite_bit(float x) {
    return (std::bit_cast<std::uint32_t>(x) & 0x7f800000u) + 0x00800000u;
}

/// Bit 63 set exactly when x is not finite, as anchored_non_finite_bit(float) does for floats.
[[gnu::always_inline]] inline std::uint64_t anchored_non_finite_bit(double x) {
    return (std::bit_cast<std::uint64_t>(x) & 0x7ff0000000000000u) + 0x0010000000000000u;
}

/// The binades below the anchor that a tile's sum keeps exactly for k terms: 29 - ceil(log2 k),
/// so that k terms of less than 2^(24 + bits) units sum to at most 2^53 units (exact in a
/// double). requires: k >= 1.
inline int anchored_tile_bits(std::size_t k) {
    return 29 - static_cast<int>(std::bit_width(k - 1)); // ceil(log2 k) for k >= 1
}

/// The float sums of m <= anchored_tile elements of k arrays (element i's terms: p[j][i], j < k)
/// into out[0, m), with no data-dependent branch. One pass takes each element's largest exponent
/// field a (the anchor) and the smallest field of a non-zero term (1 for subnormals); where every
/// non-zero term lies within bits = anchored_tile_bits(k) binades of a, every term is a whole
/// number of units u = 2^(a - 150 - bits) below 2^(24 + bits) units, so every partial sum in
/// double is exact: the double sum is the exact sum, and its conversion to float is the one
/// rounding, which is anchored_sum_fn's result (it keeps 60 bits below the anchor, so it cuts
/// nothing there either), unless the result is subnormal (where flush-to-zero modes would
/// differ). done[i] = 1 where out[i] holds it (or a quiet NaN for a non-finite anchor); 0 where
/// anchored_sum_fn must answer. Returns true when every done[i] is 1. requires: 1 <= k <=
/// anchored_short_terms.
[[gnu::always_inline]] inline bool anchored_tile_body(const float* const* p, std::size_t k,
                                                      std::size_t m, float* out,
                                                      unsigned char* done) {
    const int bits = anchored_tile_bits(k);
    std::int32_t top[anchored_tile];
    std::int32_t low[anchored_tile]; ///< the smallest field of a non-zero term (255: none)
    double sum[anchored_tile];
    for (std::size_t i = 0; i < anchored_tile; ++i) {
        top[i] = 1;
        low[i] = anchored<float>::non_finite;
        sum[i] = 0.0;
    }
    for (std::size_t j = 0; j < k; ++j) {
        const float* q = p[j];
        for (std::size_t i = 0; i < m; ++i) {
            const auto u = std::bit_cast<std::uint32_t>(q[i]);
            const auto e = static_cast<std::int32_t>((u >> 23) & 0xffu);
            const std::int32_t field =
                (u & 0x7fffffffu) == 0 ? anchored<float>::non_finite : (e > 1 ? e : 1);
            top[i] = e > top[i] ? e : top[i];
            low[i] = field < low[i] ? field : low[i];
        }
    }
    for (std::size_t j = 0; j < k; ++j) {
        const float* q = p[j];
        for (std::size_t i = 0; i < m; ++i)
            sum[i] += static_cast<double>(q[i]); // exact where the tile answers
    }
    std::int64_t all = -1;
    for (std::size_t i = 0; i < m; ++i) {
        const double v = sum[i];
        const double mag = v < 0 ? -v : v;
        // Masks of 0 or -1, combined with bit operations (no branch): a non-finite anchor gives
        // a quiet NaN; a term too far below the anchor or a subnormal result leaves the element
        // to anchored_sum_fn.
        const std::int64_t nan = top[i] == anchored<float>::non_finite ? -1 : 0;
        const std::int64_t within = low[i] >= top[i] - bits ? -1 : 0;
        const std::int64_t normal = mag >= 0x1p-126 ? -1 : 0;
        const std::int64_t zero = mag == 0.0 ? -1 : 0;
        const double w = std::bit_cast<double>((std::bit_cast<std::int64_t>(v) & ~nan) |
                                               (std::int64_t{0x7ff8000000000000} & nan));
        out[i] = static_cast<float>(w); // the one rounding (to infinity past the range)
        const std::int64_t ok = nan | (within & (normal | zero));
        done[i] = static_cast<unsigned char>(ok & 1);
        all &= ok;
    }
    return all != 0;
}

/// The float sums of exactly 2 terms over m <= anchored_tile elements of two arrays p and q into
/// out[0, m), as anchored_tile_body reports them, in one pass of float additions: an IEEE float
/// addition rounds the exact sum once to nearest even, which is anchored_sum_fn's result
/// wherever that is normal, infinite or zero (a term too far below the other for the limbs to
/// keep is below half an ulp of it, so it cannot move the rounding either way; the sum starts
/// from +0 as anchored_sum_fn's does, so -0 + -0 gives +0). A non-finite term gives
/// anchored_sum_fn's quiet NaN; a subnormal result is left to anchored_sum_fn (done[i] = 0).
[[gnu::always_inline]] inline bool anchored_pair_loop(const float* p, const float* q, std::size_t m,
                                                      float* out, unsigned char* done) {
    // Float operations only and no branch, so the loop vectorises (GCC 12 vectorises no loop
    // that mixes these float loads with their bits as integers).
    const float quiet_nan = std::numeric_limits<float>::quiet_NaN(); // anchored_sum_fn's bits
    unsigned all = 1;
    for (std::size_t i = 0; i < m; ++i) {
        const float x = p[i];
        const float y = q[i];
        const float sum = (0.0f + x) + y;
        const bool finite = (x - x == 0.0f) & (y - y == 0.0f); // false for infinities and NaNs
        const float mag = sum < 0.0f ? -sum : sum;
        out[i] = finite ? sum : quiet_nan;
        const unsigned ok = static_cast<unsigned>(!finite) |
                            static_cast<unsigned>(mag >= 0x1p-126f) |
                            static_cast<unsigned>(sum == 0.0f);
        done[i] = static_cast<unsigned char>(ok);
        all &= ok;
    }
    return all != 0;
}

/// done[0, 8) = the bits 0..7 of mask, one per byte.
inline void anchored_spread_done(unsigned mask, unsigned char* done) {
    // The mask in every byte, bit q kept in byte q, then 0x7f added to each byte (no carry out
    // of a byte): bit 7 of byte q is bit q of the mask.
    const std::uint64_t kept =
        (std::uint64_t{mask & 0xffu} * 0x0101010101010101ULL) & 0x8040201008040201ULL;
    const std::uint64_t bytes = ((kept + 0x7f7f7f7f7f7f7f7fULL) >> 7) & 0x0101010101010101ULL;
    std::memcpy(done, &bytes, 8);
}

} // namespace lockstep::kernels::detail

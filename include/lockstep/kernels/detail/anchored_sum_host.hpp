// lockstep/kernels/detail/anchored_sum_host.hpp: the host's float anchored sums in tiles of
// elements (AVX2 loops spelled out where the CPU has it, else loops the compiler vectorises), bit
// for bit equal to anchored_sum_fn.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/float16_arrays.hpp"
#include "lockstep/kernels/anchored_sum.hpp"

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if LOCKSTEP_F16_X86
#include <immintrin.h>
#define LOCKSTEP_ANCHORED_AVX2 __attribute__((target("avx2")))
#endif

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

/// Test hook: set to true, the tiles take their portable loops even where AVX2 exists (tests run
/// both paths on one machine). Not for production use.
inline std::atomic<bool>& anchored_portable_only() noexcept {
    static std::atomic<bool> flag{false};
    return flag;
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

inline bool anchored_pair_portable(const float* p, const float* q, std::size_t m, float* out,
                                   unsigned char* done) {
    return anchored_pair_loop(p, q, m, out, done);
}

inline bool anchored_tile_portable(const float* const* p, std::size_t k, std::size_t m, float* out,
                                   unsigned char* done) {
    return anchored_tile_body(p, k, m, out, done);
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

#if LOCKSTEP_F16_X86
// The AVX2 loops spell the vector operations out, so that their speed does not depend on the
// optimisation level the user compiles with (GCC 12 at -O2 vectorises neither body); they
// compute what the loops above compute, element for element, and take those loops for the last
// m mod 8 elements.

/// anchored_tile_body, 8 elements at a time. The anchor and the smallest field come from the
/// terms' magnitudes as integers (the bits of a non-negative float order as its value does):
/// the largest magnitude's field is the largest field, and the smallest non-zero magnitude's
/// field is the smallest field of a non-zero term (min of magnitude - 1 as unsigned, which sends
/// zeros past every other term); both fields are taken once after the terms. The conversions
/// to double read their halves from memory (no extraction from the 8-float load).
LOCKSTEP_ANCHORED_AVX2 inline bool anchored_tile_avx2(const float* const* p, std::size_t k,
                                                      std::size_t m, float* out,
                                                      unsigned char* done) {
    const __m256i bits = _mm256_set1_epi32(anchored_tile_bits(k));
    const __m256i byte = _mm256_set1_epi32(0xff);
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i zero_i = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi32(-1);
    const __m256d smallest = _mm256_set1_pd(0x1p-126);
    const __m256d sign = _mm256_set1_pd(-0.0);
    const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    unsigned all = 0xffu;
    std::size_t i = 0;
    for (; i + 8 <= m; i += 8) {
        __m256i largest = zero_i; // the largest magnitude's bits
        __m256i below = ones;     // the smallest non-zero magnitude's bits - 1 (unsigned)
        __m256d sum_low = _mm256_setzero_pd();
        __m256d sum_high = _mm256_setzero_pd();
        for (std::size_t j = 0; j < k; ++j) {
            const __m256 v = _mm256_loadu_ps(p[j] + i);
            const __m256i mag = _mm256_and_si256(_mm256_castps_si256(v), magnitude);
            largest = _mm256_max_epi32(largest, mag);
            below = _mm256_min_epu32(below, _mm256_sub_epi32(mag, one));
            sum_low = _mm256_add_pd(sum_low, _mm256_cvtps_pd(_mm_loadu_ps(p[j] + i)));
            sum_high = _mm256_add_pd(sum_high, _mm256_cvtps_pd(_mm_loadu_ps(p[j] + i + 4)));
        }
        // top = max(field, 1) of the largest; low = max(field, 1) of the smallest non-zero term,
        // 255 when every term is zero (below + 1 wrapped to 0).
        const __m256i top = _mm256_max_epi32(_mm256_srli_epi32(largest, 23), one);
        const __m256i smallest_mag = _mm256_add_epi32(below, one);
        const __m256i low =
            _mm256_or_si256(_mm256_max_epi32(_mm256_srli_epi32(smallest_mag, 23), one),
                            _mm256_and_si256(_mm256_cmpeq_epi32(smallest_mag, zero_i), byte));
        const __m256i nan = _mm256_cmpeq_epi32(top, byte);
        const __m256i beyond = _mm256_cmpgt_epi32(_mm256_sub_epi32(top, bits), low);
        // A normal or zero sum (of 4 doubles each: the 4 low elements, the 4 high ones).
        const __m256d mag_low = _mm256_andnot_pd(sign, sum_low);
        const __m256d mag_high = _mm256_andnot_pd(sign, sum_high);
        const auto fine_low = static_cast<unsigned>(_mm256_movemask_pd(
            _mm256_or_pd(_mm256_cmp_pd(mag_low, smallest, _CMP_GE_OQ),
                         _mm256_cmp_pd(sum_low, _mm256_setzero_pd(), _CMP_EQ_OQ))));
        const auto fine_high = static_cast<unsigned>(_mm256_movemask_pd(
            _mm256_or_pd(_mm256_cmp_pd(mag_high, smallest, _CMP_GE_OQ),
                         _mm256_cmp_pd(sum_high, _mm256_setzero_pd(), _CMP_EQ_OQ))));
        const unsigned nan_mask =
            static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(nan)));
        const unsigned within =
            ~static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(beyond))) & 0xffu;
        const unsigned ok = nan_mask | (within & (fine_low | (fine_high << 4)));
        // The one rounding, by the current rounding mode as static_cast<float> does.
        const __m256 r = _mm256_set_m128(_mm256_cvtpd_ps(sum_high), _mm256_cvtpd_ps(sum_low));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(r, quiet_nan, _mm256_castsi256_ps(nan)));
        anchored_spread_done(ok, done + i);
        all &= ok;
    }
    if (i == m)
        return all == 0xffu;
    const float* rest[anchored_short_terms];
    for (std::size_t j = 0; j < k; ++j)
        rest[j] = p[j] + i;
    const bool tail = anchored_tile_body(rest, k, m - i, out + i, done + i);
    return all == 0xffu && tail;
}

/// anchored_pair_loop, 8 elements at a time.
LOCKSTEP_ANCHORED_AVX2 inline bool anchored_pair_avx2(const float* p, const float* q, std::size_t m,
                                                      float* out, unsigned char* done) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 smallest = _mm256_set1_ps(0x1p-126f);
    const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    unsigned all = 0xffu;
    std::size_t i = 0;
    for (; i + 8 <= m; i += 8) {
        const __m256 x = _mm256_loadu_ps(p + i);
        const __m256 y = _mm256_loadu_ps(q + i);
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(zero, x), y);
        const __m256 finite = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_EQ_OQ),
                                            _mm256_cmp_ps(_mm256_sub_ps(y, y), zero, _CMP_EQ_OQ));
        const __m256 mag = _mm256_andnot_ps(sign, sum);
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(quiet_nan, sum, finite));
        const unsigned ok =
            (~static_cast<unsigned>(_mm256_movemask_ps(finite)) & 0xffu) |
            static_cast<unsigned>(_mm256_movemask_ps(_mm256_or_ps(
                _mm256_cmp_ps(mag, smallest, _CMP_GE_OQ), _mm256_cmp_ps(sum, zero, _CMP_EQ_OQ))));
        anchored_spread_done(ok, done + i);
        all &= ok;
    }
    const bool tail = anchored_pair_loop(p + i, q + i, m - i, out + i, done + i);
    return all == 0xffu && tail;
}
#endif

/// Whether the tiles take their AVX2 loops (the CPU has them and the test hook allows them).
inline bool anchored_use_avx2() noexcept {
#if LOCKSTEP_F16_X86
    return lockstep::detail::cpu_has_f16c() &&
           !anchored_portable_only().load(std::memory_order_relaxed);
#else
    return false;
#endif
}

/// anchored_pair_loop over two arrays p and q, on the AVX2 loop where anchored_use_avx2().
inline bool anchored_pair(const float* p, const float* q, std::size_t m, float* out,
                          unsigned char* done) {
#if LOCKSTEP_F16_X86
    if (anchored_use_avx2())
        return anchored_pair_avx2(p, q, m, out, done);
#endif
    return anchored_pair_portable(p, q, m, out, done);
}

/// anchored_tile_body, on the AVX2 loop where anchored_use_avx2().
inline bool anchored_tile_sums(const float* const* p, std::size_t k, std::size_t m, float* out,
                               unsigned char* done) {
#if LOCKSTEP_F16_X86
    if (anchored_use_avx2())
        return anchored_tile_avx2(p, k, m, out, done);
#endif
    return anchored_tile_portable(p, k, m, out, done);
}

/// The float sums of m <= anchored_tile elements of k arrays p[j] into out[0, m): one float
/// addition each for 2 arrays (anchored_pair), anchored_tile_sums otherwise; done and the
/// result as anchored_tile_body reports them. requires: 1 <= k <= anchored_short_terms.
inline bool anchored_array_sums(const float* const* p, std::size_t k, std::size_t m, float* out,
                                unsigned char* done) {
    return k == 2 ? anchored_pair(p[0], p[1], m, out, done)
                  : anchored_tile_sums(p, k, m, out, done);
}

/// Task t: the float sums of elements [t anchored_tile, min(..., count)) of terms into out,
/// bit for bit what anchored_sum_fn<float> gives (which answers the elements the tile does
/// not); 2 terms (2 replicas of one chunk, or one replica's 2 chunks) take anchored_pair_loop.
/// Host only. requires: terms.replicas * terms.calls <= anchored_short_terms.
struct anchored_sum_tiles_fn {
    anchored_terms<float> terms;
    std::size_t count;
    float* out;
    void operator()(std::size_t t) const {
        const std::size_t b = t * anchored_tile;
        const std::size_t m = count - b < anchored_tile ? count - b : anchored_tile;
        const std::size_t k = terms.replicas * terms.calls;
        const float* p[anchored_short_terms];
        for (std::size_t j = 0; j < terms.replicas; ++j)
            for (std::size_t c = 0; c < terms.calls; ++c)
                p[j * terms.calls + c] =
                    terms.base + j * terms.replica_stride + c * terms.call_stride + b;
        unsigned char done[anchored_tile];
        if (!anchored_array_sums(p, k, m, out + b, done))
            for (std::size_t i = 0; i < m; ++i)
                if (done[i] == 0)
                    anchored_sum_fn<float>{terms, out}(b + i);
    }
};

} // namespace lockstep::kernels::detail

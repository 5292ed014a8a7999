// lockstep/kernels/detail/anchored_x86_host.hpp: the host's float anchored sums of a tile on x86
// vector registers (AVX2 and AVX-512 intrinsics; the caller picks by CPUID), element for element
// what anchored_tile_host.hpp's loops compute. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/float16_arrays.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/detail/anchored_tile_host.hpp"

#include <cstddef>
#include <cstdint>

#if LOCKSTEP_F16_X86
#include <immintrin.h>
#define LOCKSTEP_ANCHORED_AVX2 __attribute__((target("avx2")))
#define LOCKSTEP_ANCHORED_AVX512 __attribute__((target("avx512f")))
#endif

namespace lockstep::kernels::detail {

#if LOCKSTEP_F16_X86
// The loops spell the vector operations out, so that their speed does not depend on the
// optimisation level the user compiles with (GCC 12 at -O2 vectorises neither body); they
// compute what anchored_tile_host.hpp's loops compute, element for element, and the AVX2 ones take
// those loops for the last m mod 8 elements.

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

/// anchored_tile_body, 16 elements at a time: anchored_tile_avx2's operations on 512-bit
/// registers (a mask register where it compares), then anchored_tile_avx2 for the last m mod 16
/// elements.
LOCKSTEP_ANCHORED_AVX512 inline bool anchored_tile_avx512(const float* const* p, std::size_t k,
                                                          std::size_t m, float* out,
                                                          unsigned char* done) {
    const __m512i bits = _mm512_set1_epi32(anchored_tile_bits(k));
    const __m512i byte = _mm512_set1_epi32(0xff);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i zero_i = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi32(-1);
    const __m512d smallest = _mm512_set1_pd(0x1p-126);
    const __m512d zero_d = _mm512_setzero_pd();
    const __m512 quiet_nan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000));
    unsigned all = 0xffffu;
    std::size_t i = 0;
    for (; i + 16 <= m; i += 16) {
        __m512i largest = zero_i;
        __m512i below = ones;
        __m512d sum_low = zero_d;
        __m512d sum_high = zero_d;
        for (std::size_t j = 0; j < k; ++j) {
            const __m512i mag = _mm512_and_si512(_mm512_loadu_si512(p[j] + i), magnitude);
            largest = _mm512_max_epi32(largest, mag);
            below = _mm512_min_epu32(below, _mm512_sub_epi32(mag, one));
            sum_low = _mm512_add_pd(sum_low, _mm512_cvtps_pd(_mm256_loadu_ps(p[j] + i)));
            sum_high = _mm512_add_pd(sum_high, _mm512_cvtps_pd(_mm256_loadu_ps(p[j] + i + 8)));
        }
        const __m512i top = _mm512_max_epi32(_mm512_srli_epi32(largest, 23), one);
        const __m512i smallest_mag = _mm512_add_epi32(below, one);
        const __m512i low =
            _mm512_mask_mov_epi32(_mm512_max_epi32(_mm512_srli_epi32(smallest_mag, 23), one),
                                  _mm512_cmpeq_epi32_mask(smallest_mag, zero_i), byte);
        const unsigned nan = _mm512_cmpeq_epi32_mask(top, byte);
        const unsigned within =
            ~static_cast<unsigned>(_mm512_cmpgt_epi32_mask(_mm512_sub_epi32(top, bits), low)) &
            0xffffu;
        const unsigned fine_low = _mm512_cmp_pd_mask(_mm512_abs_pd(sum_low), smallest, _CMP_GE_OQ) |
                                  _mm512_cmp_pd_mask(sum_low, zero_d, _CMP_EQ_OQ);
        const unsigned fine_high =
            _mm512_cmp_pd_mask(_mm512_abs_pd(sum_high), smallest, _CMP_GE_OQ) |
            _mm512_cmp_pd_mask(sum_high, zero_d, _CMP_EQ_OQ);
        const unsigned ok = nan | (within & (fine_low | (fine_high << 8)));
        // The one rounding, by the current rounding mode as static_cast<float> does.
        const __m512 r = _mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(sum_low))),
                               _mm256_castps_pd(_mm512_cvtpd_ps(sum_high)), 1));
        _mm512_storeu_ps(out + i, _mm512_mask_mov_ps(r, static_cast<__mmask16>(nan), quiet_nan));
        anchored_spread_done(ok & 0xffu, done + i);
        anchored_spread_done(ok >> 8, done + i + 8);
        all &= ok;
    }
    if (i == m)
        return all == 0xffffu;
    const float* rest[anchored_short_terms];
    for (std::size_t j = 0; j < k; ++j)
        rest[j] = p[j] + i;
    const bool tail = anchored_tile_avx2(rest, k, m - i, out + i, done + i);
    return all == 0xffffu && tail;
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

} // namespace lockstep::kernels::detail

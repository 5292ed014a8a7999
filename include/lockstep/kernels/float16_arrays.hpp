// lockstep/kernels/float16_arrays.hpp: float <-> half / bfloat16 conversion of whole arrays on the
// host (F16C/AVX2 where the CPU has them, else branch-free loops the compiler vectorises), bit
// for bit equal to the scalar conversions of float16.hpp. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/system/detail/cpu_features.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The F16C/AVX2 path: x86 host code of GCC or Clang (also the host pass of nvcc), selected at run
// time (detail::cpu_has_f16c), so the default build (no -march) uses it wherever the CPU has it.
#if LOCKSTEP_HOST_X86
#define LOCKSTEP_F16_X86 1
#include <immintrin.h>
#define LOCKSTEP_F16_TARGET __attribute__((target("avx2,f16c")))
#else
#define LOCKSTEP_F16_X86 0
#endif

namespace lockstep::detail {

/// Test hook: set to true, the array conversions below take their portable loops even where
/// F16C/AVX2 exist (tests run both paths on one machine). Not for production use.
inline std::atomic<bool>& f16_portable_only() noexcept {
    static std::atomic<bool> flag{false};
    return flag;
}

/// float_to_half_bits without data-dependent branches (every candidate computed, then
/// selected): the same bits, in a form loops vectorise.
inline std::uint16_t float_to_half_bits_select(float f) {
    std::uint32_t x = float_bits(f);
    const std::uint32_t sign = x & 0x80000000u;
    x ^= sign;
    const std::uint32_t special = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    const std::uint32_t subnormal = float_bits(bits_float(x) + 0.5f) - 0x3f000000u;
    const std::uint32_t normal = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
    const std::uint32_t o = x >= 0x47800000u ? special : x < 0x38800000u ? subnormal : normal;
    return static_cast<std::uint16_t>(o | (sign >> 16));
}

/// half_bits_to_float without data-dependent branches.
inline float half_bits_to_float_select(std::uint16_t h) {
    const std::uint32_t o = ((static_cast<std::uint32_t>(h) & 0x7fffu) << 13) + 0x38000000u;
    const std::uint32_t e = (static_cast<std::uint32_t>(h) & 0x7c00u);
    const std::uint32_t special = o + 0x38000000u;
    const std::uint32_t subnormal =
        float_bits(bits_float(o + 0x00800000u) - bits_float(0x38800000u));
    const std::uint32_t r = e == 0x7c00u ? special : e == 0 ? subnormal : o;
    return bits_float(r | ((static_cast<std::uint32_t>(h) & 0x8000u) << 16));
}

/// float_to_bfloat16_bits without data-dependent branches.
inline std::uint16_t float_to_bfloat16_bits_select(float f) {
    const std::uint32_t x = float_bits(f);
    const std::uint32_t nan = (x >> 16) | 0x40u;
    const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#if LOCKSTEP_F16_X86
/// True when the array conversions take the F16C/AVX2 path.
inline bool use_f16c() noexcept {
    return cpu_has_f16c() && !f16_portable_only().load(std::memory_order_relaxed);
}

// Reads run this many bytes ahead with software prefetches: the hardware prefetcher stops at
// every 4 KiB page, and a gradient streamed from memory is converted about 1.7x faster with them
// (25.6 M floats in 64 Ki chunks: 12.6 -> 7.3 ms on the 2-core test machine). A prefetch never
// faults, so it may run past the end of the array.
inline constexpr int f16_prefetch_bytes = 4096;

// VCVTPS2PH rounds to nearest even with overflow to infinity, as float_to_half_bits does; it
// keeps the top of a NaN's payload where float_to_half_bits gives the canonical 0x7e00, so NaN
// lanes drop their payload bits.
LOCKSTEP_F16_TARGET inline __m128i round_half8_f16c(__m256 x) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan16 =
        _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    return _mm_andnot_si128(_mm_and_si128(nan16, _mm_set1_epi16(0x01ff)), h);
}

LOCKSTEP_F16_TARGET inline void to_half_f16c(const float* src, std::size_t n, unsigned char* dst) {
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(src + i) + f16_prefetch_bytes, _MM_HINT_T0);
        const __m128i a = round_half8_f16c(_mm256_loadu_ps(src + i));
        const __m128i b = round_half8_f16c(_mm256_loadu_ps(src + i + 8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16), b);
    }
    for (; i < n; ++i) {
        const std::uint16_t h = float_to_half_bits(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
    }
}

// VCVTPH2PS is exact but quiets signalling NaNs, where half_bits_to_float keeps every payload
// bit: NaN lanes are rebuilt from their bits.
LOCKSTEP_F16_TARGET inline void from_half_f16c(const unsigned char* src, std::size_t n,
                                               float* dst) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fff), inf = _mm256_set1_epi32(0x7c00);
    const __m256i mantissa = _mm256_set1_epi32(0x3ff), exponent = _mm256_set1_epi32(0x7f800000);
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
        const __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(h));
        const __m256i h32 = _mm256_cvtepu16_epi32(h);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(h32, magnitude), inf);
        const __m256i kept = _mm256_or_si256(
            _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(h32, 16), sign), exponent),
            _mm256_slli_epi32(_mm256_and_si256(h32, mantissa), 13));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_blendv_epi8(f, kept, nan)));
    }
    for (; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = half_bits_to_float(h);
    }
}

// float_to_bfloat16_bits on 8 lanes (results in the low 16 bits of each).
LOCKSTEP_F16_TARGET inline __m256i round_bfloat16_avx2(__m256i x) {
    const __m256i top = _mm256_srli_epi32(x, 16);
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                                           _mm256_and_si256(top, _mm256_set1_epi32(1))),
                          16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}

LOCKSTEP_F16_TARGET inline void to_bfloat16_avx2(const float* src, std::size_t n,
                                                 unsigned char* dst) {
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(src + i) + f16_prefetch_bytes, _MM_HINT_T0);
        const __m256i a =
            round_bfloat16_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        const __m256i b =
            round_bfloat16_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8)));
        // packus interleaves the 128-bit lanes of a and b; the permute restores element order.
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i), packed);
    }
    for (; i < n; ++i) {
        const std::uint16_t h = float_to_bfloat16_bits(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
    }
}

// 8 wire values as floats. Signalling half NaNs come out quiet, which the sums below may
// ignore: a NaN sum encodes to the canonical NaN either way.
template <class Wire>
LOCKSTEP_F16_TARGET inline __m256 load_wire8(const unsigned char* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<Wire, half>)
        return _mm256_cvtph_ps(h);
    else
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats rounded to wire bits (as to_wire_n).
template <class Wire>
LOCKSTEP_F16_TARGET inline __m128i round_wire8(__m256 x) {
    if constexpr (std::is_same_v<Wire, half>) {
        return round_half8_f16c(x);
    } else {
        const __m256i r = round_bfloat16_avx2(_mm256_castps_si256(x));
        return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    }
}

// The vector loop of sum_wire_n; returns the elements done (a multiple of 8).
template <class Wire>
LOCKSTEP_F16_TARGET inline std::size_t sum_wire_avx2(const unsigned char* src, std::size_t stride,
                                                     int ranks, std::size_t n, unsigned char* out,
                                                     float* back, std::size_t n_back) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 acc = load_wire8<Wire>(src + 2 * i);
        for (int r = 1; r < ranks; ++r)
            acc = _mm256_add_ps(
                acc, load_wire8<Wire>(src + static_cast<std::size_t>(r) * stride + 2 * i));
        const __m128i h = round_wire8<Wire>(acc);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
        if (i + 8 <= n_back) // a sum's bits are never a signalling NaN: converting back is exact
            _mm256_storeu_ps(back + i, load_wire8<Wire>(out + 2 * i));
        else
            for (std::size_t k = i; k < n_back && k < i + 8; ++k)
                back[k] = wire_codec<Wire>::decode(
                    static_cast<std::uint16_t>(out[2 * k] | (out[2 * k + 1] << 8)));
    }
    return i;
}
#endif

/// The loops to_wire_n runs without F16C/AVX2 (tested on their own as well). Tiles through a
/// local array, so the conversion loop vectorises and the bytes reach dst by memcpy (dst is
/// often the storage of int words).
template <class Wire>
void to_wire_n_portable(const float* src, std::size_t n, void* dst) {
    auto* out = static_cast<unsigned char*>(dst);
    constexpr std::size_t tile = 512;
    std::uint16_t bits[tile];
    for (std::size_t at = 0; at < n; at += tile) {
        const std::size_t m = n - at < tile ? n - at : tile;
        for (std::size_t i = 0; i < m; ++i) {
            if constexpr (std::is_same_v<Wire, half>)
                bits[i] = float_to_half_bits_select(src[at + i]);
            else
                bits[i] = float_to_bfloat16_bits_select(src[at + i]);
        }
        std::memcpy(out + 2 * at, bits, 2 * m);
    }
}

/// The loops from_wire_n runs without F16C (tested on their own as well).
template <class Wire>
void from_wire_n_portable(const void* src, std::size_t n, float* dst) {
    const auto* in = static_cast<const unsigned char*>(src);
    constexpr std::size_t tile = 512;
    std::uint16_t bits[tile];
    for (std::size_t at = 0; at < n; at += tile) {
        const std::size_t m = n - at < tile ? n - at : tile;
        std::memcpy(bits, in + 2 * at, 2 * m);
        for (std::size_t i = 0; i < m; ++i) {
            if constexpr (std::is_same_v<Wire, half>)
                dst[at + i] = half_bits_to_float_select(bits[i]);
            else
                dst[at + i] = bits_float(static_cast<std::uint32_t>(bits[i]) << 16);
        }
    }
}

/// Host: dst receives the n 16-bit Wire values of src[0..n) (rounded to nearest even, bit for
/// bit as Wire(float)), in memory order: 2n bytes at any alignment.
/// requires: dst does not overlap src; the default rounding mode (as float_to_half_bits).
template <class Wire>
void to_wire_n(const float* src, std::size_t n, void* dst) {
#if LOCKSTEP_F16_X86
    if (use_f16c()) {
        if constexpr (std::is_same_v<Wire, half>)
            to_half_f16c(src, n, static_cast<unsigned char*>(dst));
        else
            to_bfloat16_avx2(src, n, static_cast<unsigned char*>(dst));
        return;
    }
#endif
    to_wire_n_portable<Wire>(src, n, dst);
}

/// Host: dst[i] = the float value of the i-th 16-bit Wire value at src (2n bytes, any
/// alignment), exactly (NaN payloads kept, as float(Wire)). requires: dst does not overlap src.
template <class Wire>
void from_wire_n(const void* src, std::size_t n, float* dst) {
#if LOCKSTEP_F16_X86
    // bfloat16 -> float is a shift, which the portable loop vectorises as well as intrinsics.
    if constexpr (std::is_same_v<Wire, half>) {
        if (use_f16c()) {
            from_half_f16c(static_cast<const unsigned char*>(src), n, dst);
            return;
        }
    }
#endif
    from_wire_n_portable<Wire>(src, n, dst);
}

/// Host: as to_wire_n(const float*, ...) for double values, each rounded to float first (two
/// roundings: double -> float -> Wire), through a float tile on the stack.
template <class Wire>
void to_wire_n(const double* src, std::size_t n, void* dst) {
    constexpr std::size_t tile = 512;
    float f[tile];
    auto* out = static_cast<unsigned char*>(dst);
    for (std::size_t at = 0; at < n; at += tile) {
        const std::size_t m = n - at < tile ? n - at : tile;
        for (std::size_t i = 0; i < m; ++i)
            f[i] = static_cast<float>(src[at + i]);
        to_wire_n<Wire>(f, m, out + 2 * at);
    }
}

/// Host: as from_wire_n(..., float*) into double values (each exact: float -> double).
template <class Wire>
void from_wire_n(const void* src, std::size_t n, double* dst) {
    constexpr std::size_t tile = 512;
    float f[tile];
    const auto* in = static_cast<const unsigned char*>(src);
    for (std::size_t at = 0; at < n; at += tile) {
        const std::size_t m = n - at < tile ? n - at : tile;
        from_wire_n<Wire>(in + 2 * at, m, f);
        for (std::size_t i = 0; i < m; ++i)
            dst[at + i] = static_cast<double>(f[i]);
    }
}

/// Host, the reduction of compressed_all_reduce: for i < n, s_i = the float sum, in rank order
/// r = 0..ranks-1, of the i-th 16-bit Wire value of block r (block r at src + r * stride bytes);
/// out receives Wire(s_i) (16-bit values in memory order) and, for i < n_back, back[i] =
/// float(Wire(s_i)). Bit for bit the scalar conversions and float additions.
/// requires: n_back <= n; out overlaps neither src nor back.
template <class Wire>
void sum_wire_n(const void* src, std::size_t stride, int ranks, std::size_t n, void* out,
                float* back, std::size_t n_back) {
    const auto* in = static_cast<const unsigned char*>(src);
    auto* o = static_cast<unsigned char*>(out);
    std::size_t done = 0;
#if LOCKSTEP_F16_X86
    if (use_f16c())
        done = sum_wire_avx2<Wire>(in, stride, ranks, n, o, back, n_back);
#endif
    // Without AVX2 (and for the tail): tiles through local arrays, so every loop vectorises.
    constexpr std::size_t step = 512;
    float acc[step], next[step];
    for (std::size_t at = done; at < n; at += step) {
        const std::size_t m = n - at < step ? n - at : step;
        from_wire_n<Wire>(in + 2 * at, m, acc);
        for (int r = 1; r < ranks; ++r) {
            from_wire_n<Wire>(in + static_cast<std::size_t>(r) * stride + 2 * at, m, next);
            for (std::size_t i = 0; i < m; ++i)
                acc[i] += next[i];
        }
        to_wire_n<Wire>(acc, m, o + 2 * at);
        if (at < n_back)
            from_wire_n<Wire>(o + 2 * at, n_back - at < m ? n_back - at : m, back + at);
    }
}

} // namespace lockstep::detail

// lockstep/core/float16.hpp: half and bfloat16 16-bit storage types (wire formats of
// reduce::compressed) with round-to-nearest-even conversion. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <cstdint>
#include <cstring>

namespace lockstep {

namespace detail {

/// The bits of a float.
LOCKSTEP_HOST_DEVICE inline std::uint32_t float_bits(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
/// The float with these bits.
LOCKSTEP_HOST_DEVICE inline float bits_float(std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

/// IEEE binary16 bits of f, rounded to nearest, ties to even; overflow gives infinity, NaN
/// gives a quiet NaN, values at or below 2^-25 (half the smallest subnormal) give signed zero.
/// Few, predictable branches (F. Giesen's float_to_half_fast3_rtne): the normal range rounds
/// with integer adds, the subnormal range lets the FPU round (requires the default
/// round-to-nearest mode).
LOCKSTEP_HOST_DEVICE inline std::uint16_t float_to_half_bits(float f) {
    std::uint32_t x = float_bits(f);
    const std::uint32_t sign = x & 0x80000000u;
    x ^= sign;
    std::uint32_t o;
    if (x >= 0x47800000u) { // >= 65536, inf or NaN (65520..65536 carries into inf below)
        o = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x < 0x38800000u) { // below 2^-14: a half subnormal or zero
        // Adding 0.5 puts the 2^-24 units in the low mantissa bits, rounded by the FPU.
        o = float_bits(bits_float(x) + 0.5f) - 0x3f000000u;
    } else { // rebias 127 -> 15, add half an ulp minus one plus the kept lsb, drop 13 bits
        const std::uint32_t odd = (x >> 13) & 1u;
        o = (x + 0xc8000fffu + odd) >> 13;
    }
    return static_cast<std::uint16_t>(o | (sign >> 16));
}

/// The float value of IEEE binary16 bits (exact; NaN payloads kept).
LOCKSTEP_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) {
    std::uint32_t o = (static_cast<std::uint32_t>(h) & 0x7fffu) << 13; // exponent and mantissa
    const std::uint32_t e = o & 0x0f800000u;
    o += 0x38000000u; // rebias 15 -> 127
    if (e == 0x0f800000u)
        o += 0x38000000u; // inf or NaN: exponent 255
    else if (e == 0) {    // zero or subnormal: m * 2^-24 (exact float subtraction)
        o += 0x00800000u;
        o = float_bits(bits_float(o) - bits_float(0x38800000u));
    }
    return bits_float(o | ((static_cast<std::uint32_t>(h) & 0x8000u) << 16));
}

/// bfloat16 bits of f (the top 16 bits of the float), rounded to nearest, ties to even;
/// NaN stays NaN (quiet).
LOCKSTEP_HOST_DEVICE inline std::uint16_t float_to_bfloat16_bits(float f) {
    const std::uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return static_cast<std::uint16_t>((x >> 16) | 0x40u);
    const std::uint32_t lsb = (x >> 16) & 1u;
    return static_cast<std::uint16_t>((x + 0x7fffu + lsb) >> 16);
}

/// The float value of bfloat16 bits (exact).
LOCKSTEP_HOST_DEVICE inline float bfloat16_bits_to_float(std::uint16_t b) {
    return bits_float(static_cast<std::uint32_t>(b) << 16);
}

} // namespace detail

/// IEEE binary16 storage (1 sign, 5 exponent, 10 mantissa bits; max 65504, unit roundoff
/// 2^-11). Arithmetic happens in float: convert with float(h). Layout-compatible with CUDA's
/// __half, so device buffers of either may be reinterpreted.
struct half {
    std::uint16_t bits = 0;

    half() = default;
    /// Rounds f to nearest, ties to even.
    LOCKSTEP_HOST_DEVICE explicit half(float f) : bits(detail::float_to_half_bits(f)) {}
    LOCKSTEP_HOST_DEVICE explicit operator float() const {
        return detail::half_bits_to_float(bits);
    }
    /// The value with these bits.
    LOCKSTEP_HOST_DEVICE static half from_bits(std::uint16_t b) {
        half h;
        h.bits = b;
        return h;
    }
    /// Largest relative rounding error of a conversion from float (normal range).
    static constexpr double unit_roundoff = 1.0 / 2048.0;
    friend bool operator==(half, half) = default;
};

/// bfloat16 storage (1 sign, 8 exponent, 7 mantissa bits: float's range, unit roundoff 2^-8).
/// Layout-compatible with CUDA's __nv_bfloat16.
struct bfloat16 {
    std::uint16_t bits = 0;

    bfloat16() = default;
    /// Rounds f to nearest, ties to even.
    LOCKSTEP_HOST_DEVICE explicit bfloat16(float f) : bits(detail::float_to_bfloat16_bits(f)) {}
    LOCKSTEP_HOST_DEVICE explicit operator float() const {
        return detail::bfloat16_bits_to_float(bits);
    }
    /// The value with these bits.
    LOCKSTEP_HOST_DEVICE static bfloat16 from_bits(std::uint16_t b) {
        bfloat16 h;
        h.bits = b;
        return h;
    }
    /// Largest relative rounding error of a conversion from float.
    static constexpr double unit_roundoff = 1.0 / 256.0;
    friend bool operator==(bfloat16, bfloat16) = default;
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2,
              "lockstep::half and lockstep::bfloat16 must be 16-bit storage types.");

namespace detail {

/// The float -> Wire and Wire -> float element conversions, by type (half or bfloat16).
template <class Wire>
struct wire_codec;
template <>
struct wire_codec<half> {
    LOCKSTEP_HOST_DEVICE static std::uint16_t encode(float f) { return float_to_half_bits(f); }
    LOCKSTEP_HOST_DEVICE static float decode(std::uint16_t b) { return half_bits_to_float(b); }
};
template <>
struct wire_codec<bfloat16> {
    LOCKSTEP_HOST_DEVICE static std::uint16_t encode(float f) { return float_to_bfloat16_bits(f); }
    LOCKSTEP_HOST_DEVICE static float decode(std::uint16_t b) { return bfloat16_bits_to_float(b); }
};

} // namespace detail

/// True for the 16-bit wire types reduce::compressed accepts.
template <class T>
inline constexpr bool is_wire_float16_v = false;
template <>
inline constexpr bool is_wire_float16_v<half> = true;
template <>
inline constexpr bool is_wire_float16_v<bfloat16> = true;

} // namespace lockstep

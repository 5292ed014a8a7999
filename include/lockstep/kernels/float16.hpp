// lockstep/kernels/float16.hpp: half and bfloat16 16-bit storage types (wire formats of
// reduce::compressed) with round-to-nearest-even conversion. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <cstdint>
#include <cstring>

namespace lockstep {

namespace kernels {

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

/// IEEE binary16 bits of f, rounded to nearest, ties to even; overflow gives infinity,
/// NaN stays NaN (quiet), values below half the smallest subnormal (2^-25) give signed zero.
LOCKSTEP_HOST_DEVICE inline std::uint16_t float_to_half_bits(float f) {
    const std::uint32_t x = float_bits(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) // inf or NaN (keep NaN payload's top bits, force quiet)
        return static_cast<std::uint16_t>(sign | 0x7c00u |
                                          (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
    if (a >= 0x477ff000u) // >= 65520: rounds to infinity (65504 has an odd mantissa)
        return static_cast<std::uint16_t>(sign | 0x7c00u);
    if (a < 0x38800000u) { // below 2^-14: a half subnormal (or zero)
        if (a <= 0x33000000u)
            return static_cast<std::uint16_t>(sign); // <= 2^-25: ties to 0
        const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;
        const std::uint32_t shift = 126u - (a >> 23); // value / 2^-24 = mant >> shift
        std::uint32_t r = mant >> shift;
        const std::uint32_t rem = mant & ((1u << shift) - 1u);
        const std::uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (r & 1u)))
            ++r;
        return static_cast<std::uint16_t>(sign | r);
    }
    std::uint32_t r = (a - 0x38000000u) >> 13; // rebias 127 -> 15, drop 13 mantissa bits
    const std::uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u)))
        ++r; // a carry into the exponent is right
    return static_cast<std::uint16_t>(sign | r);
}

/// The float value of IEEE binary16 bits (exact).
LOCKSTEP_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) {
    const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
    const std::uint32_t e = (h >> 10) & 0x1fu;
    const std::uint32_t m = h & 0x3ffu;
    if (e == 0) { // zero or subnormal: m * 2^-24, exact in float
        const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31)
        return bits_float(sign | 0x7f800000u | (m << 13));
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
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

} // namespace kernels

/// IEEE binary16 storage (1 sign, 5 exponent, 10 mantissa bits; max 65504, unit roundoff
/// 2^-11). Arithmetic happens in float: convert with float(h). Layout-compatible with CUDA's
/// __half, so device buffers of either may be reinterpreted.
struct half {
    std::uint16_t bits = 0;

    half() = default;
    /// Rounds f to nearest, ties to even.
    LOCKSTEP_HOST_DEVICE explicit half(float f) : bits(kernels::float_to_half_bits(f)) {}
    LOCKSTEP_HOST_DEVICE explicit operator float() const {
        return kernels::half_bits_to_float(bits);
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
    LOCKSTEP_HOST_DEVICE explicit bfloat16(float f) : bits(kernels::float_to_bfloat16_bits(f)) {}
    LOCKSTEP_HOST_DEVICE explicit operator float() const {
        return kernels::bfloat16_bits_to_float(bits);
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

/// True for the 16-bit wire types reduce::compressed accepts.
template <class T>
inline constexpr bool is_wire_float16_v = false;
template <>
inline constexpr bool is_wire_float16_v<half> = true;
template <>
inline constexpr bool is_wire_float16_v<bfloat16> = true;

} // namespace lockstep

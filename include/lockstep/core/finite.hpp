// lockstep/core/finite.hpp: whether a float or double is finite or a NaN, read from its bits, on
// the host and in device code. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <bit>
#include <cstdint>

namespace lockstep {

// Every finiteness test of lockstep is one of these. The headers compile with the user's flags,
// and -ffinite-math-only (part of -ffast-math) lets the compiler fold std::isfinite, std::isnan,
// x != x and x - x == 0 to constants; the exponent bits cannot be folded away.

/// True when x is neither NaN nor infinite (its exponent field is not all ones).
LOCKSTEP_HOST_DEVICE constexpr bool is_finite(float x) noexcept {
    return (std::bit_cast<std::uint32_t>(x) & 0x7f800000u) != 0x7f800000u;
}
LOCKSTEP_HOST_DEVICE constexpr bool is_finite(double x) noexcept {
    return (std::bit_cast<std::uint64_t>(x) & 0x7ff0000000000000u) != 0x7ff0000000000000u;
}

/// True when x is a NaN (exponent field all ones, mantissa not zero).
LOCKSTEP_HOST_DEVICE constexpr bool is_nan(float x) noexcept {
    return (std::bit_cast<std::uint32_t>(x) & 0x7fffffffu) > 0x7f800000u;
}
LOCKSTEP_HOST_DEVICE constexpr bool is_nan(double x) noexcept {
    return (std::bit_cast<std::uint64_t>(x) & 0x7fffffffffffffffu) > 0x7ff0000000000000u;
}

} // namespace lockstep

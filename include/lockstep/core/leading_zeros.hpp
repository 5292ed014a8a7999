// lockstep/core/leading_zeros.hpp: the leading zero bits of a 64-bit word, the same on the host
// and in CUDA device code. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <bit>
#include <cstdint>

namespace lockstep {

/// The leading zero bits of x (64 for 0), on the host and in device code. Functors that run on
/// both systems call this, never std::countl_zero: nvcc 13.0 with libstdc++ compiles
/// std::countl_zero(std::uint64_t) in a kernel to the constant 64 (and std::bit_width to 0,
/// std::countr_zero to 64) without a diagnostic, since their 64-bit builtins have no device form.
LOCKSTEP_HOST_DEVICE inline int countl_zero64(std::uint64_t x) noexcept {
#if defined(__CUDA_ARCH__)
    return __clzll(static_cast<long long>(x));
#else
    return std::countl_zero(x);
#endif
}

} // namespace lockstep

// lockstep/core/checked_math.hpp: overflow-checked size arithmetic (element counts, byte sizes,
// shape products) that throws lockstep::error instead of wrapping. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace lockstep {

/// True when a * b overflows std::size_t; otherwise stores the product in *out. The one
/// overflow test every checked size product in lockstep goes through (the throwing helpers
/// below included; kernels::checked_size checks a channel_geometry's size with them).
constexpr bool mul_overflows(std::size_t a, std::size_t b, std::size_t* out) noexcept {
    return __builtin_mul_overflow(a, b, out);
}

/// a * b as std::size_t. ensures: the exact product, or throws lockstep::error
/// (errc::invalid_argument) naming `replica`, `operation`, `what` and both factors when the
/// product does not fit in std::size_t.
inline std::size_t checked_mul(std::size_t a, std::size_t b, int replica,
                               const std::string& operation, const std::string& what) {
    std::size_t r = 0;
    if (mul_overflows(a, b, &r))
        fail(errc::invalid_argument, replica, operation, what, ": ", a, " * ", b,
             " overflows std::size_t (max ", static_cast<std::size_t>(-1), ")");
    return r;
}

/// a + b as std::size_t. ensures: the exact sum, or throws lockstep::error
/// (errc::invalid_argument) naming `replica`, `operation`, `what` and both terms on overflow.
inline std::size_t checked_add(std::size_t a, std::size_t b, int replica,
                               const std::string& operation, const std::string& what) {
    std::size_t r = 0;
    if (__builtin_add_overflow(a, b, &r))
        fail(errc::invalid_argument, replica, operation, what, ": ", a, " + ", b,
             " overflows std::size_t (max ", static_cast<std::size_t>(-1), ")");
    return r;
}

/// The product of every extent of `shape` (1 for an empty shape). ensures: the exact product,
/// or throws lockstep::error (errc::invalid_argument) naming the operation and the shape when a
/// partial product overflows std::size_t.
template <class Range>
std::size_t checked_product(const Range& shape, int replica, const std::string& operation,
                            const std::string& what) {
    std::size_t n = 1;
    for (const auto e : shape) {
        std::size_t r = 0;
        if (mul_overflows(n, static_cast<std::size_t>(e), &r)) {
            std::string s = "{";
            bool first = true;
            for (const auto x : shape) {
                s += (first ? "" : ", ") + std::to_string(static_cast<std::size_t>(x));
                first = false;
            }
            fail(errc::invalid_argument, replica, operation, what, " of shape ", s,
                 "}: the product of the extents overflows std::size_t");
        }
        n = r;
    }
    return n;
}

/// n elements of `elem_size` bytes as a byte count. ensures: n * elem_size, or throws
/// lockstep::error (errc::invalid_argument) when it overflows or exceeds PTRDIFF_MAX (no object
/// can be that large).
inline std::size_t checked_bytes(std::size_t n, std::size_t elem_size, int replica,
                                 const std::string& operation, const std::string& what) {
    const std::size_t bytes = checked_mul(n, elem_size, replica, operation, what);
    if (bytes > static_cast<std::size_t>(PTRDIFF_MAX))
        fail(errc::invalid_argument, replica, operation, what, ": ", n, " elements of ", elem_size,
             " bytes (", bytes,
             " bytes) exceed the largest object size (PTRDIFF_MAX = ", PTRDIFF_MAX, " bytes)");
    return bytes;
}

} // namespace lockstep

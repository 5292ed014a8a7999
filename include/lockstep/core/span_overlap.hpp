// lockstep/core/span_overlap.hpp: whether two spans share memory (the kernels read their inputs
// through restrict pointers, so an output that aliases an input is undefined behaviour).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace lockstep::detail {

/// Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte (an empty range
/// shares none). Addresses are compared as integers, so they may be of any memory.
inline bool bytes_overlap(const void* a, std::size_t a_bytes, const void* b,
                          std::size_t b_bytes) noexcept {
    const auto a0 = reinterpret_cast<std::uintptr_t>(a);
    const auto b0 = reinterpret_cast<std::uintptr_t>(b);
    return a_bytes != 0 && b_bytes != 0 && a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

/// "a and b overlap (sizes and addresses)" when spans `a` and `b` (named in the text) share a
/// byte, or "" when they do not (an empty span shares nothing). Addresses are compared as
/// integers, so the spans may live in any memory (host or device).
template <class A, class B>
std::string overlap_text(std::span<A> a, const char* a_name, std::span<B> b, const char* b_name) {
    if (!bytes_overlap(a.data(), a.size_bytes(), b.data(), b.size_bytes()))
        return {};
    return concat(a_name, " and ", b_name, " overlap (", a.size(), " and ", b.size(), " values at ",
                  static_cast<const void*>(a.data()), " and ", static_cast<const void*>(b.data()),
                  ")");
}

/// overlap_text for an operation without an in-place form, with the fix: "" or "... overlap
/// (...): in-place use is not supported, give <b_name> its own buffer".
template <class A, class B>
std::string overlap_problem(std::span<A> a, const char* a_name, std::span<B> b,
                            const char* b_name) {
    std::string text = overlap_text(a, a_name, b, b_name);
    if (!text.empty())
        text += concat(": in-place use is not supported, give ", b_name, " its own buffer");
    return text;
}

} // namespace lockstep::detail

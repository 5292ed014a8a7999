// lockstep/comm/detail/span_checks.hpp: the checks every communicator applies to a span before it
// communicates (null data with a non-zero count, more elements than memory can hold).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

namespace lockstep::detail {

/// The largest element count of T an object can hold (its bytes fit in ptrdiff_t).
template <class T>
constexpr std::size_t max_span_elements() noexcept {
    return static_cast<std::size_t>(PTRDIFF_MAX) / sizeof(T);
}

/// What is wrong with span `s` (named `what` in the text), or "" when it is usable: a null
/// pointer with a non-zero count, or more elements than fit in memory.
template <class T>
std::string span_problem(std::span<T> s, const char* what) {
    if (s.data() == nullptr && !s.empty())
        return std::string(what) + " is a null pointer with " + std::to_string(s.size()) +
               " elements";
    if (s.size() > max_span_elements<T>())
        return std::string(what) + " claims " + std::to_string(s.size()) + " elements of " +
               std::to_string(sizeof(T)) + " bytes, more than memory can hold (at most " +
               std::to_string(max_span_elements<T>()) + ")";
    return {};
}

/// "a; b" of the non-empty problems.
inline std::string join_problems(std::initializer_list<std::string> problems) {
    std::string s;
    for (const auto& p : problems)
        if (!p.empty())
            s += (s.empty() ? "" : "; ") + p;
    return s;
}

} // namespace lockstep::detail

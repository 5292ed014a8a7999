// tests/support/contains.hpp: contains(text, part), whether a message holds a phrase (the tests'
// checks of error messages). Test support, not public API. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <string_view>

namespace lockstep_test {

/// True when `part` occurs in `text`.
inline bool contains(std::string_view text, std::string_view part) {
    return text.find(part) != std::string_view::npos;
}

} // namespace lockstep_test

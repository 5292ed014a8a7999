// lockstep/comm/detail/split_label.hpp: split_label, the name a split communicator's messages
// and traces give it. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <string>

namespace lockstep::detail {

/// "split(color=c)" after the parent's label and " / " (nothing for the whole group): what
/// errors and flight-recorder dumps name a split's operations by, e.g. "all_gather #3 in
/// split(color=1)" or, for a split of a split, "split(color=0) / split(color=1)".
inline std::string split_label(const std::string& parent, int color) {
    return (parent.empty() ? "" : parent + " / ") + "split(color=" + std::to_string(color) + ")";
}

} // namespace lockstep::detail

// lockstep/comm/collective_event.hpp: collective_event, what a thread_group's fault-injection
// hook (thread_group_params::on_collective) is told at two moments of every collective.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <string_view>

namespace lockstep {

/// One moment of one replica's collective, as thread_group_params::on_collective sees it.
struct collective_event {
    enum class moment {
        entered, ///< the replica called the collective; nothing is published yet
        arrived  ///< it has arrived at the first phase (peers can see it) and not yet waited
    };
    moment when = moment::entered;
    int replica = 0;    ///< the replica's index in the thread_group (thread_communicator::replica)
    int rank = 0;       ///< its rank in the group the collective runs in
    int generation = 0; ///< the group's generation: 0, then + 1 at every shrink
    std::uint64_t seq = 0;       ///< the collective's sequence number in that group
    std::string_view collective; ///< "all_reduce", "barrier", ...
    std::string_view label;      ///< "" for the whole group, else the split's ("split(color=1)")
    std::string_view tag;        ///< the call's collective_tag name or call site ("" for none)
};

} // namespace lockstep

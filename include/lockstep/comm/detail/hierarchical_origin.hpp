// lockstep/comm/detail/hierarchical_origin.hpp: hierarchical_origin, whom and what a hierarchical
// communicator's errors name (this replica in the group first split, the splits since, the part
// that failed). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/hierarchical_call.hpp"
#include "lockstep/comm/detail/split_label.hpp"
#include "lockstep/core/error.hpp"

#include <cstddef>
#include <string>
#include <string_view>

namespace lockstep::detail {

/// This replica in the group first split (the unsplit one's own rank, node and local rank), and
/// "" or the splits since ("split(color=1)", " / " between): what a hierarchical communicator's
/// errors name, since a split group's own ranks are not the job's.
struct hierarchical_origin {
    int rank = 0;
    int node = 0;
    int local = 0;
    std::string label;

    /// The origin of a group split from this one with `color`: the same replica, the split added
    /// to the label.
    hierarchical_origin split(int color) const {
        hierarchical_origin child = *this;
        child.label = split_label(label, color);
        return child;
    }

    /// A lockstep::error `e` that one step of a collective threw on a part (`intra`: the
    /// intra-node part, else the inter-node one), which names the part's own replica numbers
    /// (MPI: process ranks), sequence numbers and the step's counts, as thrown again: with its
    /// code, naming this replica's rank, node and local rank (in a split group also `split_rank`,
    /// its rank there, and the split in the operation) and what the caller passed (`call`), the
    /// part's text and then `hint` as the detail.
    [[noreturn]] void rethrow(const error& e, const hierarchical_call& call, bool intra,
                              int split_rank, const std::string& hint) const {
        const bool split = !label.empty();
        throw error(
            e.code(), rank,
            std::string("hierarchical_communicator.") + call.op + (split ? " in " + label : ""),
            concat("this replica (node ", node, ", local rank ", local,
                   split ? concat("; replica ", split_rank, " of the split") : std::string(),
                   ") called it with ", call.describe(), "; its ",
                   intra ? "intra-node part (the communicator of node "
                         : "inter-node part (the communicator of local rank ",
                   intra ? node : local, intra ? ")" : " across the nodes)",
                   split ? ", split," : "", " failed: ", e.what(), hint));
    }
};

/// For an all_reduce's inter-node error (`intra` false) of differing collectives: which path
/// issues what (an all_reduce of at least `sharded_elements` = local_size() x sharded_from
/// elements begins with an all_gather across nodes); "" otherwise, and with one replica per node.
inline std::string hierarchical_path_hint(bool intra, const hierarchical_call& call, errc code,
                                          int local_size, std::size_t sharded_elements) {
    if (intra || code != errc::shape_mismatch || std::string_view(call.op) != "all_reduce" ||
        local_size == 1)
        return {};
    return concat(" (an all_reduce of at least local_size() x sharded_from = ", sharded_elements,
                  " elements begins with an all_gather of 5 int64 across nodes, the "
                  "callers' counts, where a smaller one all_reduces: the nodes passed "
                  "different counts or collectives)");
}

} // namespace lockstep::detail

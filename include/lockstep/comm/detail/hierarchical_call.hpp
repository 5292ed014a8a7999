// lockstep/comm/detail/hierarchical_call.hpp: what a caller passed to a hierarchical
// communicator's collective (hierarchical_call), as its errors name it and as the nodes compare
// it before any data moves. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/detail/fnv1a.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace lockstep::detail {

/// What the caller passed to a hierarchical collective.
struct hierarchical_call {
    const char* op = "";        ///< "all_reduce"
    std::size_t count = 0;      ///< elements of send (broadcast: of data)
    const char* type = "";      ///< trace_type_name<T>()
    std::string_view reduction; ///< to_string(reduce_op), or empty
    int root = -1;              ///< broadcast and reduce, else -1

    /// "8192 float32 (sum)" or "3 int32 (root 2)".
    std::string describe() const {
        std::string out = std::to_string(count) + " " + type;
        if (!reduction.empty())
            out += " (" + std::string(reduction) + ")";
        else if (root >= 0)
            out += " (root " + std::to_string(root) + ")";
        return out;
    }

    /// The 5 values the nodes compare: {count, layout (a hash of reduce_scatter's per-replica
    /// counts, else 0), element type, reduction, root} (hashes: positive 63-bit FNV-1a).
    std::array<std::int64_t, 5> key(std::int64_t layout) const {
        const std::string_view t(type);
        return {static_cast<std::int64_t>(count), layout, fnv(t.data(), t.size()),
                reduction.empty() ? 0 : fnv(reduction.data(), reduction.size()), root};
    }

    /// The layout value of reduce_scatter's per-replica counts.
    static std::int64_t counts_hash(std::span<const std::size_t> counts) noexcept {
        return counts.empty() ? 0 : fnv(counts.data(), counts.size_bytes());
    }

    static std::int64_t fnv(const void* data, std::size_t bytes) noexcept {
        return static_cast<std::int64_t>(fnv1a_bytes(data, bytes) >> 1);
    }
};

/// After the nodes all_gathered their key()s (`all`: node-major, 5 values each): returns when
/// every node passed `mine`; else throws lockstep::error on this replica (`rank`: its place in
/// the whole communicator, at `local_rank` of `node`, nodes of `local_size` replicas):
/// errc::count_mismatch (counts) or errc::shape_mismatch (type, reduction, root), naming this
/// replica's call and the first node whose call differs.
inline void require_same_call(const hierarchical_call& call,
                              const std::array<std::int64_t, 5>& mine,
                              std::span<const std::int64_t> all, int rank, int node, int local_rank,
                              int local_size) {
    const bool scatter = call.op == std::string_view("reduce_scatter");
    for (std::size_t j = 0; j < all.size() / mine.size(); ++j) {
        const std::span<const std::int64_t> theirs = all.subspan(j * mine.size(), mine.size());
        if (std::equal(mine.begin(), mine.end(), theirs.begin()))
            continue;
        std::string what;
        if (theirs[0] != mine[0])
            what += std::to_string(theirs[0]) + " elements";
        else if (theirs[1] != mine[1])
            what += "other per-replica counts";
        if (theirs[2] != mine[2])
            what += std::string(what.empty() ? "" : ", ") + "another element type";
        if (theirs[3] != mine[3])
            what += std::string(what.empty() ? "" : ", ") + "another reduction";
        if (theirs[4] != mine[4])
            what += std::string(what.empty() ? "" : ", ") + "root " + std::to_string(theirs[4]);
        const bool counts = theirs[0] != mine[0] || theirs[1] != mine[1];
        fail(counts ? errc::count_mismatch : errc::shape_mismatch, rank,
             std::string("hierarchical_communicator.") + call.op,
             "the nodes passed different arguments: this replica (node ", node, ", local rank ",
             local_rank, ") passed ", call.describe(), scatter ? " with its counts" : "",
             ", the replica at local rank ", local_rank, " of node ", j, " (replica ",
             static_cast<int>(j) * local_size + local_rank, ") passed ", what,
             "; every replica must pass the same count", scatter ? "s" : "",
             ", element type, reduction and root");
    }
}

} // namespace lockstep::detail

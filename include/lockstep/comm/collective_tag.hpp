// lockstep/comm/collective_tag.hpp: collective_tag, an optional caller-chosen name that verified
// collectives compare across replicas. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <string_view>

namespace lockstep {

/// The caller's name for one collective call ("bucket 3", "trainer.finish"). thread_communicator
/// and mpi_communicator (with verification) take it as an optional last argument of all_reduce,
/// broadcast and all_gather and compare it across replicas with the collective, element type,
/// count, reduction and root: replicas that pass different tags at the same sequence number all
/// throw errc::shape_mismatch naming every replica's call. That is the only way to catch two
/// calls of the same shape issued in a different order (or one skipped) on some replica: without
/// tags they pair with each other and return a wrong value. An empty name is "no tag"; untagged
/// calls pair only with untagged ones.
/// requires: name outlives the call (a string literal is the usual case).
struct collective_tag {
    std::string_view name;

    /// A positive 63-bit FNV-1a hash of name, 0 for no tag (what mpi_communicator exchanges).
    constexpr std::int64_t id() const noexcept {
        if (name.empty())
            return 0;
        std::uint64_t h = 14695981039346656037ull;
        for (char c : name) {
            h ^= static_cast<unsigned char>(c);
            h *= 1099511628211ull;
        }
        const auto v = static_cast<std::int64_t>(h >> 1);
        return v == 0 ? 1 : v;
    }
};

} // namespace lockstep

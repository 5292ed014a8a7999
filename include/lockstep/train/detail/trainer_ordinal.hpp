// lockstep/train/detail/trainer_ordinal.hpp: trainer_ordinal, which trainer built on a
// communicator object this one is (1, 2, ...), so that the replicas can check that they step
// the same trainer in each collective step.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/core/error.hpp"

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace lockstep::detail {

/// The ordinal of the next trainer constructed on the communicator whose identity is `identity`
/// (communicator_identity::value()): 1 for the first, 2 for the second, ... counted in this
/// process since the communicator was made (thread-safe: thread replicas construct theirs
/// concurrently, each on its own communicator object).
/// ensures: >= 1, a new value on each call for one identity. The registry keeps one entry per
/// identity that ever had a trainer (identities are never reused).
inline std::uint64_t next_trainer_ordinal(std::uint64_t identity) {
    static std::mutex guard;
    static std::unordered_map<std::uint64_t, std::uint64_t> built;
    const std::lock_guard<std::mutex> lock(guard);
    return ++built[identity];
}

/// The ordinal a trainer constructed now on `comm` gets: next_trainer_ordinal(comm.identity())
/// for an identified_communicator, else 0 (unchecked). Trainer construction is collective, so
/// every replica constructs its trainers on its communicator in the same order and gives the
/// same trainer the same ordinal; the step's checks compare it (a replica that steps another
/// trainer than its peers in the same collective step fails on every replica instead of mixing
/// the two trainers' gradients).
template <class Communicator>
std::uint64_t trainer_ordinal(const Communicator& comm) {
    if constexpr (identified_communicator<Communicator>)
        return next_trainer_ordinal(comm.identity());
    else
        return 0;
}

/// The text of a disagreement on the trainer stepped: "replica `r` stepped trainer #`theirs` on
/// this communicator while replica 0 stepped trainer #`first`: every replica must step its
/// trainers in the same order".
inline std::string trainer_order_text(int r, double theirs, double first) {
    return concat("replica ", r, " stepped trainer #", static_cast<std::uint64_t>(theirs),
                  " on this communicator while replica 0 stepped trainer #",
                  static_cast<std::uint64_t>(first),
                  ": every replica must step its trainers in the same order");
}

} // namespace lockstep::detail

// lockstep/train/detail/finish_check.hpp: finish_steps, the end-of-training collective that
// makes uneven step counts an error on every replica. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/host_collective.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::detail {

/// The tag of finish's collective, so that a verifying communicator tells it apart from a
/// step's collective of the same shape on a replica that trains on.
inline constexpr collective_tag finish_tag{"data_parallel.finish"};

/// Every replica's step count, gathered in one all_reduce (slot r holds replica r's count;
/// doubles count exactly up to 2^53 steps). Tagged where the communicator takes a tag.
template <class Communicator>
std::vector<double> gather_steps(Communicator& comm, std::int64_t steps) {
    std::vector<double> counts(static_cast<std::size_t>(comm.size()), 0.0);
    counts[static_cast<std::size_t>(comm.rank())] = static_cast<double>(steps);
    const std::span<const double> send(counts);
    const std::span<double> recv(counts);
    if constexpr (requires { comm.all_reduce(send, recv, reduce_op::sum, finish_tag); })
        comm.all_reduce(send, recv, reduce_op::sum, finish_tag);
    else
        host_all_reduce(comm, send, recv, reduce_op::sum);
    return counts;
}

/// data_parallel::finish: returns `steps` when every replica ran that many; else throws
/// lockstep::error (errc::count_mismatch, operation "data_parallel.finish") on every replica
/// naming each replica's count. A replica that calls it while a peer is still in a step meets
/// the peer's step collective instead: a verifying communicator (threads, MPI with verify) then
/// throws on both sides naming the two calls, rethrown here as "data_parallel.finish" with this
/// replica's count; without verification (NCCL) the mismatch is undefined there and usually
/// ends in the peers' timeout.
template <class Communicator>
std::int64_t finish_steps(Communicator& comm, std::int64_t steps) {
    const int me = comm.rank();
    std::vector<double> counts;
    try {
        counts = gather_steps(comm, steps);
    } catch (const error& e) {
        if (e.code() != errc::shape_mismatch && e.code() != errc::invalid_argument &&
            e.code() != errc::count_mismatch)
            throw;
        // The communicator's message without its "lockstep error [...] replica R: " prefix.
        std::string inner = e.what();
        const std::string own = "replica " + std::to_string(me) + ": ";
        if (const auto at = inner.find(own); at != std::string::npos)
            inner.erase(0, at + own.size());
        fail(e.code(), me, "data_parallel.finish", "this replica finished after ", steps,
             " step(s) while another replica issued a different collective (it is still "
             "training, or finished at another point): ",
             inner);
    }
    const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end());
    if (*lo == *hi)
        return steps;
    std::string each;
    for (std::size_t j = 0; j < counts.size(); ++j)
        each += (j == 0 ? "" : ", ") + std::string("replica ") + std::to_string(j) + " ran " +
                std::to_string(static_cast<std::int64_t>(counts[j]));
    fail(errc::count_mismatch, me, "data_parallel.finish",
         "replicas ran different numbers of steps: ", each);
}

} // namespace lockstep::detail

// lockstep/train/detail/global_batch_check.hpp: the replicas compare the global batch before a
// step whose collectives depend on it (reduce::reproducible: its chunk count).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::detail {

/// Every replica's global batch, compared before the first collective that depends on it: one
/// all_gather of one value per replica. A replica that passed another value makes every replica
/// throw lockstep::error (invalid_argument, what the synchronous step's status check throws)
/// naming each replica's value, instead of a count mismatch in the exchange that follows.
/// Host systems only (thread group, MPI): there the value is on the host and the all_gather
/// costs a few microseconds. NCCL verifies nothing: on a device system the check is not made,
/// and replicas that disagree there exchange mismatched collectives (undefined, as with any
/// NCCL call whose counts differ). why() says what depends on it, for the message (called only
/// then).
template <communicator Comm, class Why>
void check_same_global_batch(Comm& comm, std::size_t global, std::int64_t step, Why why) {
    if constexpr (Comm::system_type::is_host) {
        const int n = comm.size();
        const double mine = static_cast<double>(global);
        std::vector<double> all(static_cast<std::size_t>(n));
        comm.all_gather(std::span<const double>(&mine, 1), std::span<double>(all));
        bool same = true;
        for (const double g : all)
            same = same && g == all[0];
        if (same)
            return;
        std::string values;
        for (int r = 0; r < n; ++r)
            values += concat(r == 0 ? " " : ", ",
                             static_cast<std::uint64_t>(all[static_cast<std::size_t>(r)]),
                             " on replica ", r);
        fail(errc::invalid_argument, comm.rank(), "data_parallel.step", "step ", step,
             ": the replicas disagree: global_batch:", values, " (", why(), ")");
    } else {
        (void)comm;
        (void)global;
        (void)step;
        (void)why;
    }
}

} // namespace lockstep::detail

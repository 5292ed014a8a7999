// lockstep/train/detail/global_batch_check.hpp: the replicas compare the global batch before a
// step whose collectives depend on it (reduce::reproducible: its chunk count).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::detail {

/// Every replica's global batch, compared before the first collective that depends on it by one
/// all_gather of one value: a replica that passed another value makes every replica throw
/// lockstep::error (invalid_argument) naming each replica's value, instead of a count mismatch in
/// the exchange that follows. Host systems only, where the value is on the host and the check
/// costs microseconds; on a device system (NCCL) replicas that disagree exchange mismatched
/// collectives, undefined as with any NCCL call whose counts differ. chunk: reduce::reproducible's
/// chunk samples, which make the exchange depend on the global batch.
template <communicator Comm>
void check_same_global_batch(Comm& comm, std::size_t global, std::int64_t step, std::size_t chunk) {
    if constexpr (!Comm::system_type::is_host)
        return;
    const int n = comm.size();
    const double mine = static_cast<double>(global);
    std::vector<double> all(static_cast<std::size_t>(n));
    comm.all_gather(std::span<const double>(&mine, 1), std::span<double>(all));
    if (std::all_of(all.begin(), all.end(), [&](double g) { return g == all[0]; }))
        return;
    std::string values;
    for (int r = 0; r < n; ++r)
        values +=
            concat(r == 0 ? " " : ", ",
                   static_cast<std::uint64_t>(all[static_cast<std::size_t>(r)]), " on replica ", r);
    fail(errc::invalid_argument, comm.rank(), "data_parallel.step", "step ", step,
         ": the replicas disagree: global_batch:", values, " (reduce::reproducible cuts it",
         " into chunks of ", chunk, " samples; every replica must exchange as many)");
}

} // namespace lockstep::detail

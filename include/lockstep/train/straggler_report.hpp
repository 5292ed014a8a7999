// lockstep/train/straggler_report.hpp: straggler_report (train_params::report_stragglers_every):
// which replica the others waited for over a window of steps, and for how long.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <vector>

namespace lockstep {

/// Every replica's own time per step over a window of steps, and the replica the others waited
/// for. A replica's own time is what it spends between its collectives, from the end of one to
/// its arrival at the next (on the host, its communicator's flight_recorder::between_ns; on
/// NCCL, its stream's device time, nccl_communicator::device_between_ns): the all_reduce of
/// a synchronous step evens out the wall-clock step times, but not this, and no clock sync is
/// needed. One all_gather of one double per replica makes the report, the same on every replica.
struct straggler_report {
    /// The window: steps [first_step, last_step] (0-based). The first step a trainer runs is
    /// in no window (its time includes what the program did before it), so the first window
    /// starts one step later.
    std::int64_t first_step = 0;
    std::int64_t last_step = 0;
    int slowest = -1; ///< the replica with the most own time per step (the lowest rank on a tie)
    double lag_seconds = 0.0; ///< its own time per step minus the median of the other replicas'
    std::vector<double> own_seconds; ///< every replica's own time per step, in rank order
};

} // namespace lockstep

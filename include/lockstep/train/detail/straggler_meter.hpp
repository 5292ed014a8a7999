// lockstep/train/detail/straggler_meter.hpp: straggler_meter, which makes a straggler_report
// every train_params::report_stragglers_every steps from the communicator's timing of the
// replica's work between collectives (on the host, or on its device).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/straggler_report.hpp"

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace lockstep::detail {

/// A communicator whose flight recorder times a replica's work between its collectives on the
/// host (the thread group, MPI).
template <class Communicator>
concept host_timed_communicator = Communicator::system_type::is_host &&
    requires(const Communicator& c) {
    { c.trace().between_ns() } -> std::convertible_to<std::int64_t>;
};

/// A communicator that times the replica's work between its collectives on its device
/// (nccl_communicator: CUDA events on its stream; host enqueue times cannot see a slow GPU),
/// once asked to; synchronize() waits for the stream, after which every gap is counted.
template <class Communicator>
concept device_timed_communicator = requires(Communicator& c) {
    c.time_between_on_device();
    { c.device_between_ns() } -> std::convertible_to<std::int64_t>;
    c.synchronize();
};

/// The reports of train_params::report_stragglers_every = K: after every K-th step, every
/// replica's own time per step since the last report, gathered. The first step a trainer runs
/// is not measured: its time from the trainer's last collective includes whatever the program
/// did before its first step (loading data, warming up), which is no step's work. Nor is the
/// first step after the step count went back (load_checkpoint of an earlier step): the window
/// starts again there.
class straggler_meter {
public:
    /// requires: every >= 0 (0: off); every > 0 only on a host_timed_communicator or a
    /// device_timed_communicator (else errc::unsupported, naming the communicator's limit),
    /// whose device timing this turns on.
    template <class Communicator>
    straggler_meter(Communicator& comm, std::int64_t every) : every_(every) {
        LOCKSTEP_REQUIRE(every >= 0, errc::invalid_argument, comm.rank(), "data_parallel",
                         "report_stragglers_every = ", every, " (must be >= 0; 0 is off)");
        if constexpr (device_timed_communicator<Communicator>) {
            if (every > 0)
                comm.time_between_on_device();
        } else if constexpr (!host_timed_communicator<Communicator>) {
            LOCKSTEP_REQUIRE(every == 0, errc::unsupported, comm.rank(), "data_parallel",
                             "report_stragglers_every = ", every,
                             ": this communicator's collectives are not timed (the thread group "
                             "and MPI time them on the host, nccl_communicator on its device; "
                             "host enqueue times cannot see a slow GPU): use 0");
        }
    }

    /// After `steps` steps in all: the report over the steps since the last one, every K-th
    /// step (collective: one all_gather on comm), else nothing. On a device-timed communicator
    /// the first step and each report wait for the stream (the gaps are read when complete).
    template <class Communicator>
    void after_step(Communicator& comm, std::int64_t steps) {
        if constexpr (host_timed_communicator<Communicator> ||
                      device_timed_communicator<Communicator>) {
            if (every_ == 0)
                return;
            // The first step this trainer ran (a resumed one starts past 0), or the first after
            // steps() went back (a checkpoint of an earlier step loaded): a window from first_
            // would be empty or negative.
            if (first_ < 0 || steps <= first_) {
                first_ = steps;
                base_ns_ = between_ns(comm, true);
                return;
            }
            if (steps % every_ != 0)
                return;
            const std::int64_t window = steps - first_; // >= 1: the first step only begins one
            const double own = static_cast<double>(between_ns(comm, true) - base_ns_) * 1e-9 /
                               static_cast<double>(window);
            straggler_report r{first_, steps - 1, -1, 0.0,
                               std::vector<double>(static_cast<std::size_t>(comm.size()))};
            host_all_gather(comm, std::span<const double>(&own, 1),
                            std::span<double>(r.own_seconds));
            r.slowest =
                static_cast<int>(std::max_element(r.own_seconds.begin(), r.own_seconds.end()) -
                                 r.own_seconds.begin());
            std::vector<double> others;
            for (std::size_t j = 0; j < r.own_seconds.size(); ++j)
                if (static_cast<int>(j) != r.slowest)
                    others.push_back(r.own_seconds[j]);
            std::sort(others.begin(), others.end());
            const std::size_t h = others.size() / 2;
            const double median = others.empty()      ? r.own_seconds[0]
                                  : others.size() % 2 ? others[h]
                                                      : (others[h - 1] + others[h]) / 2;
            r.lag_seconds = r.own_seconds[static_cast<std::size_t>(r.slowest)] - median;
            last_ = std::move(r);
            first_ = steps;
            // The gather's own wait is no one's work (on a device, it waited for its result: the
            // gap before it is complete).
            base_ns_ = between_ns(comm, false);
        }
    }

    /// The latest report (empty before the first).
    const std::optional<straggler_report>& last() const noexcept { return last_; }

private:
    /// The replica's time between collectives so far; `wait`: on a device, first wait for the
    /// stream, so that every gap enqueued is counted.
    template <class Communicator>
    static std::int64_t between_ns(Communicator& comm, bool wait) {
        if constexpr (device_timed_communicator<Communicator>) {
            if (wait)
                comm.synchronize();
            return comm.device_between_ns();
        } else {
            return comm.trace().between_ns();
        }
    }

    std::int64_t every_;
    std::int64_t first_ = -1;  ///< the first step of the current window (-1: no step ran yet)
    std::int64_t base_ns_ = 0; ///< between_ns() when the window began
    std::optional<straggler_report> last_;
};

} // namespace lockstep::detail

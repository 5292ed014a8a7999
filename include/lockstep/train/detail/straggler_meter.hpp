// lockstep/train/detail/straggler_meter.hpp: straggler_meter, which makes a straggler_report
// every train_params::report_stragglers_every steps from the communicator's flight recorder.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/straggler_report.hpp"

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace lockstep::detail {

/// A communicator whose flight recorder times a replica's work between its collectives on the
/// host (the thread group, MPI): NCCL's host enqueue times cannot see a slow GPU.
template <class Communicator>
concept host_timed_communicator = Communicator::system_type::is_host &&
    requires(const Communicator& c) {
    { c.trace().between_ns() } -> std::convertible_to<std::int64_t>;
};

/// The reports of train_params::report_stragglers_every = K: after every K-th step, every
/// replica's own time per step since the last report, gathered. The first step a trainer runs
/// is not measured: its time from the trainer's last collective includes whatever the program
/// did before its first step (loading data, warming up), which is no step's work.
class straggler_meter {
public:
    /// requires: every >= 0 (0: off); every > 0 only on a host_timed_communicator (else
    /// errc::unsupported, naming the communicator's limit).
    template <class Communicator>
    straggler_meter(const Communicator& comm, std::int64_t every) : every_(every) {
        LOCKSTEP_REQUIRE(every >= 0, errc::invalid_argument, comm.rank(), "data_parallel",
                         "report_stragglers_every = ", every, " (must be >= 0; 0 is off)");
        if constexpr (!host_timed_communicator<Communicator>)
            LOCKSTEP_REQUIRE(every == 0, errc::unsupported, comm.rank(), "data_parallel",
                             "report_stragglers_every = ", every,
                             ": this communicator's collectives are not timed on the host (the "
                             "thread group and MPI are; on a GPU, host enqueue times cannot see a "
                             "slow device): use 0");
    }

    /// After `steps` steps in all: the report over the steps since the last one, every K-th
    /// step (collective: one all_gather on comm), else nothing.
    template <class Communicator>
    void after_step(Communicator& comm, std::int64_t steps) {
        if constexpr (host_timed_communicator<Communicator>) {
            if (every_ == 0)
                return;
            if (first_ < 0) { // the first step this trainer ran (a resumed one starts past 0)
                first_ = steps;
                base_ns_ = comm.trace().between_ns();
                return;
            }
            if (steps % every_ != 0)
                return;
            const std::int64_t window = steps - first_; // >= 1: the first step only begins one
            const double own = static_cast<double>(comm.trace().between_ns() - base_ns_) * 1e-9 /
                               static_cast<double>(window);
            straggler_report r{first_, steps - 1, -1, 0.0,
                               std::vector<double>(static_cast<std::size_t>(comm.size()))};
            comm.all_gather(std::span<const double>(&own, 1), std::span<double>(r.own_seconds));
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
            base_ns_ = comm.trace().between_ns(); // the gather's own wait is no one's work
        }
    }

    /// The latest report (empty before the first).
    const std::optional<straggler_report>& last() const noexcept { return last_; }

private:
    std::int64_t every_;
    std::int64_t first_ = -1;  ///< the first step of the current window (-1: no step ran yet)
    std::int64_t base_ns_ = 0; ///< between_ns() when the window began
    std::optional<straggler_report> last_;
};

} // namespace lockstep::detail

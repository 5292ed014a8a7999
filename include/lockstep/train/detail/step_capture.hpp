// lockstep/train/detail/step_capture.hpp: step_capture, the host's record of a synchronous step
// captured into a CUDA graph and the checks of counting its launches. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/agreement.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>

namespace lockstep {
class nccl_communicator;
} // namespace lockstep

namespace lockstep::detail {

/// True when Comm's overlapped buckets (comm_stream<Comm>) run on a side stream forked and
/// joined by events, with no thread: nccl_communicator's. A capture follows such a fork.
template <class Comm>
inline constexpr bool overlaps_on_side_stream = false;
template <>
inline constexpr bool overlaps_on_side_stream<nccl_communicator> = true;

/// The host's side of a step that data_parallel::step() recorded into a CUDA graph instead of
/// running it (the communicator's stream was being captured). A launch of the graph repeats the
/// step's device work with what the host passed to it at the capture, as kernel arguments: the
/// learning rate, the global batch, and the step index and sample offset the step function saw.
/// What lives in device memory advances on every launch (weights, optimizer state and step
/// count, loss scale, the step's status). The host's counters advance through
/// data_parallel::count_replay(), one call per launch, which check_replay() guards.
/// docs/train_api.md, "Capturing a step in a CUDA graph", states the contract.
class step_capture {
public:
    /// Throws lockstep::error (errc::unsupported) when the trainer's step cannot be captured:
    /// local SGD (every K-th step averages and checks its agreement on the host), and buckets
    /// overlapped by a communication THREAD (`threaded_overlap`: its enqueues are not the
    /// capturing thread's). nccl_communicator's overlap is a side stream forked from the
    /// compute stream and joined back by events, which a capture follows.
    static void check_capturable(int rank, bool local_sgd, bool threaded_overlap) {
        LOCKSTEP_REQUIRE(!local_sgd, errc::unsupported, rank, "data_parallel.step",
                         "a sync::local_sgd step cannot be captured in a CUDA graph (every K-th "
                         "step averages the weights and checks the replicas' settings on the "
                         "host): capture sync::synchronous steps");
        LOCKSTEP_REQUIRE(!threaded_overlap, errc::unsupported, rank, "data_parallel.step",
                         "a step whose bucket reductions overlap on a communication thread "
                         "cannot be captured in a CUDA graph (that thread's enqueues are not in "
                         "the capture): use train_params::overlap = overlap_mode::never");
    }

    /// Records the step just captured: its index, global batch and learning rate. Replaces the
    /// step captured before (count_replay() counts launches of the last capture).
    void record(std::int64_t step, std::size_t global, double lr) noexcept {
        last_ = captured{step, global, lr};
    }

    /// True once a step was captured.
    bool captured_any() const noexcept { return last_.has_value(); }

    /// Checks that a launch of the captured step may be counted as step `step`, whose learning
    /// rate is `lr` (train_params::lr), and returns the captured global batch. Throws
    /// lockstep::error (errc::invalid_argument) naming the replica and the values when no step
    /// was captured, when the stream is being captured (`capturing`), or when `lr` differs from
    /// the captured rate every launch applies.
    std::size_t check_replay(int rank, bool capturing, std::int64_t step, double lr) const {
        LOCKSTEP_REQUIRE(last_.has_value(), errc::invalid_argument, rank,
                         "data_parallel.count_replay",
                         "no step was captured in a CUDA graph (call step() while the "
                         "communicator's stream is being captured)");
        LOCKSTEP_REQUIRE(!capturing, errc::invalid_argument, rank, "data_parallel.count_replay",
                         "the stream is being captured into a CUDA graph: count a launch after "
                         "it was enqueued (cudaGraphLaunch), outside the capture");
        LOCKSTEP_REQUIRE(lr == last_->lr, errc::invalid_argument, rank,
                         "data_parallel.count_replay", "step ", step, ": train_params::lr gives ",
                         exact(lr), " but the graph applies ", exact(last_->lr),
                         ", the rate of step ", last_->step,
                         " it was captured at: capture the step again when the rate changes");
        return last_->global;
    }

private:
    struct captured {
        std::int64_t step;
        std::size_t global;
        double lr;
    };
    std::optional<captured> last_;
};

} // namespace lockstep::detail

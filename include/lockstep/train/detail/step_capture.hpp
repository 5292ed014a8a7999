// lockstep/train/detail/step_capture.hpp: step_capture, the host's record of a synchronous step
// captured into a CUDA graph and the checks of counting its launches. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/train/detail/agreement.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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
/// data_parallel::count_replay(), one call per launch, which check_replay() guards: the trainer's
/// and the layers' (what the captured step recorded through nn::layer_step::count, added again
/// per launch by count_layers()). A step's first run sets up what later steps reuse (buffers
/// sized by the global batch, kept statistics, bn::group's split communicator); a graph must
/// capture none of that setup, so a capture needs a plain step of its global batch before it
/// (check_set_up), and launches are refused once a plain step of a new global batch may have
/// reallocated what the graph uses.
/// docs/train_api.md, "Capturing a step in a CUDA graph", states the contract.
class step_capture {
public:
    /// Throws lockstep::error (errc::unsupported) when the trainer's step cannot be captured:
    /// local SGD (every K-th step averages and checks its agreement on the host), and buckets
    /// overlapped by a communication THREAD (`threaded_overlap`: its enqueues are not the
    /// capturing thread's). nccl_communicator's overlap is a side stream forked from the
    /// compute stream and joined back by events, which a capture follows. Nor with
    /// `report_stragglers_every` > 0: a graph's launches run no collective whose gaps the
    /// straggler report could time. Nor with `verify_every` > 0: the check compares the
    /// replicas' weights on the host after a plain step, which count_replay does not run (a
    /// launch it counts is not followed by a wait it could compare after).
    static void check_capturable(int rank, bool local_sgd, bool threaded_overlap,
                                 std::int64_t report_stragglers_every, std::int64_t verify_every) {
        LOCKSTEP_REQUIRE(!local_sgd, errc::unsupported, rank, "data_parallel.step",
                         "a sync::local_sgd step cannot be captured in a CUDA graph (every K-th "
                         "step averages the weights and checks the replicas' settings on the "
                         "host): capture sync::synchronous steps");
        LOCKSTEP_REQUIRE(!threaded_overlap, errc::unsupported, rank, "data_parallel.step",
                         "a step whose bucket reductions overlap on a communication thread "
                         "cannot be captured in a CUDA graph (that thread's enqueues are not in "
                         "the capture): use train_params::overlap = overlap_mode::never");
        LOCKSTEP_REQUIRE(report_stragglers_every == 0, errc::unsupported, rank,
                         "data_parallel.step",
                         "a step is not captured in a CUDA graph with report_stragglers_every = ",
                         report_stragglers_every,
                         " (a graph's launches run no collective whose gaps the report could "
                         "time): use 0 in a trainer whose steps are captured");
        LOCKSTEP_REQUIRE(
            verify_every == 0, errc::unsupported, rank, "data_parallel.step",
            "a step is not captured in a CUDA graph with verify_every = ", verify_every,
            " (the replicas' weights are compared after plain steps only; the "
            "launches count_replay counts would never be checked): use 0 in a "
            "trainer whose steps are captured");
    }

    /// A plain step (run, not captured) of `global` samples returned: what a step of this global
    /// batch sets up on its first run exists from now on (the buffers only grow).
    void note_plain_step(std::size_t global) {
        if (std::find(plain_.begin(), plain_.end(), global) == plain_.end())
            plain_.push_back(global);
    }

    /// Throws lockstep::error (errc::invalid_argument) naming the replica and the global batch
    /// when no plain step of `global` samples ran on this trainer (note_plain_step) before a
    /// capture of such a step: its first-run setup (allocations and their initialising kernels,
    /// the batch-norm statistics kept for the skip decision, bn::group's communicator split)
    /// would be captured instead of done once.
    void check_set_up(int rank, std::size_t global) const {
        if (std::find(plain_.begin(), plain_.end(), global) != plain_.end())
            return;
        const std::string before =
            plain_.empty() ? std::string("no plain step ran on this trainer before the capture")
                           : concat("no plain step of global batch ", global,
                                    " ran on this trainer before the capture (the last plain "
                                    "step's global batch was ",
                                    plain_.back(), ")");
        fail(errc::invalid_argument, rank, "data_parallel.step",
             "the step is being captured into a CUDA graph, but ", before,
             ": the first step of a global batch allocates and sets up what later steps reuse "
             "(batch-norm buffers and kept statistics, bn::ghost's chunk blocks, "
             "reduce::reproducible's accumulator, bn::group's split communicator), which the "
             "graph would capture: run one plain step of global batch ",
             global, " before capturing");
    }

    /// Records the step just captured: its index, global batch and learning rate, and what the
    /// layers counted on the host in it (`counts`, added again per launch). Replaces the step
    /// captured before (count_replay() counts launches of the last capture).
    void record(std::int64_t step, std::size_t global, double lr,
                std::vector<nn::step_count> counts) {
        last_ = captured{step, global, lr, std::move(counts), plain_.size()};
    }

    /// True once a step was captured.
    bool captured_any() const noexcept { return last_.has_value(); }

    /// Checks that a launch of the captured step may be counted as step `step`, whose learning
    /// rate is `lr` (train_params::lr), and returns the captured global batch. Throws
    /// lockstep::error (errc::invalid_argument) naming the replica and the values when no step
    /// was captured, when the stream is being captured (`capturing`), when `lr` differs from
    /// the captured rate every launch applies, or when a plain step of a global batch first run
    /// after the capture may have grown (reallocated) buffers the graph uses.
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
        LOCKSTEP_REQUIRE(plain_.size() == last_->plain_batches, errc::invalid_argument, rank,
                         "data_parallel.count_replay", "step ", step,
                         ": a plain step of global batch ", plain_.back(),
                         ", the first of that size, ran after the step of global batch ",
                         last_->global,
                         " was captured; it may have reallocated buffers the "
                         "graph uses: capture the step again");
        return last_->global;
    }

    /// One launch's host counts of the layers: each counter the captured step counted grows by
    /// what it counted (nn::layer_step::count). requires: check_replay passed.
    void count_layers() {
        for (const nn::step_count& c : last_->counts)
            *c.counter += c.added;
    }

private:
    struct captured {
        std::int64_t step;
        std::size_t global;
        double lr;
        std::vector<nn::step_count> counts; ///< the layers' host counts of one launch
        std::size_t plain_batches;          ///< plain_.size() at the capture
    };
    std::optional<captured> last_;
    std::vector<std::size_t> plain_; ///< the global batches plain steps ran with (distinct)
};

} // namespace lockstep::detail

// lockstep/train/step_state.hpp: a synchronous training step's state in the replica's memory:
// what each replica reports, what is summed over replicas, what every replica decides from the
// sums, the loss scale's report and the run of skipped steps; step_state<System> owns it.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>
#include <span>
#include <type_traits>

#include <thrust/fill.h>

namespace lockstep {

/// What a replica's rows say of the background checkpoint save (save_checkpoint_async) in
/// flight: levels that hold until the next save begins, so any later step's status tells them
/// (train/detail/background_save.hpp). All zero: no save yet.
struct save_word {
    double index = 0; ///< which save of the trainer (1, 2, ...: the same on every replica)
    double state = 0; ///< background_save::level of this replica's part
    double crc = 0;   ///< its shard's CRC32C, once durable
    double bytes = 0; ///< its shard's size in bytes, once durable
};

/// What one replica reports of its own step. The state holds one row per replica; replica r
/// writes row r only (the others stay zero), so the status all_reduce (a sum) hands every
/// replica every replica's row without another collective.
struct replica_row {
    double non_finite = 0;       ///< NaN/inf elements of its local gradient
    double first_non_finite = 0; ///< 1 + flat index of the first (0: none)
    double loss_non_finite = 0;  ///< 1 when its loss is NaN/inf
    double global_batch = 0;     ///< the global_batch it passed to step()
    double lr = 0;               ///< the learning rate of its step
    double trainer = 0;          ///< its trainer's ordinal (detail/trainer_ordinal.hpp)
    double first_sample = 0;     ///< the global index of its step's first sample (samples())
    double loss_scale = 0;       ///< the loss scale its step used (1 without loss scaling)
    double scale_growth = 0;     ///< its loss scale's growth tracker before the step
    double params = 0; ///< its parameters' digest (52 bits) in its trainer's first step, else 0
    save_word save{};  ///< its background checkpoint save
};

/// What rides on a synchronous step's status besides the step's own checks: the word this
/// replica puts into its row, and what every replica's row showed once the host reads the step
/// (a background checkpoint save: train/detail/background_save.hpp).
class status_rider {
public:
    virtual save_word word() const = 0;
    /// The rows of every replica, as the status all_reduce left them; the event they show.
    virtual checkpoint_event observe(std::span<const replica_row> rows) = 0;

protected:
    status_rider() = default;
    status_rider(const status_rider&) = default;
    status_rider& operator=(const status_rider&) = default;
    ~status_rider() = default;
};

/// The values summed over replicas by the status all_reduce.
struct step_totals {
    double loss = 0;            ///< the loss the step function reported
    double non_finite = 0;      ///< NaN/inf gradient elements before reduction
    double layer_errors = 0;    ///< layers that found invalid statistics
    double loss_non_finite = 0; ///< replicas whose loss is NaN/inf
};

/// This replica's own values: the first layer error it saw, the reduced gradient's checks, and
/// the decisions every replica takes alike from the totals (on the device).
struct step_outcome {
    kernels::layer_error_record first_error{}; ///< the first layer error (code 0: none)
    double skip = 0;                           ///< 1 when the update is skipped
    double reduced_non_finite = 0;             ///< NaN/inf elements of the reduced gradient
    double reduced_first = 0;                  ///< 1 + flat index of its first one (0: none)
    double grad_norm2 = 0;                     ///< squared 2-norm of the gradient
    double grad_factor = 1;                    ///< factor applied to the gradient (clipping)
    double mismatch = 0;                       ///< 1 when replicas disagree on a step setting
    double overflow = 0; ///< NaN/inf gradient elements before and after reduction (loss scale)
};

/// The run of skipped steps, kept across steps (train_params::max_consecutive_skips): counted on
/// the device from each step's skip decision, so that a step never waits on the host for it.
/// When the run reaches the limit, the step's cause (its rows, kept in the state's cause rows,
/// and its reduced gradient's checks) is kept for the error the host throws at its next read.
struct skip_streak {
    double run = 0;                ///< consecutive skipped steps counted towards the limit
    double skipped = 0;            ///< skipped steps since the trainer was built
    double tripped = 0;            ///< 1 once run reached the limit (it stays 1)
    double after_trip = 0;         ///< steps that ran after the one that reached it
    double limit_run = 0;          ///< run at that step
    double reduced_non_finite = 0; ///< that step's reduced gradient: its non-finite count
    double reduced_first = 0;      ///< and 1 + the flat index of the first one (0: none)
    double loss_scale = 0;         ///< the loss scale that step used (0: no loss scaling)
};

/// Device pointers to the parts of a step's state, for the kernels that write them: `rows`
/// (replicas rows), `collective` (replicas x the collective's doubles, summed as the rows: e.g.
/// reduce::sharded's shard rows; null when the collective keeps none), `totals`,
/// `outcome`, the loss scale's `scale_report`, and the `streak` of skipped steps with the
/// `cause` rows (replicas rows) of the step that reached the limit.
struct step_view {
    replica_row* rows = nullptr;
    double* collective = nullptr;
    step_totals* totals = nullptr;
    step_outcome* outcome = nullptr;
    kernels::loss_scale_record* scale_report = nullptr;
    skip_streak* streak = nullptr;
    replica_row* cause = nullptr;
    int replicas = 0;
};

/// One task: *outcome = step_outcome{} (its defaults).
struct reset_outcome_fn {
    step_outcome* outcome;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const { *outcome = step_outcome{}; }
};

/// A synchronous step's state in the replica's System memory, laid out as
/// [replica rows][collective rows][totals] | [outcome][loss scale report] ||
/// [skip streak][cause rows]: the part before | is the prefix the status all_reduce sums
/// (reduced()), the part after || lasts across steps (reset() leaves it), and the host reads
/// the whole state once at the end of the step (memory(), then view_of() over the copy).
template <class System>
class step_state {
    template <class Part>
    static constexpr std::size_t doubles = sizeof(Part) / sizeof(double);
    static_assert(std::is_trivially_copyable_v<step_outcome> &&
                  sizeof(replica_row) % sizeof(double) == 0 &&
                  sizeof(step_totals) % sizeof(double) == 0 &&
                  sizeof(step_outcome) % sizeof(double) == 0 &&
                  sizeof(kernels::loss_scale_record) % sizeof(double) == 0 &&
                  sizeof(skip_streak) % sizeof(double) == 0);

public:
    /// `collective`: the doubles per replica of the collective's rows (0: none).
    /// requires: replicas >= 1. ensures: every part zero (the streak included).
    step_state(int replicas, std::size_t collective, const System& sys)
        : replicas_(replicas), collective_(collective),
          memory_(step_doubles(replicas, collective) + doubles<skip_streak> +
                      static_cast<std::size_t>(replicas) * doubles<replica_row>,
                  sys) {
        fill_zero(sys, memory_.size());
    }
    /// The former step_state(replicas, bool shards, sys): a bool would convert to 1 double per
    /// replica; the collective says how many (reduce::sharded's collective: 3).
    step_state(int replicas, bool shards, const System& sys) = delete;

    /// The state over `memory` (this state's memory, or a copy of it read back to the host).
    step_view view_of(double* memory) const noexcept {
        const auto n = static_cast<std::size_t>(replicas_);
        step_view v;
        v.replicas = replicas_;
        v.rows = reinterpret_cast<replica_row*>(memory);
        double* next = memory + n * doubles<replica_row>;
        if (collective_ != 0) {
            v.collective = next;
            next += n * collective_;
        }
        v.totals = reinterpret_cast<step_totals*>(next);
        v.outcome = reinterpret_cast<step_outcome*>(next + doubles<step_totals>);
        v.scale_report = reinterpret_cast<kernels::loss_scale_record*>(next + doubles<step_totals> +
                                                                       doubles<step_outcome>);
        double* lasting = memory + step_doubles(replicas_, collective_);
        v.streak = reinterpret_cast<skip_streak*>(lasting);
        v.cause = reinterpret_cast<replica_row*>(lasting + doubles<skip_streak>);
        return v;
    }
    step_view view() noexcept { return view_of(memory_.data()); }
    /// A read-only view over a host copy of memory().
    step_view view_of(std::span<const double> copy) const noexcept {
        return view_of(const_cast<double*>(copy.data()));
    }

    /// The prefix the status all_reduce sums: the rows and the totals.
    std::span<double> reduced() noexcept {
        return memory_.span().first(reduced_doubles(replicas_, collective_));
    }
    /// The skip streak (skip_streak's doubles), which lasts across steps.
    std::span<double> streak() noexcept {
        return memory_.span().subspan(step_doubles(replicas_, collective_), doubles<skip_streak>);
    }
    /// All of it, for the host's end-of-step read.
    std::span<const double> memory() const noexcept { return memory_.span(); }

    /// Every part of the step to its initial value (step_outcome's defaults, zeros elsewhere),
    /// the skip streak and cause rows left as they are, on the system's stream (two kernels;
    /// nothing from the host, so a CUDA graph can capture it).
    void reset(const System& sys) {
        fill_zero(sys, step_doubles(replicas_, collective_));
        kernels::for_each_index(sys, 1, reset_outcome_fn{view().outcome});
    }

private:
    void fill_zero(const System& sys, std::size_t n) {
        kernels::with_policy_for(sys, n, [&](auto policy) {
            thrust::fill(policy, memory_.data(), memory_.data() + n, 0.0);
        });
    }
    /// The doubles of one step's parts (reset each step).
    static std::size_t step_doubles(int replicas, std::size_t collective) noexcept {
        return reduced_doubles(replicas, collective) + doubles<step_outcome> +
               doubles<kernels::loss_scale_record>;
    }
    static std::size_t reduced_doubles(int replicas, std::size_t collective) noexcept {
        const auto n = static_cast<std::size_t>(replicas);
        return n * doubles<replica_row> + n * collective + doubles<step_totals>;
    }

    int replicas_;
    std::size_t collective_;
    buffer<double, System> memory_;
};

} // namespace lockstep

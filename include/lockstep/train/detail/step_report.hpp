// lockstep/train/detail/step_report.hpp: the errors of a finished step, as the host reads them
// from the step's state: replicas that disagree, a layer's error, non-finite gradients or losses,
// a run of skipped steps that reached train_params::max_consecutive_skips.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/train/detail/agreement.hpp"
#include "lockstep/train/detail/trainer_ordinal.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/step_state.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace lockstep::detail {

/// How a trainer reports a step's errors.
struct step_report_options {
    bool local_sgd = false;       ///< rows are this replica's own (local SGD)
    bool skip_non_finite = false; ///< train_params::skip_non_finite: a non-finite step is skipped
    bool loss_scaling = false;    ///< a non-finite gradient is an overflow: skipped, not thrown
    double min_scale = 0;         ///< loss_scaling::min_scale (with loss scaling)
    int micro_batches = 1;        ///< train_params::micro_batches (named by a layer's error)
};

/// Reads a finished step's state (a host copy) and throws the errors it holds, on replica `rank`
/// for step `step`; `parameters` name the flat elements.
class step_report {
public:
    step_report(const step_view& st, int rank, std::int64_t step,
                std::span<const tensor_info> parameters, step_report_options o)
        : st_(st), rank_(rank), step_(step), parameters_(parameters), o_(o) {}

    /// Throws lockstep::error when the replicas disagreed on global_batch, lr, the trainer they
    /// stepped, the step's first sample or the loss scale (invalid_argument, naming both values),
    /// a layer reported an error (peer_failure or invalid_argument, naming the layer and the
    /// replica), a gradient element or loss is not finite (non_finite, naming each replica's
    /// count and first tensor) unless such steps are skipped silently, or the run of skipped
    /// steps reached the limit at this step or before (non_finite, naming that step's cause).
    void throw_errors() const {
        if (st_.outcome->mismatch != 0)
            fail(errc::invalid_argument, rank_, "data_parallel.step", "step ", step_,
                 " skipped: the replicas disagree:", mismatch_text());
        if (st_.totals->layer_errors > 0)
            throw_layer_error();
        // Under loss scaling a non-finite gradient is an overflow (skipped, the scale backs
        // off); a non-finite loss is not: the scale never touches the loss.
        const bool bad_gradient = st_.totals->non_finite > 0 || st_.outcome->reduced_non_finite > 0;
        const bool bad = st_.totals->loss_non_finite > 0 || (bad_gradient && !o_.loss_scaling);
        if (bad && !o_.skip_non_finite)
            fail(errc::non_finite, rank_, "data_parallel.step", "step ", step_, ":",
                 non_finite_text(st_.rows, st_.outcome->reduced_non_finite,
                                 st_.outcome->reduced_first));
        if (st_.streak->tripped != 0)
            throw_runaway();
    }

private:
    /// The run of skipped steps reached the limit (at step `step_ - after_trip`): errc::non_finite
    /// naming the cause kept at that step, as a non-finite step names it.
    void throw_runaway() const {
        const skip_streak& k = *st_.streak;
        const auto at = step_ - static_cast<std::int64_t>(k.after_trip);
        std::string floor;
        if (k.loss_scale > 0 && k.loss_scale <= o_.min_scale)
            floor = lockstep::detail::concat(
                " at loss scale ", k.loss_scale,
                ", the floor (loss_scaling::min_scale = ", o_.min_scale, ")");
        else if (k.loss_scale > 0)
            floor = lockstep::detail::concat(" at loss scale ", k.loss_scale);
        fail(errc::non_finite, rank_, "data_parallel.step", "step ", at, ": ", k.limit_run,
             " consecutive steps skipped", floor,
             ", the limit (train_params::max_consecutive_skips): training stops. Cause at step ",
             at, ":", non_finite_text(st_.cause, k.reduced_non_finite, k.reduced_first), " ",
             k.skipped, " step(s) skipped in all");
    }

    void throw_layer_error() const {
        const kernels::layer_error_record& e = st_.outcome->first_error;
        const auto code = static_cast<layer_error>(static_cast<int>(e.code));
        const auto layer = static_cast<int>(e.layer);
        const auto value = static_cast<int>(e.value);
        if (code == layer_error::peer_invalid_input)
            fail(errc::peer_failure, rank_, "data_parallel.step", "step ", step_,
                 " skipped: batch_norm layer ", layer, " (in forward order): replica ", value,
                 " passed invalid input to it");
        if (code == layer_error::single_value) {
            // Statistics shared over replicas (value < 0: bn::global, bn::group) are per global
            // micro-batch; per-replica ones are of the replica's part of it.
            const int micro = o_.micro_batches;
            fail(errc::invalid_argument, rank_, "data_parallel.step", "step ", step_,
                 " skipped: batch_norm layer ", layer,
                 " (in forward order): expected more than 1 value per channel when training, "
                 "got 1",
                 value >= 0 ? lockstep::detail::concat(" on replica ", value)
                            : std::string(" over the replicas sharing statistics"),
                 " (global batch ", static_cast<std::uint64_t>(st_.rows[rank_].global_batch),
                 micro > 1 ? lockstep::detail::concat(" in ", micro, " micro-batches")
                           : std::string(),
                 " over ", st_.replicas, " replica(s)): ",
                 value >= 0 ? "raise global_batch, lower micro_batches or the replica count, or "
                              "use a BN policy that shares statistics"
                            : "raise global_batch or lower micro_batches (bn::group: or the "
                              "replica count)");
        }
        fail(errc::peer_failure, rank_, "data_parallel.step", "step ", step_,
             " skipped: ", st_.totals->layer_errors,
             " batch_norm layer error(s) on other replicas (statistics of another group)");
    }

    /// The replicas (rows) whose trainer ordinal, global_batch, lr, first sample, loss scale or
    /// parameters (the first step's digest) differ from replica 0's, both values.
    std::string mismatch_text() const {
        std::string out;
        const int n = o_.local_sgd ? 1 : st_.replicas;
        const replica_row& r0 = st_.rows[0];
        for (int r = 1; r < n; ++r) {
            const replica_row& rr = st_.rows[r];
            if (rr.trainer != r0.trainer)
                out += " " + trainer_order_text(r, rr.trainer, r0.trainer) + ";";
            if (rr.global_batch != r0.global_batch)
                out +=
                    lockstep::detail::concat(" global_batch: ", r0.global_batch, " on replica 0, ",
                                             rr.global_batch, " on replica ", r, ";");
            if (rr.lr != r0.lr)
                out += " lr: " + exact(r0.lr) + " on replica 0, " + exact(rr.lr) + " on replica " +
                       std::to_string(r) + ";";
            if (rr.first_sample != r0.first_sample)
                out += lockstep::detail::concat(
                    " first sample: ", static_cast<std::uint64_t>(r0.first_sample),
                    " on replica 0, ", static_cast<std::uint64_t>(rr.first_sample), " on replica ",
                    r,
                    " (their samples() differ, e.g. after a step skipped for different "
                    "global_batch that was not read before the next);");
            if (rr.loss_scale != r0.loss_scale || rr.scale_growth != r0.scale_growth)
                out += lockstep::detail::concat(
                    " loss scale: ", exact(r0.loss_scale), " (growth tracker ", r0.scale_growth,
                    ") on replica 0, ", exact(rr.loss_scale), " (growth tracker ", rr.scale_growth,
                    ") on replica ", r, " (scaler().restore on some replicas only?);");
            if (rr.params != r0.params && rr.trainer == r0.trainer)
                out += lockstep::detail::concat(
                    " parameters: replica ", r,
                    "'s differ from replica 0's before the trainer's first step (digests ",
                    static_cast<std::uint64_t>(r0.params), " and ",
                    static_cast<std::uint64_t>(rr.params),
                    "): the trainer broadcast replica 0's at construction, so replica ", r,
                    "'s network wrote them since; set initial values before the trainer is built "
                    "(in the network's constructor), or alike on every replica;");
        }
        return out;
    }

    /// The registration name of the parameter holding flat element `index`, with the element.
    std::string tensor_at(double one_based) const {
        const auto index = static_cast<std::size_t>(one_based) - 1;
        for (const tensor_info& t : parameters_)
            if (index >= t.offset && index < t.offset + t.size)
                return lockstep::detail::concat("'", t.name, "' (element ", index - t.offset, ")");
        return lockstep::detail::concat("flat element ", index);
    }

    /// Per replica (`rows`): its non-finite gradient elements before reduction, the first one's
    /// tensor, a non-finite loss; or the reduced gradient's count (`reduced`, 1 + index of the
    /// first: `reduced_first`) when only the sum overflowed.
    std::string non_finite_text(const replica_row* rows, double reduced,
                                double reduced_first) const {
        std::string out;
        const char* scope = o_.local_sgd ? " (local SGD)" : "";
        for (int r = 0; r < st_.replicas; ++r) {
            const replica_row& rr = rows[r];
            if (rr.non_finite > 0)
                out += lockstep::detail::concat(
                    " ", rr.non_finite, " non-finite gradient element(s) on replica ", r, scope,
                    ", the first in ", tensor_at(rr.first_non_finite), ";");
            if (rr.loss_non_finite > 0)
                out +=
                    lockstep::detail::concat(" the loss is not finite on replica ", r, scope, ";");
        }
        if (out.empty() && reduced > 0)
            out = lockstep::detail::concat(
                " the reduced gradient has ", reduced,
                " non-finite element(s) (the sum over replicas overflowed), the first in ",
                tensor_at(reduced_first));
        return out;
    }

    step_view st_;
    int rank_;
    std::int64_t step_;
    std::span<const tensor_info> parameters_;
    step_report_options o_;
};

} // namespace lockstep::detail

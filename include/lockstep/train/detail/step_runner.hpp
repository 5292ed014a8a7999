// lockstep/train/detail/step_runner.hpp: step_runner, what runs the steps of a synchronous or
// local SGD data_parallel: the parts a step runs through (rebuilt after a shrink), one step with
// its capture, after-step checks and failure handling, and finish's step-count check.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/system.hpp"
#include "lockstep/train/detail/background_save.hpp"
#include "lockstep/train/detail/bucketed_collective.hpp"
#include "lockstep/train/detail/compressed_collective.hpp"
#include "lockstep/train/detail/empty_shards.hpp"
#include "lockstep/train/detail/finish_check.hpp"
#include "lockstep/train/detail/gradient_collective.hpp"
#include "lockstep/train/detail/local_sgd_driver.hpp"
#include "lockstep/train/detail/mark_order_hint.hpp"
#include "lockstep/train/detail/overlap.hpp"
#include "lockstep/train/detail/parameter_server_collective.hpp"
#include "lockstep/train/detail/replica_consistency.hpp"
#include "lockstep/train/detail/reproducible_collective.hpp"
#include "lockstep/train/detail/sharded_collective.hpp"
#include "lockstep/train/detail/shrink_recovery.hpp"
#include "lockstep/train/detail/snapshot_staging.hpp"
#include "lockstep/train/detail/step_capture.hpp"
#include "lockstep/train/detail/step_driver.hpp"
#include "lockstep/train/detail/step_stages.hpp"
#include "lockstep/train/detail/straggler_meter.hpp"
#include "lockstep/train/detail/trainer_base.hpp"
#include "lockstep/train/detail/unsettled_commit.hpp"
#include "lockstep/train/detail/visitor.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/train_params.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// The base of data_parallel for sync::synchronous and sync::local_sgd<K> (whose comments state
/// the trainer's contract), over trainer_base: owns what a step runs through (step_parts: the
/// ReducePolicy's collective, the policy-free stages and the SyncPolicy's driver), the capture
/// of a step into a CUDA graph, the straggler meter, the shrink recovery and the background
/// save that rides on the step's status, and runs one step through them (run_step) with the
/// checks that follow it (verify_every, the straggler report) and, when it throws, the drain
/// of the collective's communication stream and the abort of the communicator. Not used on its
/// own: data_parallel adds the entry points.
template <class Network, class Optimizer, class SyncPolicy, class ReducePolicy, class Communicator>
class step_runner
    : public trainer_base<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator> {
    using base_type = trainer_base<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator>;

protected:
    using T = typename base_type::value_type;
    using core_type = typename base_type::core_type;
    using collective_type = collective<ReducePolicy, T, Communicator>;
    using stages_type = step_stages<core_type>;
    using base_type::core_;

    /// What a step runs through, rebuilt at another replica count after a shrink: the
    /// ReducePolicy's collective, the policy-free stages and the SyncPolicy's driver.
    struct step_parts {
        collective_type collective;     ///< what the ReducePolicy does in a step, and its state
        stages_type stages;             ///< the policy-free stages of a step, and what they share
        step_driver<SyncPolicy> driver; ///< how a step runs under the SyncPolicy
        step_parts(core_type& core, background_save* rider)
            : collective(core.comm(), core.registry().parameters(),
                         use_overlap(core.comm(), core.params().overlap), core.params()),
              stages(core, collective.plan(), collective_type::status_doubles), driver(stages) {
            if constexpr (!is_local_sgd_v<SyncPolicy>)
                stages.set_rider(rider);
        }
    };

    /// Builds the trainer_base (collective: see data_parallel's constructor), then the step's
    /// parts, the background save and the straggler meter on `comm`.
    template <class Factory>
    step_runner(Communicator& comm, Factory&& factory, typename Optimizer::params_type opt,
                train_params tp)
        : base_type(comm, std::forward<Factory>(factory), std::move(opt), std::move(tp),
                    base_type::policy_settings(), true),
          saves_(std::make_unique<background_save>(comm.rank(), comm.size(),
                                                   [this] { return core_.steps(); })),
          unsettled_(comm.rank()), parts_(std::make_unique<step_parts>(core_, saves_.get())),
          stragglers_(comm, core_.params().report_stragglers_every) {}
    ~step_runner() = default;

    /// One step (see data_parallel::step) after its entry checks: with
    /// train_params::on_replica_failure = shrink through the recovery (detail::shrink_steps),
    /// else step_once.
    template <class Fn>
    step_result run_step(std::size_t global_batch, Fn& fn) {
        // Visitor path, before the first step and its recovery point (shrink keeps the packed
        // values): what the network wrote on every replica alike since construction is what
        // trains, not the copy taken then (the first step's row compares the replicas' values).
        if (!started_)
            core_.pack_values();
        if constexpr (shrinkable_communicator<Communicator>)
            if (core_.params().on_replica_failure == replica_failure::shrink)
                return shrinks_.step(
                    core_, parts_, global_batch, [&](std::size_t g) { return step_once(g, fn); },
                    [&] { rebuild(); });
        return step_once(global_batch, fn);
    }

    /// After a failure: abort the communicator when it can be aborted, so that peers waiting
    /// for this replica get an error instead of a hang.
    void abort_communicator() noexcept {
        auto& comm = core_.comm();
        if constexpr (requires {
                          comm.abort();
                          { comm.aborted() } -> std::convertible_to<bool>;
                      })
            comm.abort();
    }

    /// finish's step-count check (detail::finish_steps) on the communicator and, when buckets
    /// are reduced on a host communication thread (overlap), concurrently on that thread's
    /// split: a peer still inside a step waits on one of the two (in a batch-norm collective on
    /// the communicator, or in a bucket reduction on the split), and finish's collective must
    /// meet it there, or both would wait out the timeout. The more telling error wins: the
    /// mismatch of finish's collective with the peer's over the echo of its failure.
    std::int64_t finish_counts() {
        const std::int64_t n = this->steps();
        std::exception_ptr side;
        bool on_side = false;
        if constexpr (!overlaps_on_side_stream<Communicator> &&
                      requires(collective_type & c) { c.submit_to_stream([](Communicator&) {}); }) {
            on_side = parts_->collective.submit_to_stream([n, &side](Communicator& c) {
                try {
                    (void)finish_steps(c, n);
                } catch (...) {
                    side = std::current_exception();
                }
            });
        }
        if (!on_side)
            return finish_steps(core_.comm(), n);
        std::exception_ptr main;
        try {
            (void)finish_steps(core_.comm(), n);
        } catch (...) {
            main = std::current_exception();
        }
        parts_->collective.drain();
        const auto echoes = [](const std::exception_ptr& e) {
            try {
                std::rethrow_exception(e);
            } catch (const error& le) {
                return le.code() == errc::peer_failure || le.code() == errc::timeout;
            } catch (...) {
                return false;
            }
        };
        if (main && (!side || !echoes(main)))
            std::rethrow_exception(main);
        if (side)
            std::rethrow_exception(side);
        return n;
    }

    /// save_checkpoint_async's copies out of the system's memory, kept between saves (declared
    /// before saves_: the writer that reads them is joined first).
    ckpt::snapshot_staging<typename base_type::system_type> staging_;
    std::unique_ptr<background_save> saves_; ///< save_checkpoint_async's save in flight
    unsettled_commit unsettled_;             ///< save_checkpoint's commit, until agreed
    std::unique_ptr<step_parts> parts_;      ///< rebuilt after a shrink
    step_capture capture_;                   ///< the step captured last
    straggler_meter stragglers_;             ///< train_params::report_stragglers_every

private:
    /// One step (see data_parallel::step), without recovery.
    template <class Fn>
    step_result step_once(std::size_t global_batch, Fn& fn) {
        const bool capture = capturing(core_.comm().system());
        if (capture) {
            step_capture::check_capturable(
                this->rank(), is_local_sgd_v<SyncPolicy>,
                parts_->collective.overlaps() && !overlaps_on_side_stream<Communicator>,
                core_.params().report_stragglers_every, core_.params().verify_every);
            capture_.check_set_up(this->rank(), global_batch);
        }
        try {
            // The first plain step's row carries the parameters' digest: the replicas must
            // start from the values the constructor broadcast from replica 0, and a network that
            // wrote them since on some replicas only (initial values set after the trainer was
            // built, a file read on replica 0) would train apart silently. Local SGD compares no
            // rows per step.
            if constexpr (!is_local_sgd_v<SyncPolicy>)
                if (!capture && !started_)
                    parts_->stages.digest_parameters();
            parts_->stages.set_capturing(capture);
            const step_result r =
                parts_->driver.step(parts_->stages, parts_->collective, global_batch, fn);
            if (capture) {
                // Nothing ran: the host counts each launch instead (count_replay).
                capture_.record(r.step, global_batch, r.lr, parts_->stages.layer_counts());
                core_.retract(global_batch);
                parts_->stages.set_capturing(false);
            } else {
                capture_.note_plain_step(global_batch);
                started_ = true;
                verify_replicas_if_due();
                stragglers_.after_step(core_.comm(), this->steps());
            }
            return r;
        } catch (const error& e) {
            parts_->stages.set_capturing(false);
            parts_->collective.drain();
            abort_communicator();
            rethrow_naming_empty_shards(
                with_mark_order_hint(e, parts_->collective.overlaps() &&
                                            overlaps_on_side_stream<Communicator>),
                global_batch, static_cast<std::size_t>(core_.params().micro_batches),
                ReducePolicy::chunk_samples, this->size());
        } catch (...) {
            parts_->stages.set_capturing(false);
            parts_->collective.drain();
            abort_communicator();
            throw;
        }
    }

    /// After a shrink: everything that depends on the replica count, built anew (the gradient
    /// hook kept). A blocking save whose commit a lost replica 0 may still make is settled
    /// (unsettled_commit::shrank, one small all_gather). A background save in flight is decided
    /// (background_save::shrank, one small all_gather): reported committed when it had
    /// committed, else failed, abandoned (its commit needed the lost replica's shard: the
    /// previous checkpoint stands), by the next step's result or wait_checkpoint / finish, as
    /// any background save's end.
    void rebuild() {
        auto& comm = core_.comm();
        unsettled_.shrank(comm);
        saves_->shrank(comm);
        auto parts = std::make_unique<step_parts>(core_, saves_.get());
        parts->stages.set_gradient_hook(parts_->stages.gradient_hook_function());
        parts_ = std::move(parts);
        stragglers_ = straggler_meter(comm, core_.params().report_stragglers_every);
        capture_ = step_capture{};
    }

    /// train_params::verify_every: after every verify_every-th step, the replicas compare the
    /// digests of what they must hold identically (detail/replica_consistency.hpp).
    void verify_replicas_if_due() {
        const std::int64_t every = core_.params().verify_every;
        if (every == 0 || this->steps() % every != 0)
            return;
        // Sharded: each replica holds its shard's state; parameter_server: Root's only moves.
        constexpr bool same_optimizer_state = !ReducePolicy::shards_optimizer_state &&
                                              ReducePolicy::update_root < 0 &&
                                              !is_local_sgd_v<SyncPolicy>;
        constexpr bool same_state =
            is_local_sgd_v<SyncPolicy> ||
            shares_running_statistics<network_bn_policies_t<Network>>::value;
        auto& reg = core_.registry();
        std::vector<consistency_section<T>> sections;
        for (const tensor_info& t : reg.parameters())
            sections.push_back({"param." + t.name, core_.values().subspan(t.offset, t.size)});
        if constexpr (same_state) {
            for (const tensor_info& t : reg.state_tensors())
                sections.push_back({"state." + t.name, reg.states().subspan(t.offset, t.size)});
            visit_state<T>(core_.network(), [&](std::string_view name, std::span<T> st) {
                sections.push_back({"state." + std::string(name), st});
            });
        }
        if constexpr (same_optimizer_state)
            for (const auto& slot : core_.optimizer().state().slots)
                sections.push_back({"optimizer." + std::string(slot.name), slot.data});
        // Named by the index of the step just taken, as step_result::step and the other messages.
        verify_replicas(core_.comm(), core_.comm().system(), this->steps() - 1, sections);
    }

    /// on_replica_failure = shrink: the steps' fences and rollback, the recovery.
    shrink_steps<core_type> shrinks_;
    bool started_ = false; ///< a plain step returned (its parameters were compared)
};

} // namespace lockstep::detail

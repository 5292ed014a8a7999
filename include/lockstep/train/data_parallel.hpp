// lockstep/train/data_parallel.hpp: data_parallel<Network, Optimizer, SyncPolicy, ReducePolicy,
// Communicator>, the trainer (synchronous and local SGD; the asynchronous modes are the
// specialisations in train/asynchronous.hpp). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/system.hpp"
#include "lockstep/train/asynchronous.hpp" // IWYU pragma: export
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/data_parallel_fwd.hpp"
#include "lockstep/train/detail/gradient_collective.hpp"
#include "lockstep/train/detail/shrink_recovery.hpp"
#include "lockstep/train/detail/step_runner.hpp"
#include "lockstep/train/loss_scaler.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/straggler_report.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace lockstep {

/// Trains a user's Network data-parallel: ONE object per replica, constructed on every replica
/// (inside thread_group::run, or in every MPI process) with that replica's communicator.
/// - Network: any type built by a factory `Network(replica_context<T, Communicator>&)`; it
///   allocates its parameters from ctx.registry() (flat, zero copy) or exposes them through
///   `for_each_parameter(net, f)` / `net.for_each_parameter(f)`, f(name, value span, grad span)
///   (and optionally for_each_state(f), f(name, span)); its BN policies are declared through
///   `using bn_policies = std::tuple<...>` (see network_bn_policies).
/// - Optimizer: an optim:: optimizer over T (e.g. optim::sgd<float>); T is its value_type.
/// - SyncPolicy: sync::synchronous or sync::local_sgd<K> here (sync::asynchronous and
///   sync::bounded_staleness<S> are specialisations in train/asynchronous.hpp).
/// - ReducePolicy: reduce::per_tensor, reduce::bucketed<Bytes>, reduce::parameter_server<Root>,
///   reduce::compressed<half|bfloat16>, reduce::reproducible<C> (results bitwise independent of
///   the replica count; with bn::ghost<C> batch norm), reduce::sharded<Bytes> (sync::synchronous
///   only).
/// - Communicator: thread_communicator, mpi_communicator, nccl_communicator.
/// Invalid combinations are compile errors (policy/compat.hpp).
template <class Network, class Optimizer, sync_policy SyncPolicy, reduce_policy ReducePolicy,
          communicator Communicator>
class data_parallel
    : public detail::step_runner<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator> {
    static_assert(!is_asynchronous_v<SyncPolicy>,
                  "data_parallel with sync::asynchronous or sync::bounded_staleness is defined "
                  "in lockstep/train/asynchronous.hpp: include it.");
    static_assert(
        detail::has_collective_v<ReducePolicy, typename Optimizer::value_type, Communicator>,
        "this ReducePolicy has no collective: specialise "
        "lockstep::detail::collective<Policy, T, Communicator> and include it before "
        "data_parallel is instantiated (docs/writing_a_reduce_policy.md, part 2).");
    using base_type =
        detail::step_runner<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator>;

public:
    // The aliases and accessors are trainer_base's (network(), context(), optimizer(), rank(),
    // size(), parameters(), registry(), steps(), samples()).
    using typename base_type::system_type;
    using typename base_type::value_type;

    /// Builds this replica's network with factory(ctx), checks that every replica declared
    /// the same parameters and state (else every replica throws lockstep::error naming the
    /// first differing tensor and both shapes) and the same settings: the optimizer type and
    /// hyperparameters, seed, micro_batches, overlap, skip_non_finite, max_grad_norm, the frozen
    /// and decaying tensors, the sync, reduce and BN policies (else every replica throws naming
    /// each differing setting with both values), broadcasts replica 0's values and state, and
    /// prepares the optimizer (params `opt`) over the flat parameter buffer. Collective: every
    /// replica of comm constructs its trainer. requires: comm outlives the trainer.
    template <class Factory>
    data_parallel(Communicator& comm, Factory&& factory, typename Optimizer::params_type opt = {},
                  train_params tp = {})
        : base_type(comm, std::forward<Factory>(factory), std::move(opt), std::move(tp)) {
        detail::check_shrink_settings<ReducePolicy, SyncPolicy, network_bn_policies_t<Network>>(
            core_.params(), comm);
        const std::int64_t every = core_.params().verify_every;
        LOCKSTEP_REQUIRE(every >= 0, errc::invalid_argument, comm.rank(), "data_parallel",
                         "verify_every = ", every, " (must be >= 0; 0 is off)");
        const std::int64_t limit = core_.params().max_consecutive_skips;
        LOCKSTEP_REQUIRE(limit >= 0, errc::invalid_argument, comm.rank(), "data_parallel",
                         "max_consecutive_skips = ", limit, " (must be >= 0; 0 is off)");
    }
    data_parallel(const data_parallel&) = delete;
    data_parallel& operator=(const data_parallel&) = delete;

    /// One optimizer step over a global batch of `global_batch` samples (collective).
    /// fn(Network&, shard_range, context_type&) -> double is called once per micro-batch
    /// (train_params::micro_batches) with this replica's contiguous part of the micro-batch
    /// (possibly empty: fn is still called, collectives inside the network must run); it runs
    /// forward and backward, ACCUMULATING gradients (they are zeroed once per step), and returns
    /// the sum of its per-sample losses times range.scale.
    /// sync::synchronous: scale = 1 / global_batch, gradients are summed over replicas (the
    /// gradient of the mean loss over the global batch), one update is applied identically on
    /// every replica: weights are bitwise identical everywhere afterwards.
    /// reduce::reproducible<C>: fn is called once per chunk of C samples this replica computes
    /// (train/detail/reproducible_collective.hpp), never with micro-batches.
    /// sync::local_sgd<K>: scale = 1 / (this replica's samples), each replica updates alone,
    /// weights (and state) are averaged over replicas every K steps; each average first checks
    /// that every replica averages the same trainer and passed the same global_batch and used the
    /// same lr in the steps since the last one (else it throws on every replica naming both
    /// trainers, or the step and both values); a skip decision is this replica's own.
    /// Between reduction and update, on every replica alike: the gradients of frozen tensors
    /// are zeroed (train_params::frozen), the gradient hook runs (set_gradient_hook), the
    /// gradient norm is taken and the gradient scaled by the clipping factor
    /// (train_params::max_grad_norm). reduce::sharded: each replica reduces, checks, clips and
    /// updates its shard of the flat buffer (the norm and the non-finite count are summed over
    /// shards in the step's status all_reduce), then the shards are all-gathered.
    /// Skipped on every replica (synchronous; train_params::skip_non_finite = false also
    /// throws), with nothing applied and the BN running statistics restored on the device: a
    /// NaN/inf gradient element on any replica (counted per replica before reduction, and in the
    /// reduced gradient), a NaN/inf loss on any replica, a layer error, or replicas that passed
    /// different global_batch, used different learning rates or stepped different trainers
    /// (their ordinals on the communicator, detail/trainer_ordinal.hpp: trainers stepped in
    /// another order) in this step (checked in the step's status all_reduce; this one also
    /// throws, on every replica, naming both values). fn may also
    /// return void and add its loss into ctx.loss_slot() on the device. Inside the step nothing
    /// waits on the host: the non-finite check, the layers' error checks and the skip decision stay
    /// on the device (the optimizer kernels read the skip flag), and the host reads the step's
    /// status once at the end (train_params::read_result; else read_result() does it later). A step
    /// that throws (here or in fn) aborts a communicator that can be aborted (nccl_communicator,
    /// and with it every split made from it: the comm_stream's with buckets in flight,
    /// bn::group's), so its peers get errc::peer_failure instead of waiting forever (and this
    /// replica's teardown does not wait for them). requires: global_batch >= 1.
    /// ensures: the returned result is the same on every replica (synchronous).
    /// Called while the communicator's stream is being captured into a CUDA graph (synchronous
    /// steps; not local SGD, not buckets overlapped by a communication thread: else
    /// errc::unsupported before any work; after a plain step of the same global_batch on this
    /// trainer, which sets up what the step reuses: else errc::invalid_argument before any
    /// work), the step is RECORDED, not run: it returns with ready == false without waiting
    /// (whatever train_params::read_result says), steps(), samples(), read_result() and the
    /// layers' host counters (batch_norm::num_batches_tracked) stay as they were, and each
    /// launch of the graph is counted by count_replay(). A launch repeats the device work with
    /// the values of the capture (lr, global_batch, the step index and sample offsets fn saw);
    /// weights, optimizer state and step count, the loss scale and the step's status advance in
    /// device memory. During the capture ctx.loss_scale() throws with loss scaling (read
    /// loss_scale_device()). See docs/train_api.md, "Capturing a step in a CUDA graph".
    /// With train_params::on_replica_failure = shrink, the step starts with a fence (one
    /// barrier) and a host copy of the state it changes (detail::step_rollback); when a replica
    /// is lost during it (detail::is_replica_loss), the survivors shrink the communicator
    /// (thread_communicator::shrink), agree on the step to start from (detail::agree_redo: this
    /// one, or the one before when some survivor had not completed it), put that step's start
    /// back, rebuild what depends on the replica count and compute again with the same global
    /// batch: the result has lost > 0, and fn must compute what its shard_range names (global
    /// sample indices), since this call's fn may compute the step before it again. A second
    /// failure in the same call, a deterministic error, or fewer survivors than
    /// train_params::min_replicas throw as without shrink. See docs/fault_tolerance.md.
    /// The learning rate of step steps() (train_params::lr) must be finite and >= 0: else
    /// errc::invalid_argument naming the replica, the step and the value, on every replica,
    /// before any collective and with nothing changed.
    template <class Fn>
    step_result step(std::size_t global_batch, Fn&& fn) {
        const auto inside = this->enter("data_parallel.step");
        (void)core_.checked_lr(core_.steps());
        return this->run_step(global_batch, fn);
    }

    /// Counts one launch of the CUDA graph holding the step captured last (see step()): call it
    /// once per launch, after cudaGraphLaunch on the communicator's stream. ensures: steps()
    /// grows by 1, samples() by the captured global_batch and every layer's host counter
    /// (batch_norm::num_batches_tracked) by what the captured step counted, as after the plain
    /// step; the result is this launch's (the graph records the read's event on every launch):
    /// with train_params::read_result it is waited for here (through the communicator, throwing
    /// the step's errors and aborting the communicator as step() does), else read_result()
    /// reads it.
    /// requires: a step was captured; the stream is not being captured; train_params::lr gives
    /// step steps() the captured rate, which every launch applies; no plain step of a global
    /// batch not run before the capture ran since (it may have reallocated buffers the graph
    /// uses). Otherwise lockstep::error (errc::invalid_argument) naming the values, and nothing
    /// is counted.
    step_result count_replay() {
        const auto inside = this->enter("data_parallel.count_replay");
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        const std::size_t global = capture_.check_replay(
            this->rank(), detail::capturing(core_.comm().system()), r.step, r.lr);
        (void)next_sample_offset(core_.samples(), global, this->rank());
        core_.advance(global);
        capture_.count_layers();
        r.ready = false;
        parts_->stages.set_last(r);
        if (!core_.params().read_result)
            return r;
        try {
            return parts_->stages.finish_result(r);
        } catch (...) {
            abort_communicator();
            throw;
        }
    }

    /// The result of the last step (or counted launch, count_replay()): waits for it (one
    /// synchronisation through the communicator's polling wait) and throws the errors it found,
    /// as step() does with train_params::read_result. Use it with read_result = false, e.g.
    /// every N steps. requires: this trainer took a step (one resumed from a checkpoint has a
    /// step count but no step of its own until it takes one; a load also forgets the step taken
    /// before it, whose result, unread, belonged to the replaced state); the stream is not being
    /// captured
    /// into a CUDA graph (else errc::invalid_argument, and the communicator stays usable).
    step_result read_result() {
        this->check_use("data_parallel.read_result");
        LOCKSTEP_REQUIRE(parts_->stages.has_last(), errc::invalid_argument, this->rank(),
                         "data_parallel.read_result", "no step was taken yet",
                         core_.steps() > 0 ? " by this trainer (its step count comes from a "
                                             "checkpoint or a rebuild)"
                                           : "");
        LOCKSTEP_REQUIRE(!detail::capturing(core_.comm().system()), errc::invalid_argument,
                         this->rank(), "data_parallel.read_result",
                         "the stream is being captured into a CUDA graph: the result of step ",
                         parts_->stages.last().step,
                         " is read after a launch of the graph (count_replay), not inside it");
        try {
            return parts_->stages.finish_result(parts_->stages.last());
        } catch (...) {
            abort_communicator();
            throw;
        }
    }

    /// Ends training (collective: call it on every replica after its last step, as torch's
    /// join() and hvd.join()): first checks that every replica ran as many steps (one small
    /// tagged all_reduce, detail::finish_steps), then reads the last step's result if it was
    /// not read (train_params::read_result = false: one wait, throwing its errors, the run of
    /// skipped steps included), then local SGD averages the weights if steps ran since the last
    /// average, then waits for a background checkpoint save still unresolved
    /// (save_checkpoint_async: commits it, or throws its failure unless every replica's step
    /// results reported it already). ensures: returns steps(); skipped_steps() is the run's count
    /// of skipped steps; a replica that ran fewer or more steps makes it throw lockstep::error on
    /// every replica, the short one included (count_mismatch naming each replica's count, or, when
    /// a peer is still inside a step, the mismatch of finish's collective with the peer's, naming
    /// both calls; with buckets overlapped on a host communication thread, finish's collective
    /// runs on its split too, where such a peer may wait first; on NCCL a peer in a bucket
    /// reduction ends in the communicator's timeout instead). The destructor checks nothing (it
    /// cannot throw): without finish() a replica that stops early returns normally while its peers
    /// fail (docs/train_api.md).
    std::int64_t finish() {
        this->check_use("data_parallel.finish");
        const std::int64_t steps = finish_counts();
        if (parts_->stages.unread() && !detail::capturing(core_.comm().system()))
            (void)read_result();
        parts_->driver.finish(parts_->stages, parts_->collective);
        (void)saves_->resolve(core_.comm(), "data_parallel.finish", false);
        return steps;
    }

    /// The steps skipped on this replica since the trainer was built (step_result::skipped;
    /// the same on every replica for synchronous training), as of the last result read: after
    /// every step with train_params::read_result, else after read_result() or finish().
    std::int64_t skipped_steps() const noexcept { return parts_->stages.skipped_steps(); }

    /// The latest report of train_params::report_stragglers_every (empty while it is off or
    /// before its first report): the same on every replica.
    const std::optional<straggler_report>& straggler() const noexcept { return stragglers_.last(); }

    /// The gradient hook: called on every replica as f(gradient, layout) after the reduction
    /// (synchronous: the reduced gradient, the same on every replica; reduce::parameter_server:
    /// on Root only, where the update runs; reduce::sharded: only this replica's shard,
    /// optimizer_shard(), holds the reduced gradient, the other elements its own unreduced one,
    /// and only the shard reaches the update; local SGD: this replica's gradient) and before the
    /// clipping norm and the update, with the flat gradient (the system's memory) and the
    /// registry's layout (registry().parameters()). f may change the gradient in place, and must
    /// change it identically on every replica; it runs on the replica's thread between kernels
    /// of the step (a host read of the gradient on a device system waits for the step so far).
    /// An empty f removes the hook.
    void
    set_gradient_hook(std::function<void(std::span<value_type>, std::span<const tensor_info>)> f) {
        parts_->stages.set_gradient_hook(std::move(f));
    }

    /// The reduction pieces (buckets) in launch order, and collectives issued so far.
    const std::vector<detail::bucket>& buckets() const noexcept {
        return parts_->collective.plan();
    }
    /// True when gradient buckets are reduced on a communication stream (train_params::overlap).
    bool overlaps() const noexcept { return parts_->collective.overlaps(); }
    std::size_t collectives() const noexcept { return parts_->collective.collectives(); }
    /// The dynamic loss scale (train_params::loss_scale; disabled without it): its state() and
    /// restore() between steps are what a checkpoint keeps of it.
    loss_scaler<system_type>& scaler() noexcept { return parts_->stages.scaler(); }

private:
    friend struct detail::checkpoint_access;
    using base_type::abort_communicator;
    using base_type::capture_;
    using base_type::core_;
    using base_type::finish_counts;
    using base_type::parts_;
    using base_type::saves_;
    using base_type::stragglers_;
    using base_type::unsettled_;
};

} // namespace lockstep

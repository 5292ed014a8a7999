// lockstep/train/data_parallel.hpp: data_parallel<Network, Optimizer, SyncPolicy, ReducePolicy,
// Communicator>, the trainer (synchronous and local SGD; the asynchronous modes are the
// specialisations in train/asynchronous.hpp). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/step_status.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/train/asynchronous.hpp" // IWYU pragma: export
#include "lockstep/train/detail/data_parallel_fwd.hpp"
#include "lockstep/train/detail/finish_check.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/detail/overlap.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/reduce_reproducible.hpp"
#include "lockstep/train/detail/reducer.hpp"
#include "lockstep/train/detail/replica_consistency.hpp"
#include "lockstep/train/detail/step_capture.hpp"
#include "lockstep/train/detail/step_checks.hpp"
#include "lockstep/train/detail/trainer_base.hpp"
#include "lockstep/train/detail/visitor.hpp"
#include "lockstep/train/loss_scaler.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <thrust/fill.h>

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
    : public detail::trainer_base<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator> {
    static_assert(!is_asynchronous_v<SyncPolicy>,
                  "data_parallel with sync::asynchronous or sync::bounded_staleness is defined "
                  "in lockstep/train/asynchronous.hpp: include it.");
    using base_type =
        detail::trainer_base<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator>;

public:
    // The aliases and accessors are trainer_base's (network(), context(), optimizer(), rank(),
    // size(), parameters(), registry(), steps(), samples()).
    using typename base_type::system_type;
    using typename base_type::value_type;

    /// Builds this replica's network with factory(ctx), checks that every replica declared
    /// the same parameters and state (else every replica throws lockstep::error naming the
    /// first differing tensor and both shapes) and the same settings: the optimizer type and
    /// hyperparameters, micro_batches, overlap, skip_non_finite, max_grad_norm, the frozen and
    /// decaying tensors, the sync, reduce and BN policies (else every replica throws naming each
    /// differing setting with both values), broadcasts replica 0's values and state, and
    /// prepares the optimizer (params `opt`) over the flat parameter buffer. Collective: every
    /// replica of comm constructs its trainer. requires: comm outlives the trainer.
    template <class Factory>
    data_parallel(Communicator& comm, Factory&& factory, typename Optimizer::params_type opt = {},
                  train_params tp = {})
        : base_type(comm, std::forward<Factory>(factory), std::move(opt), std::move(tp),
                    base_type::policy_settings(), true),
          reducer_(comm, core_.registry().parameters(),
                   detail::use_overlap(comm, core_.params().overlap)),
          rows_((replica_slot::slots + (sharded ? detail::shard_check_slots : 0)) *
                static_cast<std::size_t>(comm.size())),
          status_(rows_ + status_size, comm.system()), skip_(1, comm.system()),
          checks_(reducer_.plan(), core_.registry().grads().size(), comm.system()),
          read_(rows_ + status_size, comm.system()),
          scaler_(core_.params().loss_scale, comm.system(), comm.rank()),
          losses_(reproducible ? 3 : 0, comm.system()) {
        if constexpr (reproducible)
            LOCKSTEP_REQUIRE(core_.params().micro_batches == 1, errc::invalid_argument, comm.rank(),
                             "data_parallel", "micro_batches = ", core_.params().micro_batches,
                             ": reduce::reproducible cuts every global batch into chunks of ",
                             ReducePolicy::chunk_samples, " samples itself (use 1)");
        const std::int64_t every = core_.params().verify_every;
        LOCKSTEP_REQUIRE(every >= 0, errc::invalid_argument, comm.rank(), "data_parallel",
                         "verify_every = ", every, " (must be >= 0; 0 is off)");
        if constexpr (is_local_sgd_v<SyncPolicy>)
            LOCKSTEP_REQUIRE(every % static_cast<std::int64_t>(SyncPolicy::period) == 0,
                             errc::invalid_argument, comm.rank(), "data_parallel",
                             "verify_every = ", every, " is not a multiple of local SGD's period ",
                             SyncPolicy::period,
                             ": the replicas hold the same weights only right after an average");
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
    /// (see reproducible_step below), never with micro-batches.
    /// sync::local_sgd<K>: scale = 1 / (this replica's samples), each replica updates alone,
    /// weights (and state) are averaged over replicas every K steps; each average first checks
    /// that every replica passed the same global_batch and used the same lr in the steps since
    /// the last one (else it throws on every replica naming the step and both values); a skip
    /// decision is this replica's own.
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
    /// different global_batch or used different learning rates in this step (checked in the step's
    /// status all_reduce; this one also throws, on every replica, naming both values). fn may also
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
    /// errc::unsupported before any work), the step is RECORDED, not run: it returns with
    /// ready == false without waiting (whatever train_params::read_result says), steps(),
    /// samples() and read_result() stay as they were, and each launch of the graph is counted
    /// by count_replay(). A launch repeats the device work with the values of the capture (lr,
    /// global_batch, the step index and sample offsets fn saw); weights, optimizer state and
    /// step count, the loss scale and the step's status advance in device memory. During the
    /// capture ctx.loss_scale() throws with loss scaling (read loss_scale_device()). See
    /// docs/train_api.md, "Capturing a step in a CUDA graph".
    template <class Fn>
    step_result step(std::size_t global_batch, Fn&& fn) {
        const bool capture = detail::capturing(core_.comm().system());
        if (capture)
            detail::step_capture::check_capturable(
                this->rank(), is_local_sgd_v<SyncPolicy>,
                reducer_.overlaps() && !detail::overlaps_on_side_stream<Communicator>);
        try {
            capturing_ = capture;
            step_result r;
            if constexpr (is_local_sgd_v<SyncPolicy>)
                r = local_step(global_batch, fn);
            else if constexpr (reproducible)
                r = reproducible_step(global_batch, fn);
            else
                r = synchronous_step(global_batch, fn);
            if (capture) {
                // Nothing ran: the host counts each launch instead (count_replay).
                capture_.record(r.step, global_batch, r.lr);
                core_.retract(global_batch);
                capturing_ = false;
            } else {
                verify_replicas_if_due();
            }
            return r;
        } catch (...) {
            capturing_ = false;
            reducer_.drain();
            abort_communicator();
            throw;
        }
    }

    /// Counts one launch of the CUDA graph holding the step captured last (see step()): call it
    /// once per launch, after cudaGraphLaunch on the communicator's stream. ensures: steps()
    /// grows by 1 and samples() by the captured global_batch, as after the plain step; the
    /// result is this launch's (the graph records the read's event on every launch): with
    /// train_params::read_result it is waited for here (through the communicator, throwing the
    /// step's errors and aborting the communicator as step() does), else read_result() reads it.
    /// requires: a step was captured; the stream is not being captured; train_params::lr gives
    /// step steps() the captured rate, which every launch applies. Otherwise lockstep::error
    /// (errc::invalid_argument) naming the values, and nothing is counted.
    step_result count_replay() {
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        const std::size_t global = capture_.check_replay(
            this->rank(), detail::capturing(core_.comm().system()), r.step, r.lr);
        (void)next_sample_offset(core_.samples(), global, this->rank());
        core_.advance(global);
        r.ready = false;
        last_ = r;
        if (!core_.params().read_result)
            return r;
        try {
            return finish_result(r);
        } catch (...) {
            abort_communicator();
            throw;
        }
    }

    /// The result of the last step (or counted launch, count_replay()): waits for it (one
    /// synchronisation through the communicator's polling wait) and throws the errors it found,
    /// as step() does with train_params::read_result. Use it with read_result = false, e.g.
    /// every N steps. requires: a step was taken; the stream is not being captured into a CUDA
    /// graph (else errc::invalid_argument, and the communicator stays usable).
    step_result read_result() {
        LOCKSTEP_REQUIRE(core_.steps() > 0, errc::invalid_argument, this->rank(),
                         "data_parallel.read_result", "no step was taken yet");
        LOCKSTEP_REQUIRE(!detail::capturing(core_.comm().system()), errc::invalid_argument,
                         this->rank(), "data_parallel.read_result",
                         "the stream is being captured into a CUDA graph: the result of step ",
                         last_.step,
                         " is read after a launch of the graph (count_replay), not inside it");
        try {
            return finish_result(last_);
        } catch (...) {
            abort_communicator();
            throw;
        }
    }

    /// Ends training (collective: call it on every replica after its last step, as torch's
    /// join() and hvd.join()): first checks that every replica ran as many steps (one small
    /// tagged all_reduce, detail::finish_steps), then local SGD averages the weights if steps
    /// ran since the last average. ensures: returns steps(); a replica that ran fewer or more
    /// steps makes it throw lockstep::error on every replica, the short one included
    /// (count_mismatch naming each replica's count, or, when a peer is still inside a step, the
    /// mismatch of finish's collective with the peer's, naming both calls). The destructor
    /// checks nothing (it cannot throw): without finish() a replica that stops early returns
    /// normally while its peers fail (docs/train_api.md).
    std::int64_t finish() {
        const std::int64_t steps = detail::finish_steps(core_.comm(), this->steps());
        if constexpr (is_local_sgd_v<SyncPolicy>) {
            if (since_average_ > 0)
                average();
        }
        return steps;
    }

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
        gradient_hook_ = std::move(f);
    }

    /// The reduction pieces (buckets) in launch order, and collectives issued so far.
    const std::vector<detail::bucket>& buckets() const noexcept { return reducer_.plan(); }
    /// True when gradient buckets are reduced on a communication stream (train_params::overlap).
    bool overlaps() const noexcept { return reducer_.overlaps(); }
    std::size_t collectives() const noexcept { return reducer_.collectives(); }
    /// The dynamic loss scale (train_params::loss_scale; disabled without it): its state() and
    /// restore() between steps are what a checkpoint keeps of it.
    loss_scaler<system_type>& scaler() noexcept { return scaler_; }

private:
    friend struct detail::checkpoint_access;
    using T = value_type;
    using base_type::core_;
    /// The step's status followed by the loss scale's report (kernels::loss_scale_report_slot).
    static constexpr std::size_t status_size =
        status_slot::slots + kernels::loss_scale_report_slot::slots;
    static constexpr bool reproducible = ReducePolicy::kind == reduce_kind::reproducible;

    template <class Fn>
    step_result synchronous_step(std::size_t global, Fn& fn) {
        auto& ctx = core_.context();
        const auto sys = core_.comm().system();
        begin_status();
        ctx.set_loss_scale(scaler_.scale_device(), host_loss_scale());
        core_.zero_grads();
        // Each piece is checked for NaN/inf right before its reduction: the counts are this
        // replica's own, so the message can name the replica and the tensor.
        reducer_.begin(core_.grads(), [this, sys](std::size_t k, const detail::bucket& b) {
            checks_.check_piece(sys, std::span<const T>(core_.grads()), k, b);
        });
        double host_loss = 0;
        {
            detail::status_scope scope(sink_);
            ctx.set_loss_slot(fixed() + status_slot::loss);
            host_loss = core_.run_micro_batches(global, fn, false, [&] {
                if constexpr (!base_type::uses_visitor)
                    ctx.set_ready_hook([this](std::size_t t) { reducer_.mark_ready(t); });
            });
            ctx.set_loss_slot(nullptr);
        }
        core_.pack_grads();
        reducer_.finish();
        scaler_.unscale(core_.grads());
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        checks_.finish_local(sys, host_loss, static_cast<double>(global), r.lr, fixed(),
                             row(this->rank()));
        constexpr bool server = ReducePolicy::kind == reduce_kind::parameter_server;
        after_reduction(sys, !server || this->rank() == server_root());
        if constexpr (sharded)
            kernels::for_each_index(sys, 1, detail::shard_checks_to_row_fn{fixed(), shard_row()});
        // The status (per-replica rows, loss, non-finite counts, layer errors) is summed over
        // replicas in one small all_reduce: every replica then takes the same skip decision,
        // and the gradient factor from the same norm (the reduced gradient is identical on
        // every replica; parameter_server: only Root's is reduced, and only Root updates).
        std::span<double> reduced = status_.span().first(rows_ + status_slot::reduced);
        core_.comm().all_reduce(std::span<const double>(reduced), reduced, reduce_op::sum);
        if constexpr (sharded)
            kernels::for_each_index(
                sys, 1,
                detail::combine_shard_checks_fn{
                    row(0) + replica_slot::slots * static_cast<std::size_t>(core_.comm().size()),
                    core_.comm().size(), fixed()});
        decide_skip(sys, core_.comm().size(), row(0));
        scaler_.update(fixed(), fixed() + status_slot::slots);
        commit_layers();
        core_.optimizer().set_lr(r.lr);
        auto values = core_.values();
        // The optimizer's elements: all of them, or this replica's shard (reduce::sharded).
        const detail::shard_extent own = core_.optimizer_shard();
        reducer_.apply(values, [&] {
            scale_gradient(sys);
            core_.optimizer().step(values.subspan(own.offset, own.count),
                                   std::span<const T>(core_.grads().subspan(own.offset, own.count)),
                                   skip_.data());
        });
        core_.unpack_values();
        core_.advance(global);
        return end_step(r);
    }

    // --- reduce::reproducible ---
    /// reduce::reproducible<C>: the global batch is cut into chunks [k C, min((k + 1) C,
    /// global)); this replica computes its contiguous run of chunks (reproducible_chunks), one fn
    /// call per chunk on zeroed gradients with scale = 1 / global (a replica without chunks calls
    /// fn once with an empty range, so the network's layers take part in the step), and adds
    /// each chunk's gradient and loss exactly into the binned accumulator. Then: this replica's
    /// own sums are checked (non-finite counts name the replica), the accumulator is reduced
    /// across replicas (int64 MAX, then int64 SUM) and rounded once into the gradient, and the
    /// step continues as the synchronous one (status all_reduce, skip decision, update). The
    /// loss reported is the exact sum, rounded once (replica 0 contributes it to the status
    /// sum, the others 0). ensures: every replica, for every replica count, holds the same bits.
    template <class Fn>
    step_result reproducible_step(std::size_t global, Fn& fn) {
        auto& ctx = core_.context();
        const auto sys = core_.comm().system();
        auto& acc = reducer_.accumulator();
        const std::span<T> grads = core_.grads().first(acc.size());
        LOCKSTEP_REQUIRE(global >= 1, errc::invalid_argument, this->rank(), "data_parallel.step",
                         "global batch size is 0");
        (void)next_sample_offset(core_.samples(), global, this->rank());
        const bn::detail::ghost_step_scope ghost_scope(global);
        begin_status();
        ctx.set_loss_scale(scaler_.scale_device(), host_loss_scale());
        acc.clear();
        constexpr std::size_t chunk = ReducePolicy::chunk_samples;
        const shard_range mine =
            detail::reproducible_chunks(global, chunk, this->rank(), this->size());
        double* chunk_loss = losses_.data();
        {
            detail::status_scope scope(sink_);
            ctx.set_step(core_.steps(), true);
            const std::size_t calls = mine.empty() ? 1 : mine.size();
            for (std::size_t c = 0; c < calls; ++c) {
                shard_range r;
                if (!mine.empty()) {
                    r.begin = (mine.begin + c) * chunk;
                    r.end = std::min(global, r.begin + chunk);
                } else {
                    r.begin = r.end = global;
                }
                r.global_size = global;
                r.sample_offset = core_.samples();
                r.scale = r.empty() ? 0.0 : 1.0 / static_cast<double>(global);
                core_.zero_grads();
                thrust::fill(sys.policy(), chunk_loss, chunk_loss + 1, 0.0);
                ctx.set_loss_slot(chunk_loss);
                double host_loss = 0;
                if constexpr (std::is_void_v<decltype(fn(core_.network(), r, ctx))>)
                    fn(core_.network(), r, ctx);
                else
                    host_loss = static_cast<double>(fn(core_.network(), r, ctx));
                ctx.set_loss_slot(nullptr);
                core_.pack_grads();
                acc.add(std::span<const T>(grads));
                acc.add_loss(host_loss, chunk_loss);
            }
            ctx.set_step(core_.steps(), false);
        }
        // This replica's own sum first: its non-finite elements and loss are counted as its own.
        double* own_loss = chunk_loss + 1;
        acc.finalize_local(grads, own_loss);
        const auto& plan = reducer_.plan();
        for (std::size_t k = 0; k < plan.size(); ++k)
            checks_.check_piece(sys, std::span<const T>(core_.grads()), k, plan[k]);
        acc.reduce(core_.comm());
        reducer_.count_step();
        double* global_loss = chunk_loss + 2;
        acc.finalize(grads, global_loss);
        scaler_.unscale(core_.grads());
        kernels::for_each_index(sys, 1,
                                detail::reproducible_loss_fn{own_loss, global_loss,
                                                             this->rank() == 0,
                                                             fixed() + status_slot::loss});
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        checks_.finish_local(sys, 0.0, static_cast<double>(global), r.lr, fixed(),
                             row(this->rank()));
        after_reduction(sys, true);
        std::span<double> reduced = status_.span().first(rows_ + status_slot::reduced);
        core_.comm().all_reduce(std::span<const double>(reduced), reduced, reduce_op::sum);
        decide_skip(sys, core_.comm().size(), row(0));
        scaler_.update(fixed(), fixed() + status_slot::slots);
        commit_layers();
        core_.optimizer().set_lr(r.lr);
        scale_gradient(sys);
        core_.optimizer().step(core_.values(), std::span<const T>(core_.grads()), skip_.data());
        core_.unpack_values();
        core_.advance(global);
        return end_step(r);
    }

    template <class Fn>
    step_result local_step(std::size_t global, Fn& fn) {
        auto& ctx = core_.context();
        const auto sys = core_.comm().system();
        begin_status();
        ctx.set_loss_scale(scaler_.scale_device(), host_loss_scale());
        core_.zero_grads();
        double host_loss = 0;
        {
            detail::status_scope scope(sink_);
            ctx.set_loss_slot(fixed() + status_slot::loss);
            host_loss = core_.run_micro_batches(global, fn, true, [] {});
            ctx.set_loss_slot(nullptr);
        }
        core_.pack_grads();
        scaler_.unscale(core_.grads());
        const auto& plan = reducer_.plan();
        for (std::size_t k = 0; k < plan.size(); ++k)
            checks_.check_piece(sys, std::span<const T>(core_.grads()), k, plan[k]);
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        checks_.finish_local(sys, host_loss, static_cast<double>(global), r.lr, fixed(),
                             row(this->rank()));
        local_settings_.push_back(static_cast<double>(global));
        local_settings_.push_back(r.lr);
        after_reduction(sys, true);
        decide_skip(sys, 1, row(this->rank())); // this replica alone: no status collective
        scaler_.update(fixed(), fixed() + status_slot::slots);
        commit_layers();
        core_.optimizer().set_lr(r.lr);
        scale_gradient(sys);
        core_.optimizer().step(core_.values(), std::span<const T>(core_.grads()), skip_.data());
        core_.unpack_values();
        core_.advance(global);
        r = end_step(r);
        if (++since_average_ == SyncPolicy::period)
            average();
        return r;
    }

    /// reduce::sharded: each replica reduces, checks and updates its shard only.
    static constexpr bool sharded = ReducePolicy::kind == reduce_kind::sharded;

    /// reduce::sharded: this replica's row of the shard check block (after the replica rows).
    double* shard_row() noexcept {
        return status_.data() +
               replica_slot::slots * static_cast<std::size_t>(core_.comm().size()) +
               detail::shard_check_slots * static_cast<std::size_t>(this->rank());
    }

    static constexpr int server_root() {
        if constexpr (ReducePolicy::kind == reduce_kind::parameter_server)
            return ReducePolicy::root;
        else
            return 0;
    }

    /// The status_slot block and replica r's row of the status buffer (system memory).
    double* fixed() noexcept { return status_.data() + rows_; }
    double* row(int r) noexcept {
        return status_.data() + static_cast<std::size_t>(r) * replica_slot::slots;
    }

    /// Between reduction and update: frozen gradients zeroed, the gradient hook (where
    /// `hook`), then the reduced gradient's non-finite count and squared norm on the device.
    void after_reduction(const system_type& sys, bool hook) {
        core_.zero_frozen_grads();
        if (hook && gradient_hook_)
            gradient_hook_(core_.grads(),
                           std::span<const tensor_info>(core_.registry().parameters()));
        if constexpr (sharded) {
            // Only the shard is reduced: its count, first index and squared norm are summed over
            // replicas by the status all_reduce (shard_checks_to_row_fn, combine_shard_checks_fn).
            const detail::shard_extent own = core_.optimizer_shard();
            checks_.check_reduced(sys, std::span<const T>(core_.grads()), own.offset,
                                  own.offset + own.count, core_.params().max_grad_norm > 0,
                                  fixed());
        } else {
            checks_.check_reduced(sys, std::span<const T>(core_.grads()),
                                  core_.params().max_grad_norm > 0, fixed());
        }
    }

    /// What ctx.loss_scale() answers in this step: the scale the host knows, except while
    /// capturing with loss scaling (a launch runs with the scale then in device memory, which
    /// the host value at the capture would freeze into the graph).
    std::optional<double> host_loss_scale() const {
        if (capturing_ && scaler_.enabled())
            return std::nullopt;
        return scaler_.known_scale();
    }

    /// Zeroes the step's status and points the layers' error reports and commit hooks at it.
    void begin_status() {
        const auto sys = core_.comm().system();
        thrust::fill(sys.policy(), status_.data(), status_.data() + status_.size(), 0.0);
        kernels::for_each_index(sys, 1, detail::status_defaults_fn{fixed()});
        commits_.clear();
        sink_ = detail::status_sink{fixed(), 0, skip_.data(), &commits_, detail::next_step_id()};
    }

    void decide_skip(const system_type& sys, int replicas, const double* rows) {
        kernels::for_each_index(sys, 1,
                                detail::decide_skip_fn{fixed(), rows, replicas, skip_.data(),
                                                       core_.params().max_grad_norm});
    }

    /// The layers that changed state in the forward pass keep or restore it (skip flag).
    void commit_layers() {
        for (const detail::step_commit_hook& h : commits_)
            h.commit(h.object, skip_.data());
        commits_.clear();
    }

    /// The gradient factor (clipping), on the device, when one can differ from 1.
    void scale_gradient(const system_type& sys) {
        const detail::shard_extent own = core_.optimizer_shard();
        if (core_.params().max_grad_norm > 0)
            detail::apply_grad_factor(sys, core_.grads().subspan(own.offset, own.count), fixed(),
                                      skip_.data());
    }

    /// Queues the read of the status; with read_result, waits for it and returns the result.
    /// While capturing: the read is part of the graph (each launch repeats it); nothing waits
    /// and last_ stays the last step that ran.
    step_result end_step(step_result r) {
        read_.enqueue(std::span<const double>(status_.span()));
        r.ready = false;
        if (capturing_)
            return r;
        last_ = r;
        if (core_.params().read_result)
            return finish_result(r);
        return r;
    }

    /// Waits for the status read of step r, fills r and throws the step's errors.
    step_result finish_result(step_result r) {
        const std::span<const double> all = wait_for(core_.comm(), read_, "data_parallel.step");
        const std::span<const double> st = all.subspan(rows_);
        r.loss = st[status_slot::loss];
        r.skipped = st[status_slot::skip] != 0;
        r.loss_scale =
            scaler_.observe(st.subspan(status_slot::slots), r.step + 1 == core_.steps()).used;
        r.ready = true;
        const int me = this->rank();
        if (st[status_slot::mismatch] != 0)
            fail(errc::invalid_argument, me, "data_parallel.step", "step ", r.step,
                 " skipped: the replicas disagree:", mismatch_text(all));
        if (st[status_slot::layer_errors] > 0) {
            const auto code =
                static_cast<layer_error>(static_cast<int>(st[status_slot::error_code]));
            const auto layer = static_cast<int>(st[status_slot::error_layer]);
            const auto value = static_cast<int>(st[status_slot::error_value]);
            if (code == layer_error::peer_invalid_input)
                fail(errc::peer_failure, me, "data_parallel.step", "step ", r.step,
                     " skipped: batch_norm layer ", layer, " (in forward order): replica ", value,
                     " passed invalid input to it");
            if (code == layer_error::single_value)
                fail(errc::invalid_argument, me, "data_parallel.step", "step ", r.step,
                     " skipped: batch_norm layer ", layer,
                     " (in forward order): expected more than 1 value per channel when training, "
                     "got 1",
                     value >= 0 ? lockstep::detail::concat(" on replica ", value)
                                : std::string(" over the replicas sharing statistics"));
            fail(errc::peer_failure, me, "data_parallel.step", "step ", r.step,
                 " skipped: ", st[status_slot::layer_errors],
                 " batch_norm layer error(s) on other replicas (statistics of another group)");
        }
        const bool bad = st[status_slot::non_finite] > 0 || st[status_slot::loss_non_finite] > 0 ||
                         st[status_slot::reduced_non_finite] > 0;
        // With loss scaling a non-finite gradient is an overflow: skipped, never thrown.
        if (bad && !core_.params().skip_non_finite && !scaler_.enabled())
            fail(errc::non_finite, me, "data_parallel.step", "step ", r.step, ":",
                 non_finite_text(all));
        return r;
    }

    /// The replicas (rows) whose global_batch or lr differs from replica 0's, both values.
    std::string mismatch_text(std::span<const double> all) {
        std::string out;
        const int n = is_local_sgd_v<SyncPolicy> ? 1 : core_.comm().size();
        const double* r0 = all.data();
        for (int r = 1; r < n; ++r) {
            const double* rr = all.data() + static_cast<std::size_t>(r) * replica_slot::slots;
            if (rr[replica_slot::global_batch] != r0[replica_slot::global_batch])
                out += lockstep::detail::concat(" global_batch: ", r0[replica_slot::global_batch],
                                                " on replica 0, ", rr[replica_slot::global_batch],
                                                " on replica ", r, ";");
            if (rr[replica_slot::lr] != r0[replica_slot::lr])
                out += " lr: " + detail::exact(r0[replica_slot::lr]) + " on replica 0, " +
                       detail::exact(rr[replica_slot::lr]) + " on replica " + std::to_string(r) +
                       ";";
        }
        return out;
    }

    /// The registration name of the parameter holding flat element `index`, with the element.
    std::string tensor_at(double one_based) {
        const auto index = static_cast<std::size_t>(one_based) - 1;
        for (const tensor_info& t : core_.registry().parameters())
            if (index >= t.offset && index < t.offset + t.size)
                return lockstep::detail::concat("'", t.name, "' (element ", index - t.offset, ")");
        return lockstep::detail::concat("flat element ", index);
    }

    /// Per replica: its non-finite gradient elements before reduction, the first one's tensor,
    /// a non-finite loss; or the reduced gradient's count when only the sum overflowed.
    std::string non_finite_text(std::span<const double> all) {
        const std::span<const double> st = all.subspan(rows_);
        std::string out;
        const int n = core_.comm().size();
        const char* scope = is_local_sgd_v<SyncPolicy> ? " (local SGD)" : "";
        for (int r = 0; r < n; ++r) {
            const double* rr = all.data() + static_cast<std::size_t>(r) * replica_slot::slots;
            if (rr[replica_slot::non_finite] > 0)
                out += lockstep::detail::concat(" ", rr[replica_slot::non_finite],
                                                " non-finite gradient element(s) on replica ", r,
                                                scope, ", the first in ",
                                                tensor_at(rr[replica_slot::first_non_finite]), ";");
            if (rr[replica_slot::loss_non_finite] > 0)
                out +=
                    lockstep::detail::concat(" the loss is not finite on replica ", r, scope, ";");
        }
        if (out.empty() && st[status_slot::reduced_non_finite] > 0)
            out = lockstep::detail::concat(
                " the reduced gradient has ", st[status_slot::reduced_non_finite],
                " non-finite element(s) (the sum over replicas overflowed), the first in ",
                tensor_at(st[status_slot::reduced_first]));
        return out;
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

    /// Local SGD, before an average: every replica's global_batch and lr of each step since the
    /// last average are gathered (one small all_gather) and compared; a difference throws on
    /// every replica naming the step and both values.
    void verify_local_steps() {
        auto& comm = core_.comm();
        const std::size_t width = 2 * SyncPolicy::period;
        std::vector<double> mine(width, 0.0);
        const std::size_t n = std::min(local_settings_.size(), width);
        std::copy(local_settings_.end() - static_cast<std::ptrdiff_t>(n), local_settings_.end(),
                  mine.begin());
        const std::int64_t first = core_.steps() - static_cast<std::int64_t>(n / 2);
        local_settings_.clear();
        std::vector<double> all(width * static_cast<std::size_t>(comm.size()));
        detail::host_all_gather(comm, std::span<const double>(mine), std::span<double>(all));
        std::string out;
        for (int r = 1; r < comm.size(); ++r)
            for (std::size_t k = 0; k < SyncPolicy::period; ++k) {
                const double* a = all.data() + 2 * k;
                const double* b = all.data() + static_cast<std::size_t>(r) * width + 2 * k;
                if (a[0] != b[0])
                    out += lockstep::detail::concat(" step ", first + static_cast<std::int64_t>(k),
                                                    ": global_batch: ", a[0], " on replica 0, ",
                                                    b[0], " on replica ", r, ";");
                if (a[1] != b[1])
                    out +=
                        lockstep::detail::concat(" step ", first + static_cast<std::int64_t>(k),
                                                 ": lr: ", detail::exact(a[1]), " on replica 0, ",
                                                 detail::exact(b[1]), " on replica ", r, ";");
            }
        if (!out.empty())
            fail(errc::invalid_argument, comm.rank(), "data_parallel.average",
                 "the replicas disagree (local SGD, checked at the average):", out);
    }

    /// train_params::verify_every: after every verify_every-th step, the replicas compare the
    /// digests of what they must hold identically (detail/replica_consistency.hpp).
    void verify_replicas_if_due() {
        const std::int64_t every = core_.params().verify_every;
        if (every == 0 || this->steps() % every != 0)
            return;
        constexpr bool same_optimizer_state = ReducePolicy::kind != reduce_kind::sharded &&
                                              ReducePolicy::kind != reduce_kind::parameter_server &&
                                              !is_local_sgd_v<SyncPolicy>;
        constexpr bool same_state =
            is_local_sgd_v<SyncPolicy> ||
            detail::shares_running_statistics<network_bn_policies_t<Network>>::value;
        auto& reg = core_.registry();
        std::vector<detail::consistency_section<T>> sections;
        for (const tensor_info& t : reg.parameters())
            sections.push_back({"param." + t.name, core_.values().subspan(t.offset, t.size)});
        if constexpr (same_state) {
            for (const tensor_info& t : reg.state_tensors())
                sections.push_back({"state." + t.name, reg.states().subspan(t.offset, t.size)});
            detail::visit_state<T>(core_.network(), [&](std::string_view name, std::span<T> st) {
                sections.push_back({"state." + std::string(name), st});
            });
        }
        if constexpr (same_optimizer_state)
            for (const auto& slot : core_.optimizer().state().slots)
                sections.push_back({"optimizer." + std::string(slot.name), slot.data});
        detail::verify_replicas(core_.comm(), core_.comm().system(), this->steps(), sections);
    }

    /// Local SGD: values and state become the mean over replicas (collective).
    void average() {
        since_average_ = 0;
        verify_local_steps();
        auto& comm = core_.comm();
        reducer_.average(core_.values());
        core_.pack_state();
        core_.for_each_state_buffer([&](std::span<T> s) {
            comm.all_reduce(std::span<const T>(s), s, reduce_op::sum);
            detail::scale(comm.system(), s, T(1) / static_cast<T>(comm.size()));
        });
        core_.unpack_values();
        core_.unpack_state();
    }

    detail::reducer<ReducePolicy, T, Communicator> reducer_;
    std::size_t rows_; ///< doubles of the per-replica rows (reduce::sharded: then the shard
                       ///< check block) before the status_slot block
    buffer<double, system_type> status_; ///< rows (replica_slot) then the status_slot block
    buffer<int, system_type> skip_;      ///< 1: the optimizer kernels skip the update
    detail::gradient_checks<system_type> checks_;
    staged_read<double, system_type> read_;
    detail::status_sink sink_{};
    std::vector<detail::step_commit_hook> commits_;
    std::function<void(std::span<T>, std::span<const tensor_info>)> gradient_hook_;
    step_result last_{};
    bool capturing_ = false;       ///< the step being recorded is captured into a CUDA graph
    detail::step_capture capture_; ///< the step captured last (count_replay)
    std::size_t since_average_ = 0;
    std::vector<double> local_settings_; ///< local SGD: {global_batch, lr} per step since average
    loss_scaler<system_type> scaler_;
    buffer<double, system_type> losses_; ///< reproducible: chunk, own and global loss
};

} // namespace lockstep

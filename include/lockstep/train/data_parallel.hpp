// lockstep/train/data_parallel.hpp: data_parallel<Network, Optimizer, SyncPolicy, ReducePolicy,
// Communicator>, the trainer (synchronous and local SGD; the asynchronous modes are the
// specialisations in train/asynchronous.hpp). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/step_status.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/train/asynchronous.hpp" // IWYU pragma: export
#include "lockstep/train/detail/data_parallel_fwd.hpp"
#include "lockstep/train/detail/overlap.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/reducer.hpp"
#include "lockstep/train/detail/replica_core.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <span>
#include <utility>

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
///   reduce::compressed<half|bfloat16>.
/// - Communicator: thread_communicator, mpi_communicator, nccl_communicator.
/// Invalid combinations are compile errors (policy/compat.hpp).
template <class Network, class Optimizer, sync_policy SyncPolicy, reduce_policy ReducePolicy,
          communicator Communicator>
class data_parallel {
    static_assert(
        check_compatible<SyncPolicy, ReducePolicy, Communicator, network_bn_policies_t<Network>>());
    static_assert(!is_asynchronous_v<SyncPolicy>,
                  "data_parallel with sync::asynchronous or sync::bounded_staleness is defined "
                  "in lockstep/train/asynchronous.hpp: include it.");
    using core_type = detail::replica_core<Network, Optimizer, Communicator>;

public:
    using network_type = Network;
    using optimizer_type = Optimizer;
    using communicator_type = Communicator;
    using value_type = typename Optimizer::value_type;
    using system_type = typename Communicator::system_type;
    using context_type = replica_context<value_type, Communicator>;
    using sync_policy_type = SyncPolicy;
    using reduce_policy_type = ReducePolicy;
    /// True when the network exposes its parameters through for_each_parameter.
    static constexpr bool uses_visitor = core_type::uses_visitor;

    /// Builds this replica's network with factory(ctx), checks that every replica declared
    /// the same parameters and state (else every replica throws lockstep::error naming the
    /// first differing tensor and both shapes), broadcasts replica 0's values and state, and
    /// prepares the optimizer (params `opt`) over the flat parameter buffer. Collective: every
    /// replica of comm constructs its trainer. requires: comm outlives the trainer.
    template <class Factory>
    data_parallel(Communicator& comm, Factory&& factory, typename Optimizer::params_type opt = {},
                  train_params tp = {})
        : core_(comm, std::forward<Factory>(factory), std::move(opt), std::move(tp)),
          reducer_(comm, core_.registry().parameters(),
                   detail::use_overlap(comm, core_.params().overlap)),
          status_(status_slot::slots, comm.system()), skip_(1, comm.system()),
          partial_(detail::non_finite_tiles(core_.registry().grads().size()), comm.system()),
          read_(status_slot::slots, comm.system()) {}
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
    /// every replica: weights are bitwise identical everywhere afterwards. A NaN/inf gradient
    /// on any replica skips the step on every replica (or throws on every replica).
    /// sync::local_sgd<K>: scale = 1 / (this replica's samples), each replica updates alone,
    /// weights (and state) are averaged over replicas every K steps.
    /// fn may also return void and add its loss into ctx.loss_slot() on the device.
    /// Inside the step nothing waits on the host: the non-finite check, the layers' error checks
    /// and the skip decision stay on the device (the optimizer kernels read the skip flag), and
    /// the host reads the step's status once at the end (train_params::read_result; else
    /// read_result() does it later). A step that throws (here or in fn) aborts a communicator
    /// that can be aborted (nccl_communicator), so its peers get errc::peer_failure instead of
    /// waiting forever.
    /// requires: global_batch >= 1. ensures: the returned result is the same on every replica
    /// (synchronous).
    template <class Fn>
    step_result step(std::size_t global_batch, Fn&& fn) {
        try {
            if constexpr (is_local_sgd_v<SyncPolicy>)
                return local_step(global_batch, fn);
            else
                return synchronous_step(global_batch, fn);
        } catch (...) {
            reducer_.drain();
            abort_communicator();
            throw;
        }
    }

    /// The result of the last step: waits for it (one synchronisation through the
    /// communicator's polling wait) and throws the errors it found, as step() does with
    /// train_params::read_result. Use it with read_result = false, e.g. every N steps.
    /// requires: a step was taken.
    step_result read_result() {
        LOCKSTEP_REQUIRE(core_.steps() > 0, errc::invalid_argument, rank(),
                         "data_parallel.read_result", "no step was taken yet");
        try {
            return finish_result(last_);
        } catch (...) {
            abort_communicator();
            throw;
        }
    }

    /// Ends training: local SGD averages the weights if steps ran since the last average (a
    /// collective); a no-op for synchronous training.
    void finish() {
        if constexpr (is_local_sgd_v<SyncPolicy>) {
            if (since_average_ > 0)
                average();
        }
    }

    Network& network() noexcept { return core_.network(); }
    const Network& network() const noexcept { return core_.network(); }
    context_type& context() noexcept { return core_.context(); }
    Optimizer& optimizer() noexcept { return core_.optimizer(); }
    int rank() noexcept { return core_.comm().rank(); }
    int size() noexcept { return core_.comm().size(); }
    /// The flat parameter values (registry storage, or lockstep's packed copy with the
    /// visitor), in registration order; registry().parameters() describes the layout.
    std::span<const value_type> parameters() { return core_.values(); }
    parameter_registry<value_type, system_type>& registry() noexcept { return core_.registry(); }
    /// Steps taken so far (skipped ones included).
    std::int64_t steps() const noexcept { return core_.steps(); }
    /// The reduction pieces (buckets) in launch order, and collectives issued so far.
    const std::vector<detail::bucket>& buckets() const noexcept { return reducer_.plan(); }
    /// True when gradient buckets are reduced on a communication stream (train_params::overlap).
    bool overlaps() const noexcept { return reducer_.overlaps(); }
    std::size_t collectives() const noexcept { return reducer_.collectives(); }

private:
    friend struct detail::checkpoint_access;
    using T = value_type;

    template <class Fn>
    step_result synchronous_step(std::size_t global, Fn& fn) {
        auto& ctx = core_.context();
        const auto sys = core_.comm().system();
        begin_status();
        core_.zero_grads();
        reducer_.begin(core_.grads());
        double host_loss = 0;
        {
            detail::status_scope scope(sink_);
            ctx.set_loss_slot(status_.data() + status_slot::loss);
            host_loss = core_.run_micro_batches(global, fn, false, [&] {
                if constexpr (!uses_visitor)
                    ctx.set_ready_hook([this](std::size_t t) { reducer_.mark_ready(t); });
            });
            ctx.set_loss_slot(nullptr);
        }
        core_.pack_grads();
        reducer_.finish();
        // The status (loss, non-finite count, layer errors) is summed over replicas in one small
        // all_reduce: the reduced gradient is identical on every replica (parameter_server: only
        // Root's is reduced), and the sum makes the skip decision identical too.
        detail::count_non_finite_into(sys, std::span<const T>(core_.grads()), partial_.span(),
                                      host_loss, status_.data());
        std::span<double> reduced = status_.span().first(status_slot::reduced);
        core_.comm().all_reduce(std::span<const double>(reduced), reduced, reduce_op::sum);
        decide_skip(sys);
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        core_.optimizer().set_lr(r.lr);
        auto values = core_.values();
        reducer_.apply(values, [&] {
            core_.optimizer().step(values, std::span<const T>(core_.grads()), skip_.data());
        });
        core_.unpack_values();
        core_.advance(global);
        return end_step(r);
    }

    template <class Fn>
    step_result local_step(std::size_t global, Fn& fn) {
        auto& ctx = core_.context();
        const auto sys = core_.comm().system();
        begin_status();
        core_.zero_grads();
        double host_loss = 0;
        {
            detail::status_scope scope(sink_);
            ctx.set_loss_slot(status_.data() + status_slot::loss);
            host_loss = core_.run_micro_batches(global, fn, true, [] {});
            ctx.set_loss_slot(nullptr);
        }
        core_.pack_grads();
        detail::count_non_finite_into(sys, std::span<const T>(core_.grads()), partial_.span(),
                                      host_loss, status_.data());
        decide_skip(sys);
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        core_.optimizer().set_lr(r.lr);
        core_.optimizer().step(core_.values(), std::span<const T>(core_.grads()), skip_.data());
        core_.unpack_values();
        core_.advance(global);
        r = end_step(r);
        if (++since_average_ == SyncPolicy::period)
            average();
        return r;
    }

    /// Zeroes the step's status and points the layers' error reports at it.
    void begin_status() {
        const auto sys = core_.comm().system();
        thrust::fill(sys.policy(), status_.data(), status_.data() + status_.size(), 0.0);
        sink_ = detail::status_sink{status_.data(), 0};
    }

    void decide_skip(const system_type& sys) {
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(1),
                         detail::decide_skip_fn{status_.data(), skip_.data()});
    }

    /// Queues the read of the status; with read_result, waits for it and returns the result.
    step_result end_step(step_result r) {
        read_.enqueue(std::span<const double>(status_.span()));
        r.ready = false;
        last_ = r;
        if (core_.params().read_result)
            return finish_result(r);
        return r;
    }

    /// Waits for the status read of step r, fills r and throws the step's errors.
    step_result finish_result(step_result r) {
        const std::span<const double> st = wait_for(core_.comm(), read_, "data_parallel.step");
        r.loss = st[status_slot::loss];
        r.skipped = st[status_slot::skip] != 0;
        r.ready = true;
        const int me = rank();
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
        if (st[status_slot::non_finite] > 0) {
            LOCKSTEP_REQUIRE(core_.params().skip_non_finite, errc::non_finite, me,
                             "data_parallel.step", "step ", r.step, ": ",
                             st[status_slot::non_finite],
                             is_local_sgd_v<SyncPolicy>
                                 ? " non-finite gradient elements on this replica (local SGD)"
                                 : " non-finite gradient elements over all replicas");
        }
        return r;
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

    /// Local SGD: values and state become the mean over replicas (collective).
    void average() {
        since_average_ = 0;
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

    core_type core_;
    detail::reducer<ReducePolicy, T, Communicator> reducer_;
    buffer<double, system_type> status_;  ///< the step's status (status_slot layout)
    buffer<int, system_type> skip_;       ///< 1: the optimizer kernels skip the update
    buffer<double, system_type> partial_; ///< per-tile non-finite counts
    staged_read<double, system_type> read_;
    detail::status_sink sink_{};
    step_result last_{};
    std::size_t since_average_ = 0;
};

} // namespace lockstep

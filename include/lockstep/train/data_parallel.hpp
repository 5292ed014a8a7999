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
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/detail/reducer.hpp"
#include "lockstep/train/detail/replica_core.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

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
template <class Network, class Optimizer, sync_policy SyncPolicy = sync::synchronous,
          reduce_policy ReducePolicy = reduce::bucketed<>,
          communicator Communicator = thread_communicator>
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
          reducer_(comm, core_.registry().parameters()) {}
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
    /// requires: global_batch >= 1. ensures: the returned result is the same on every replica
    /// (synchronous).
    template <class Fn>
    step_result step(std::size_t global_batch, Fn&& fn) {
        if constexpr (is_local_sgd_v<SyncPolicy>)
            return local_step(global_batch, fn);
        else
            return synchronous_step(global_batch, fn);
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
    std::size_t collectives() const noexcept { return reducer_.collectives(); }

private:
    using T = value_type;

    template <class Fn>
    step_result synchronous_step(std::size_t global, Fn& fn) {
        auto& ctx = core_.context();
        core_.zero_grads();
        reducer_.begin(core_.grads());
        const double local_loss = core_.run_micro_batches(global, fn, false, [&] {
            if constexpr (!uses_visitor)
                ctx.set_ready_hook([this](std::size_t t) { reducer_.mark_ready(t); });
        });
        core_.pack_grads();
        reducer_.finish();
        // One small all_reduce carries the loss and the non-finite count: the reduced gradient
        // is identical on every replica (parameter_server: only Root's is reduced), and the
        // count makes the skip decision identical too.
        double flags[2] = {local_loss, static_cast<double>(core_.local_non_finite())};
        detail::host_all_reduce(core_.comm(), std::span<const double>(flags, 2),
                                std::span<double>(flags, 2), reduce_op::sum);
        step_result r;
        r.loss = flags[0];
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        r.skipped = flags[1] > 0;
        if (r.skipped) {
            LOCKSTEP_REQUIRE(core_.params().skip_non_finite, errc::non_finite, rank(),
                             "data_parallel.step", "step ", r.step, ": ", flags[1],
                             " non-finite gradient elements over all replicas");
        } else {
            core_.optimizer().set_lr(r.lr);
            auto values = core_.values();
            reducer_.apply(
                values, [&] { core_.optimizer().step(values, std::span<const T>(core_.grads())); });
            core_.unpack_values();
        }
        core_.advance(global);
        return r;
    }

    template <class Fn>
    step_result local_step(std::size_t global, Fn& fn) {
        core_.zero_grads();
        step_result r;
        r.loss = core_.run_micro_batches(global, fn, true, [] {});
        core_.pack_grads();
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        const std::size_t bad = core_.local_non_finite();
        r.skipped = bad > 0;
        if (r.skipped) {
            LOCKSTEP_REQUIRE(core_.params().skip_non_finite, errc::non_finite, rank(),
                             "data_parallel.step", "step ", r.step, ": ", bad,
                             " non-finite gradient elements on this replica (local SGD)");
        } else {
            core_.optimizer().set_lr(r.lr);
            core_.optimizer().step(core_.values(), std::span<const T>(core_.grads()));
            core_.unpack_values();
        }
        core_.advance(global);
        if (++since_average_ == SyncPolicy::period)
            average();
        return r;
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
    std::size_t since_average_ = 0;
};

} // namespace lockstep

// The asynchronous specialisations (sync::asynchronous, sync::bounded_staleness<S>) come with the
// primary template, so including data_parallel.hpp gives every SyncPolicy.
#include "lockstep/train/asynchronous.hpp" // IWYU pragma: export

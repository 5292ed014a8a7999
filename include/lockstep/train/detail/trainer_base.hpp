// lockstep/train/detail/trainer_base.hpp: trainer_base, what every data_parallel trainer shares:
// the policy check, the public aliases, the replica_core and its accessors.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/nn/policy_declaration.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/train/detail/agreement.hpp"
#include "lockstep/train/detail/exclusive_use.hpp"
#include "lockstep/train/detail/replica_core.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// bn::tower<K> in a network's bn_policies takes replica K's statistics: refused at
/// construction, before the network is built, when the communicator has K replicas or fewer
/// (every replica throws: the size is the same on all). The layer checks again at each forward,
/// for a layer used outside a trainer or after a shrink.
template <class... P>
void check_bn_towers(const std::tuple<P...>* /*policies*/, int rank, int size) {
    (
        [&] {
            constexpr int k = bn::traits<P>::running_replica;
            if constexpr (k >= 0)
                LOCKSTEP_REQUIRE(k < size, errc::invalid_argument, rank, "data_parallel",
                                 bn::traits<P>::name(), " (in the network's bn_policies) takes ",
                                 "replica ", k, "'s batch statistics, but the communicator has ",
                                 size, " replica(s): use bn::tower<K> with K < ", size);
        }(),
        ...);
}

/// The base of every data_parallel trainer (synchronous, local SGD and the asynchronous
/// specialisations): checks the policy combination (policy/compat.hpp; an invalid one is a
/// compile error), defines the public aliases, owns this replica's replica_core (network,
/// context, registry, optimizer, step and sample counters) and exposes it through the accessors
/// below. Not used on its own: a trainer derives from it and adds its training entry point.
template <class Network, class Optimizer, class SyncPolicy, class ReducePolicy, class Communicator>
class trainer_base {
    static_assert(
        check_compatible<SyncPolicy, ReducePolicy, Communicator, network_bn_policies_t<Network>>());

protected:
    using core_type = replica_core<Network, Optimizer, Communicator>;

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

    trainer_base(const trainer_base&) = delete;
    trainer_base& operator=(const trainer_base&) = delete;

    /// This replica's network (built by the factory at construction).
    Network& network() noexcept { return core_.network(); }
    const Network& network() const noexcept { return core_.network(); }
    /// This replica's context: rank, size, registry, RNG, step.
    context_type& context() noexcept { return core_.context(); }
    /// The optimizer over the flat parameters (asynchronous trainers: its state advances on
    /// the server only).
    Optimizer& optimizer() noexcept { return core_.optimizer(); }
    /// The bytes of this replica's optimizer state buffers (optimizer().state() slots):
    /// reduce::sharded holds its shard's only, about 1/size() of the other policies' figure.
    std::size_t optimizer_state_bytes() const { return core_.optimizer_state_bytes(); }
    /// The elements [offset, offset + count) of the flat parameters this replica's optimizer
    /// updates: all of them, or its shard with reduce::sharded (shard_layout: contiguous, in
    /// rank order, balanced by element count, possibly empty).
    shard_extent optimizer_shard() const noexcept { return core_.optimizer_shard(); }
    /// This replica's rank and the number of replicas (the communicator's).
    int rank() noexcept { return core_.comm().rank(); }
    int size() noexcept { return core_.comm().size(); }
    /// The flat parameter values (registry storage, or lockstep's packed copy with the
    /// visitor), in registration order; registry().parameters() describes the layout.
    /// Asynchronous trainers: after train(), the server's final parameters on every replica.
    std::span<const value_type> parameters() { return core_.values(); }
    parameter_registry<value_type, system_type>& registry() noexcept { return core_.registry(); }
    /// Steps taken so far (skipped ones included; asynchronous trainers: gradients applied).
    std::int64_t steps() const noexcept { return core_.steps(); }
    /// Samples consumed so far: the global sample index of the next step's (or work item's)
    /// first sample.
    std::uint64_t samples() const noexcept { return core_.samples(); }

protected:
    /// Builds the replica_core (collective; see replica_core's constructor): `policies` are the
    /// trainer's "name<TAB>value" lines for the construction-time agreement check, `clips` says
    /// whether the trainer applies train_params::max_grad_norm (else a non-zero value throws).
    template <class Factory>
    trainer_base(Communicator& comm, Factory&& factory, typename Optimizer::params_type opt,
                 train_params tp, const std::vector<std::string>& policies, bool clips)
        : core_(bn_towers_fit(comm), std::forward<Factory>(factory), std::move(opt), std::move(tp),
                policies, clips, ReducePolicy::shards_optimizer_state),
          declared_(trainer_facts_of<SyncPolicy, ReducePolicy>(),
                    bn_policy_names<network_bn_policies_t<Network>>::list()) {
        core_.context().set_policies(&declared_);
    }
    ~trainer_base() = default;

    /// check_bn_towers for this network on `comm`; returns `comm` (for core_'s initializer).
    static Communicator& bn_towers_fit(Communicator& comm) {
        check_bn_towers(static_cast<const network_bn_policies_t<Network>*>(nullptr), comm.rank(),
                        comm.size());
        return comm;
    }

    /// The "name<TAB>value" lines of the sync, reduce and BN policies.
    static std::vector<std::string> policy_settings() {
        return {"sync\t" + SyncPolicy::name(), "reduce\t" + ReducePolicy::name(),
                "bn_policies\t" + bn_policy_names<network_bn_policies_t<Network>>::get()};
    }

    /// Enters a training call (a step, a counted replay, train()): refuses one while another
    /// runs (exclusive_use) and a communicator that was moved from (its size is 0: every
    /// later error would blame the batch split or a peer instead).
    exclusive_use::scope enter(const char* op) {
        check_communicator(op);
        return use_.enter(core_.comm().rank(), op);
    }
    /// For read_result, finish and checkpoints: refuses a call on another thread while a
    /// training call runs, and a moved-from communicator.
    void check_use(const char* op) {
        check_communicator(op);
        use_.check_thread(core_.comm().rank(), op);
    }
    /// For calls that need every replica between training calls (loads, the asynchronous
    /// trainers' saves): refuses them during one on any thread (`why`: what would go wrong).
    void check_between(const char* op, const char* why) {
        check_communicator(op);
        use_.check_between(core_.comm().rank(), op, why);
    }

    /// For the asynchronous trainers: the layers check their momentum against the one their
    /// server updates the running statistics with (policy_declaration::check_momentum).
    void declare_server_momentum(double m) noexcept { declared_.set_server_momentum(m); }

    core_type core_;

private:
    void check_communicator(const char* op) {
        LOCKSTEP_REQUIRE(core_.comm().size() >= 1, errc::invalid_argument, core_.comm().rank(), op,
                         "the communicator this trainer was built on was moved from (or its "
                         "group's run ended): a trainer is used with the handle it was built on, "
                         "inside the run that made it");
    }

    exclusive_use use_;
    /// What the layers check their policies against (replica_context::policies).
    nn::policy_declaration declared_;

    friend struct checkpoint_access;
};

} // namespace lockstep::detail

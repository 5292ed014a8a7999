// lockstep/nn/detail/bn_exchange.hpp: how a batch-norm layer's statistics cross replicas under
// its BNStatPolicy: the forward gather, the backward sum, their names and bn::group's split.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/nn/detail/bn_agreement.hpp"
#include "lockstep/nn/detail/bn_state.hpp"
#include "lockstep/nn/detail/group_communicator.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/policy/bn.hpp"

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace lockstep::nn::detail {

/// The statistics blocks a forward merges (kernels::finish_statistics_fn's view of them): this
/// replica's alone, or every block of the replicas that share statistics with it.
template <class Acc>
struct forward_blocks {
    const Acc* blocks;
    int count;         ///< blocks, one per replica sharing the statistics
    int self;          ///< this replica's block
    int world_offset;  ///< the parent communicator's rank of block 0
    int running_first; ///< the blocks that update the running statistics: [first, last)
    int running_last;
};

/// A layer's statistics exchange under Policy (bn::traits): a communicating policy gathers every
/// replica's packed statistics block in forward and sums the backward partial sums; bn::group
/// does so over the sub-communicator of the replica's group (group_communicator), every other
/// policy over the communicator it is given. Each collective carries a name the communicator
/// verifies where it can: "batch_norm layer 2 (forward order) forward_train" inside a step, so a
/// replica that skipped a layer is told apart from its peers, "batch_norm.forward_train"
/// outside (kept here: the name must outlive the call).
template <class Policy, class Acc, class System>
class statistics_exchange {
    using traits = bn::traits<Policy>;

public:
    /// This replica's block alone (a policy without forward collectives), or every block of its
    /// statistics group gathered into `gathered` (collective). The running range follows the
    /// policy: every block (bn::global, bn::group, bn::running_only), replica K's (bn::tower<K>),
    /// or this replica's own.
    template <class Comm>
    forward_blocks<Acc> forward(Comm& comm, const layer_step* step, std::span<const Acc> block,
                                buffer<Acc, System>& gathered, const System& sys) {
        forward_blocks<Acc> f{block.data(), 1, 0, comm.rank(), 0, 1};
        if constexpr (bn::communicates<Policy>) {
            auto& sc = statistics_communicator(comm);
            auto all = ensure(gathered, static_cast<std::size_t>(sc.size()) * block.size(), sys);
            const std::string_view tag = collective_name(step, "forward_train");
            if constexpr (requires { sc.all_gather(block, all, tag); })
                sc.all_gather(block, all, tag);
            else
                sc.all_gather(block, all);
            f = {all.data(), sc.size(),    sc.rank(), comm.rank() - sc.rank(),
                 sc.rank(),  sc.rank() + 1};
        }
        if constexpr (traits::running_replica >= 0) {
            f.running_first = traits::running_replica;
            f.running_last = traits::running_replica + 1;
        } else if constexpr (traits::shares_running_statistics || traits::group_size > 0) {
            f.running_first = 0;
            f.running_last = f.count;
        }
        return f;
    }

    /// combined = the sum of `local` over the replicas that normalize together (collective).
    /// requires: traits::normalizes_across_replicas.
    template <class Comm>
    void backward(Comm& comm, const layer_step* step, std::span<const Acc> local,
                  std::span<Acc> combined) {
        static_assert(traits::normalizes_across_replicas);
        auto& sc = statistics_communicator(comm);
        const std::string_view tag = collective_name(step, "backward");
        if constexpr (requires { sc.all_reduce(local, combined, reduce_op::sum, tag); })
            sc.all_reduce(local, combined, reduce_op::sum, tag);
        else
            sc.all_reduce(local, combined, reduce_op::sum);
    }

    /// The settings check (settings_agreement::check) over every replica of comm, bn::group's
    /// other groups included (every replica builds the layer alike; a check within the group
    /// only would fail there and leave the others to wait for it in the step's next
    /// collective). Collective the first time; call it before the first forward.
    template <class Comm>
    void agree(Comm& comm, settings_agreement& agreement, const char* op) {
        if (!agreement.done())
            agreement.check(comm, op);
    }

private:
    /// bn::group: the sub-communicator of this replica's group; every other policy: comm.
    template <class Comm>
    Comm& statistics_communicator(Comm& comm) {
        if constexpr (traits::group_size > 0) {
            static_assert(identified_communicator<Comm>,
                          "bn::group keeps the sub-communicator it splits for the communicator "
                          "it is given, keyed by comm.identity(): give the communicator a "
                          "lockstep::communicator_identity member and an identity() accessor "
                          "(comm/communicator_identity.hpp), as lockstep's communicators have.");
            return groups_.of(comm);
        } else {
            return comm;
        }
    }

    std::string_view collective_name(const layer_step* step, std::string_view call) {
        const bool back = call == "backward";
        const int layer = step != nullptr ? (back ? forward_layer_ : step->next_layer()) : -1;
        if (!back)
            forward_layer_ = layer;
        std::string& name = back ? backward_name_ : forward_name_;
        if (layer != named_layer_[back ? 1 : 0] || name.empty()) {
            named_layer_[back ? 1 : 0] = layer;
            name = layer >= 0 ? lockstep::detail::concat("batch_norm layer ", layer,
                                                         " (forward order) ", call)
                              : lockstep::detail::concat("batch_norm.", call);
        }
        return name;
    }

    group_communicator<(traits::group_size > 0 ? traits::group_size : 1)> groups_;
    int forward_layer_ = -1;        ///< the last forward's number in its step (-1: none)
    int named_layer_[2] = {-2, -2}; ///< the layer numbers forward_name_, backward_name_ hold
    std::string forward_name_, backward_name_;
};

} // namespace lockstep::nn::detail

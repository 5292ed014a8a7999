// lockstep/nn/detail/group_communicator.hpp: bn::group's sub-communicator, split from the parent
// communicator once per process and group size and shared by every layer that uses that parent.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator_identity.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <typeindex>
#include <typeinfo>
#include <utility>

namespace lockstep::nn::detail {

/// The groups of `group_size` consecutive ranks of `parent` (parent.split(rank / group_size,
/// rank)), split on the first call for this parent and group size in the process and shared by
/// the later ones: N bn::group layers on one communicator cost one split, not N (a split costs
/// an MPI context id, or a whole NCCL communicator). Collective on parent when it splits: every
/// replica of the parent calls this in the same order, so the first caller on each replica is
/// the same layer and every replica splits at the same point.
/// - Keyed by (parent.identity(), group_size), one registry per Comm: the group size, not this
///   replica's color, is what decides the split (bn::group<2> and bn::group<4> give rank 0 the same
///   color, but not rank 2). Thread replicas each have their own communicator object, hence their
///   own key; the registry's lock is never held across the split, which waits for the other
///   replicas.
/// - The registry holds the splits weakly: a split lives while a layer holds it, and is made
///   again by the next caller once the last holder let go (on every replica alike: they make and
///   drop their layers in the same order). A parent destroyed is never found again (identities
///   are never reused), one moved from has a new identity (the destination keeps the split: it
///   holds the same group), so a split is never served for another communicator than its own.
/// requires: group_size >= 1; calls for one parent object are not concurrent (a replica's).
template <identified_communicator Comm>
std::shared_ptr<Comm> shared_group_split(Comm& parent, int group_size) {
    using key = std::pair<std::uint64_t, int>;
    static std::mutex guard;
    static std::map<key, std::weak_ptr<Comm>> splits;
    const key k{parent.identity(), group_size};
    {
        const std::lock_guard<std::mutex> lock(guard);
        if (auto it = splits.find(k); it != splits.end())
            if (std::shared_ptr<Comm> kept = it->second.lock())
                return kept;
    }
    const int rank = parent.rank();
    auto made = std::make_shared<Comm>(parent.split(rank / group_size, rank));
    const std::lock_guard<std::mutex> lock(guard);
    std::erase_if(splits, [](const auto& entry) { return entry.second.expired(); });
    splits.insert_or_assign(k, made);
    return made;
}

/// A layer's handle on the sub-communicator of its replica's group of GroupSize consecutive
/// ranks (bn::group): the shared split of the parent last used (shared_group_split). The key is
/// the parent's identity (communicator_identity), not its address: a parent destroyed and
/// another constructed in the same storage is split again, never served the dead one's group.
/// The parent's type is a property of the call (a layer may be used with several), so the one
/// kept is held untyped and recovered by its type.
template <int GroupSize>
class group_communicator {
    static_assert(GroupSize >= 1, "bn::group<K> splits the replicas into groups of K >= 1.");

public:
    /// The group of `parent` (collective on parent when no layer of this process holds its
    /// split yet: every replica of it calls this in the same order). The last group is smaller
    /// when GroupSize does not divide parent.size() (policy/bn.hpp). ensures: the same object
    /// while the parent is the one last used.
    template <identified_communicator Comm>
    Comm& of(Comm& parent) {
        if (kept_ == nullptr || parent_ != parent.identity() || type_ != typeid(Comm)) {
            kept_ = shared_group_split(parent, GroupSize);
            parent_ = parent.identity();
            type_ = typeid(Comm);
        }
        return *static_cast<Comm*>(kept_.get());
    }

private:
    std::shared_ptr<void> kept_;
    std::uint64_t parent_ = 0;            ///< the identity of the communicator kept_ was split from
    std::type_index type_ = typeid(void); ///< kept_'s type
};

} // namespace lockstep::nn::detail

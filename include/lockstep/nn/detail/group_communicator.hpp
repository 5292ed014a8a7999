// lockstep/nn/detail/group_communicator.hpp: bn::group's sub-communicator, split from the parent
// communicator once and kept, keyed by the parent's identity. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator_identity.hpp"

#include <cstdint>
#include <memory>

namespace lockstep::nn::detail {

/// The sub-communicator of this replica's group of GroupSize consecutive ranks (bn::group),
/// split from the parent communicator on first use and kept for the parent last used. The key is
/// the parent's identity (communicator_identity), not its address: a parent destroyed and
/// another constructed in the same storage is split again, never served the dead one's group.
/// The parent's type is a property of the call (a layer may be used with several), so the one
/// kept is held through a small base and recovered by its type.
template <int GroupSize>
class group_communicator {
    static_assert(GroupSize >= 1, "bn::group<K> splits the replicas into groups of K >= 1.");

public:
    /// The group of `parent` (collective on parent the first time a parent is seen: every
    /// replica of it calls this in the same order). The last group is smaller when
    /// GroupSize does not divide parent.size() (policy/bn.hpp). ensures: the same object while the
    /// parent is the one last used.
    template <identified_communicator Comm>
    Comm& of(Comm& parent) {
        auto* kept = dynamic_cast<split<Comm>*>(kept_.get());
        if (kept == nullptr || kept->parent != parent.identity()) {
            const int rank = parent.rank();
            auto fresh = std::make_unique<split<Comm>>(parent.identity(),
                                                       parent.split(rank / GroupSize, rank));
            kept = fresh.get();
            kept_ = std::move(fresh);
        }
        return kept->group;
    }

private:
    struct any_split {
        explicit any_split(std::uint64_t p) : parent(p) {}
        virtual ~any_split() = default;
        std::uint64_t parent; ///< the identity of the communicator it was split from
    };
    template <class Comm>
    struct split final : any_split {
        split(std::uint64_t p, Comm g) : any_split(p), group(std::move(g)) {}
        Comm group;
    };
    std::unique_ptr<any_split> kept_;
};

} // namespace lockstep::nn::detail

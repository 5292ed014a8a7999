// lockstep/comm/detail/hierarchical_parts.hpp: hierarchical_parts, what a replica of a
// hierarchical_communicator holds (its two parts, routes, origin and staging), its place in the
// group, and the steps its collectives are made of. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/hierarchical_call.hpp"
#include "lockstep/comm/detail/hierarchical_origin.hpp"
#include "lockstep/comm/detail/hierarchical_shape.hpp"
#include "lockstep/comm/detail/hierarchical_staging.hpp"
#include "lockstep/comm/detail/tag_forwarding.hpp"
#include "lockstep/core/error.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// The base of hierarchical_communicator (whose comment states what it guarantees): the state
/// one replica holds (the intra-node and inter-node parts, the routes and the routes' rank of
/// each member of a split group, whom its errors name, the scratch and staging), its place
/// (rank(), node(), local_rank(), ...) and the steps its collectives are made of: scratch,
/// staging and copies in the intra-node memory, step (one part's step, its errors thrown again
/// naming the caller's call) and agree_across_nodes (the caller's arguments compared across
/// nodes before any data moves).
template <class Intra, class Inter, class Routes>
class hierarchical_parts {
public:
    using system_type = typename Intra::system_type;
    static_assert(detail::hierarchical_systems_supported<system_type, typename Inter::system_type>,
                  "hierarchical_communicator composes two host-memory communicators of the same "
                  "system, or a device intra-node communicator (nccl_communicator) with a "
                  "host inter-node one (mpi_communicator); other pairs are not supported.");

    /// Large all_reduces (per replica: at least local_size() * this many elements) go through
    /// reduce-scatter / all_gather inside the node.
    static constexpr std::size_t sharded_from = 4096;

    /// This object's communicator_identity (identified_communicator): what caches of state
    /// derived from the communicator are keyed by.
    std::uint64_t identity() const noexcept { return identity_.value(); }

    int rank() const noexcept { return inter_.rank() * intra_.size() + intra_.rank(); }
    int size() const noexcept { return inter_.size() * intra_.size(); }
    /// This replica's system (the intra-node communicator's).
    system_type system() const { return intra_.system(); }
    /// The replicas per node and this replica's rank among them.
    int local_size() const noexcept { return intra_.size(); }
    int local_rank() const noexcept { return intra_.rank(); }
    /// The number of nodes and this replica's node.
    int nodes() const noexcept { return inter_.size(); }
    int node() const noexcept { return inter_.rank(); }
    /// The parts (for collectives a caller wants to run on one level only).
    Intra& intra() noexcept { return intra_; }
    Inter& inter() noexcept { return inter_; }

    /// Device intra-node part only (nccl_communicator): waits until this replica's stream is
    /// idle, or until `event` has completed, through the intra-node part (which polls for
    /// failures and its timeout); abort() aborts the intra-node part, so this node's replicas
    /// fail instead of waiting (other nodes learn of it through the inter-node part).
    void synchronize() requires(!system_type::is_host) { intra_.synchronize(); }
    template <class Event>
    void wait(Event event, const char* what) requires(!system_type::is_host) {
        intra_.wait(event, what);
    }
    void abort() noexcept requires(!system_type::is_host) { intra_.abort(); }
    bool aborted() const noexcept requires(!system_type::is_host) { return intra_.aborted(); }

protected:
    // members: the routes' rank of each replica of this group (empty: the same as rank()).
    hierarchical_parts(Intra intra, Inter inter, Routes routes, std::vector<int> members)
        : intra_(std::move(intra)), inter_(std::move(inter)), routes_(std::move(routes)),
          members_(std::move(members)), origin_{rank(), node(), local_rank(), {}} {
        detail::check_hierarchical_shape(intra_, inter_, stage_, rank());
    }

    void require_root(int root, const char* what) const {
        LOCKSTEP_REQUIRE(root >= 0 && root < size(), errc::invalid_argument, rank(), what, "root ",
                         root, " is not in [0, ", size(), ")");
    }

    /// Scratch slot `slot` (0 or 1) in the intra-node memory with room for n elements of T
    /// (kept between calls).
    template <class T>
    std::span<T> scratch(int slot, std::size_t n) {
        return stage_.template scratch<T>(intra_, slot, n);
    }

    /// Room in the staging for the next inter-node step (out_n elements, in_n more when its
    /// input is disjoint from its output), made before the intra-node part enqueues anything
    /// that step waits for (hierarchical_staging::reserve).
    template <class T>
    void reserve(std::size_t out_n, std::size_t in_n) {
        stage_.template reserve<T>(intra_, out_n, in_n);
    }

    /// dst = src in the intra-node memory. requires: equal sizes, no overlap.
    template <class T>
    void copy_block(std::span<T> dst, std::span<const T> src) {
        stage_.copy(intra_, dst, src);
    }

    using call_text = detail::hierarchical_call;
    enum part_kind { intra_part, inter_part };

    /// Runs one step of a collective on one part; a lockstep::error it throws is rethrown naming
    /// this replica and what the caller passed (hierarchical_origin::rethrow), and for an
    /// all_reduce's inter-node error of differing collectives which path issues what.
    template <class F>
    void step(part_kind part, const call_text& call, F&& f) {
        try {
            f();
        } catch (const error& e) {
            origin_.rethrow(e, call, part == intra_part, rank(),
                            detail::hierarchical_path_hint(
                                part == intra_part, call, e.code(), local_size(),
                                static_cast<std::size_t>(local_size()) * sharded_from));
        }
    }

    /// The caller's arguments, compared across nodes (nothing with one node): one inter-node
    /// all_gather (host memory, this local rank's inter communicator, the caller's tag) of
    /// {count, layout (a hash of reduce_scatter's counts, else 0), element type, reduction,
    /// root}. Each local rank compares the nodes' replicas at that local rank, so where a node's
    /// replicas agree among themselves (else its intra part refuses the call) a difference
    /// between nodes fails every replica here, before any data moves.
    /// ensures: returns when every node passed the same; else throws errc::count_mismatch
    /// (counts) or errc::shape_mismatch (type, reduction, root), naming this replica's call and
    /// the first node whose call differs.
    void agree_across_nodes(const call_text& call, std::int64_t layout, const collective_tag& tag) {
        if (nodes() == 1)
            return;
        const std::array<std::int64_t, 5> mine = call.key(layout);
        std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(nodes()));
        step(inter_part, call, [&] {
            detail::with_tag(inter_, tag)
                .all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
        });
        detail::require_same_call(call, mine, all, rank(), node(), local_rank(), local_size());
    }

    Intra intra_;
    Inter inter_;
    [[no_unique_address]] Routes routes_;
    std::vector<int> members_;
    /// Whom and what its errors name (the group first split, the splits since).
    detail::hierarchical_origin origin_;
    // Scratch and the inter-node calls' staging; destroyed before the parts (device scratch is
    // freed on the intra-node part's stream).
    detail::hierarchical_staging<system_type, typename Inter::system_type> stage_;
    communicator_identity identity_;
};

} // namespace lockstep::detail

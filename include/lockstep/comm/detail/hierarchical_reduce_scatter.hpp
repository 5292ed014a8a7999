// lockstep/comm/detail/hierarchical_reduce_scatter.hpp: hierarchical_reduce_scatter, the
// reduce-scatter of a hierarchical_communicator and the large all_reduce built on one inside
// the node. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/hierarchical_call.hpp"
#include "lockstep/comm/detail/hierarchical_messages.hpp"
#include "lockstep/comm/detail/tag_forwarding.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

namespace lockstep::detail {

/// The reduce-scatter paths of hierarchical_communicator (whose comment states what they
/// guarantee): reduce_scatter (the send data reordered local-rank-major, reduce-scattered
/// inside the node, then across nodes) and the large all_reduce (reduce-scatter inside the
/// node into shards, all_reduce of each shard across nodes, all_gather inside the node).
template <class Intra, class Inter, class Routes>
class hierarchical_reduce_scatter : public hierarchical_messages<Intra, Inter, Routes> {
    using base = hierarchical_messages<Intra, Inter, Routes>;

public:
    using base::rank, base::size;

    /// reduce_scatter with per-replica counts: replica r receives counts[r] elements, op over
    /// every replica of send[offset_r, offset_r + counts[r]) with offset_r = counts[0] + ... +
    /// counts[r - 1]. requires: counts.size() == size(), equal on every replica; send.size() ==
    /// sum of counts; recv.size() == counts[rank()]; recv is this replica's slice of send (in
    /// place) or disjoint from it.
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op,
                        collective_tag tag = {}) {
        const int L = intra_.size();
        const int N = inter_.size();
        LOCKSTEP_REQUIRE(counts.size() == static_cast<std::size_t>(size()), errc::count_mismatch,
                         rank(), "hierarchical_communicator.reduce_scatter", "counts has ",
                         counts.size(), " entries for ", size(), " replicas");
        std::vector<std::size_t> offset(counts.size() + 1, 0);
        for (std::size_t r = 0; r < counts.size(); ++r)
            offset[r + 1] = checked_add(offset[r], counts[r], rank(),
                                        "hierarchical_communicator.reduce_scatter", "the counts");
        LOCKSTEP_REQUIRE(send.size() == offset.back(), errc::count_mismatch, rank(),
                         "hierarchical_communicator.reduce_scatter", "send has ", send.size(),
                         " elements, counts sum to ", offset.back());
        const call_text call{"reduce_scatter", send.size(), trace_type_name<T>(), to_string(op),
                             -1};
        // Each local rank's inter step sees only its own replicas' counts: the nodes compare
        // every count first, so that any difference fails every replica.
        agree_across_nodes(call, call_text::counts_hash(counts), tag);
        // Local-rank-major order: for l, for node: the range of replica node * L + l.
        const std::span<T> packed = this->template scratch<T>(0, send.size());
        const auto nodes = static_cast<std::size_t>(N), locals = static_cast<std::size_t>(L);
        std::vector<std::size_t> local_counts(locals, 0);
        std::size_t at = 0;
        for (std::size_t l = 0; l < locals; ++l)
            for (std::size_t n = 0; n < nodes; ++n) {
                const std::size_t r = n * locals + l;
                copy_block(packed.subspan(at, counts[r]), send.subspan(offset[r], counts[r]));
                at += counts[r];
                local_counts[l] += counts[r];
            }
        const std::span<T> mine =
            this->template scratch<T>(1, local_counts[static_cast<std::size_t>(intra_.rank())]);
        this->template reserve<T>(recv.size(), mine.size());
        const std::span<const std::size_t> locals_of(local_counts);
        step(intra_part, call, [&] {
            detail::with_tag(intra_, tag)
                .reduce_scatter(std::span<const T>(packed), mine, locals_of, op);
        });
        std::vector<std::size_t> node_counts(nodes);
        for (std::size_t n = 0; n < nodes; ++n)
            node_counts[n] = counts[n * locals + static_cast<std::size_t>(intra_.rank())];
        step(inter_part, call, [&] {
            stage_.inter(intra_, std::span<const T>(mine), recv,
                         [&](std::span<const T> in, std::span<T> out) {
                             const std::span<const std::size_t> of(node_counts);
                             detail::with_tag(inter_, tag).reduce_scatter(in, out, of, op);
                         });
        });
    }

    /// The equal-count form: every replica receives recv.size() elements.
    /// requires: send.size() == size() * recv.size(), equal on every replica.
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op, collective_tag tag = {}) {
        const std::vector<std::size_t> counts(static_cast<std::size_t>(size()), recv.size());
        reduce_scatter<T>(send, recv, std::span<const std::size_t>(counts), op, tag);
    }

protected:
    using base::agree_across_nodes, base::copy_block, base::step;
    using base::base;
    using base::intra_, base::inter_, base::stage_;
    using base::intra_part, base::inter_part;
    using typename base::call_text;

    /// Large all_reduce: reduce-scatter inside the node into equal shards (the last one
    /// shorter), all_reduce of each shard across nodes, all_gather inside the node.
    template <class T>
    void sharded_all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op,
                            const collective_tag& tag) {
        const std::size_t n = send.size();
        const auto L = static_cast<std::size_t>(intra_.size());
        const auto me = static_cast<std::size_t>(intra_.rank());
        const call_text call{"all_reduce", n, trace_type_name<T>(), to_string(op), -1};
        // The shards' counts need not tell a node with another count apart (nor does the small
        // path's inter all_reduce of n / L elements): the nodes compare the caller's count
        // first, in an inter-node all_gather, a collective the small path never issues there.
        agree_across_nodes(call, 0, tag);
        const std::size_t shard = (n + L - 1) / L;
        std::vector<std::size_t> counts(L);
        for (std::size_t l = 0; l < L; ++l)
            counts[l] = std::min(shard, n - std::min(n, l * shard));
        // Gather target: recv itself when the shards tile it exactly, else a padded stage.
        const bool exact = shard * L == n;
        const std::span<T> gathered =
            exact ? std::span<T>() : this->template scratch<T>(0, shard * L);
        const std::span<T> own = this->template scratch<T>(1, shard);
        this->template reserve<T>(counts[me], 0);
        const std::span<const std::size_t> of(counts);
        const std::span<T> part = own.first(counts[me]);
        step(intra_part, call,
             [&] { detail::with_tag(intra_, tag).reduce_scatter(send, part, of, op); });
        step(inter_part, call, [&] {
            stage_.inter(intra_, std::span<const T>(part), part,
                         [&](std::span<const T> in, std::span<T> out) {
                             detail::with_tag(inter_, tag).all_reduce(in, out, op);
                         });
        });
        // One call site for both targets (call-site checks see the caller's tag anyway).
        const std::span<T> target = exact ? recv : gathered;
        step(intra_part, call,
             [&] { detail::with_tag(intra_, tag).all_gather(std::span<const T>(own), target); });
        if (!exact)
            copy_block(recv, std::span<const T>(gathered.first(n)));
    }
};

} // namespace lockstep::detail

// lockstep/comm/hierarchical.hpp: hierarchical_communicator, a communicator composed of a fast
// intra-node one and an inter-node one (threads or NCCL GPUs inside each MPI process).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/hierarchical_call.hpp"
#include "lockstep/comm/detail/hierarchical_origin.hpp"
#include "lockstep/comm/detail/hierarchical_parts.hpp"
#include "lockstep/comm/detail/hierarchical_reduce_scatter.hpp"
#include "lockstep/comm/detail/hierarchical_shape.hpp"
#include "lockstep/comm/detail/hierarchical_staging.hpp"
#include "lockstep/comm/detail/tag_forwarding.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

/// A communicator over nodes() x local_size() replicas, composed of two communicators this
/// replica holds:
/// - `intra`: the local_size() replicas of this node (e.g. the threads of this process, a
///   thread_communicator);
/// - `inter`: one replica per node, the ones with this replica's local rank (e.g. an
///   mpi_communicator connecting the local-rank-l threads of every process).
/// Global rank = inter.rank() * local_size() + intra.rank(): node-major, so ranks 0..L-1 are
/// node 0's replicas. Every node has the same local_size(), and every replica of a node is at
/// the same inter.rank() (the constructor checks both).
///
/// The parts: two host-memory communicators of the same system (thread_communicator and
/// mpi_communicator: hierarchical_group), or a device intra-node part over a host inter-node one
/// (nccl_communicator and mpi_communicator: gpu_hierarchical_group). In the second, spans are
/// device memory, system() is the replica's cuda_system, scratch is device memory on its stream,
/// and every inter-node step goes through pinned host memory: an asynchronous copy to the host
/// on the stream, a wait through the NCCL part's polling wait (its timeout and failure checks),
/// the inter-node collective, an asynchronous copy back on the stream. synchronize(), wait()
/// and abort() are forwarded to the NCCL part there.
///
/// Collectives (same contracts as the `communicator` concept; spans in the intra-node part's
/// memory):
/// - all_reduce: large messages (at least local_size() * sharded_from elements) are, after the
///   nodes compare their counts (see Errors), reduce-scattered inside the node (each replica owns
///   1/local_size() of the elements), all_reduced across nodes shard by shard (each local rank on
///   its own inter communicator, concurrently), and all_gathered inside the node: each byte crosses
///   the inter-node link once per node, not once per replica. Smaller ones are all_reduced inside
///   the node, then across nodes. The node's sum is the intra part's and the nodes' the inter
///   part's, each in its own order (rank order for thread_communicator and for 16-bit values over
///   MPI; MPI's own order for float and double; NCCL's ring or tree), and every replica receives
///   the same result of both, so every replica holds the same bits where each part gives its
///   replicas the same bits; sums agree with a flat communicator's over the same replicas within
///   rounding.
/// - broadcast: inside the root's node, then across nodes (every local rank in parallel).
/// - all_gather: inside the node into this node's block of recv, then the node blocks across
///   nodes.
/// - reduce: inside the node to the root's local rank, then across nodes on that local rank's
///   inter communicator.
/// - reduce_scatter: the send data is reordered local-rank-major, then
///   reduce-scattered inside the node and across nodes.
/// - barrier: inside the node, across nodes, inside the node.
/// - split(color, key): supported when the new groups have the same shape on every node they
///   touch: ordered by (key, rank), a group's members come in one block per node, and every
///   block holds the same local ranks in the same order (the blocks' nodes may come in any
///   order). bn::group<G> with G a multiple or a divisor of local_size() qualifies. Other splits
///   throw errc::unsupported on every replica, each naming its own color (or, when its own group
///   fits, another replica's).
/// - all_to_all (when both parts have it, so reduce::compressed works over it): inside the
///   node, then across nodes.
/// Point-to-point messages (send, recv, recv_any; so the asynchronous trainers run over it) go
/// through `Routes`, a per-replica object that connects any replica to any other directly
/// (hierarchical_group's communicators have one: hierarchical_group_routes). Without routes
/// (Routes = no_routes, the default) the communicator has no point-to-point members and does
/// not model point_to_point_communicator. A split group keeps its parent's routes: its
/// messages travel on the same channels as the whole group's, so a split group and its parent
/// (or a sibling) must not exchange messages with the same tag between the same two replicas
/// at the same time. A Routes type provides, for ranks of the whole (unsplit) group:
/// send(std::span<const T>, dest, tag), recv(std::span<T>, source, tag), recv_any(std::span<T>,
/// tag) -> source, and share() -> another Routes object for the same replica (used by split).
/// Each collective takes a collective_tag (default: its caller's call site) and hands it to
/// every inner collective that takes one, so the parts compare the caller's names and call sites
/// (thread_group_params::check_call_sites), not this file's lines.
/// Errors: each part checks its own arguments and agreement (the counts, element types and
/// reductions of the steps it runs) and throws as it does alone; a failure inside one node
/// reaches the other nodes through the inter communicator's own failure handling (an
/// mpi_communicator ends the job, see hierarchical_group). Arguments that differ between nodes
/// fail every replica of the collective, not only those whose steps' counts differ (a large
/// all_reduce's shards, or a small one's n, can be equal where the callers' counts are not):
/// all_reduce's large-message path, reduce_scatter, reduce and broadcast first all_gather the
/// caller's {count, per-replica counts, element type, reduction, root} across nodes (one small
/// inter-node collective, before any data moves) and throw errc::count_mismatch or
/// errc::shape_mismatch on every replica when they differ; a node on the small all_reduce path
/// meets that all_gather with its inter-node all_reduce, which the inter part refuses
/// (errc::shape_mismatch) on both; all_gather and all_to_all hand every replica's own count
/// (all_gather: local_size() times it) to the inter part. The parts' refusals need parts
/// that verify their collectives (thread_communicator; mpi_communicator with params::verify).
/// An error a part throws during a collective is rethrown with its code, naming this replica's
/// rank(), node and local rank and what the caller passed (count, element type, reduction or
/// root), with the part's own text, which numbers that part's replicas (MPI: processes) and
/// steps and states its steps' counts, as the detail.
/// A replica's handle is used by one thread at a time.
template <communicator Intra, communicator Inter, class Routes = no_routes>
class hierarchical_communicator : public detail::hierarchical_reduce_scatter<Intra, Inter, Routes> {
    using base = detail::hierarchical_reduce_scatter<Intra, Inter, Routes>;

public:
    using intra_type = Intra;
    using inter_type = Inter;
    using routes_type = Routes;
    using system_type = typename Intra::system_type;
    // Its place and parts, sharded_from, identity() and the device-only members are
    // detail::hierarchical_parts' (comm/detail/hierarchical_parts.hpp), send, recv, recv_any
    // and routes() detail::hierarchical_messages', reduce_scatter
    // detail::hierarchical_reduce_scatter's.
    using base::rank, base::size, base::local_size, base::sharded_from;

    /// Takes both parts (and the routes, when Routes is not no_routes: this replica's routes of
    /// a group of the same shape, whose own rank is rank()). Collective over the whole group
    /// (every replica constructs its handle): checks that every node has the same local_size()
    /// and that the replicas of a node share their inter.rank() and inter.size(), else throws
    /// errc::invalid_argument on every replica naming the values.
    hierarchical_communicator(Intra intra, Inter inter, Routes routes = Routes())
        : hierarchical_communicator(std::move(intra), std::move(inter), std::move(routes), {}) {}
    hierarchical_communicator(hierarchical_communicator&&) noexcept = default;
    hierarchical_communicator& operator=(hierarchical_communicator&&) noexcept = default;

private:
    // members: the routes' rank of each replica of this group (empty: the same as rank()).
    hierarchical_communicator(Intra intra, Inter inter, Routes routes, std::vector<int> members)
        : base(std::move(intra), std::move(inter), std::move(routes), std::move(members)) {}

    using base::agree_across_nodes, base::copy_block, base::require_root, base::sharded_all_reduce,
        base::step, base::to_routes;
    using base::has_routes;
    using base::intra_, base::inter_, base::origin_, base::routes_, base::stage_;
    using base::intra_part, base::inter_part;
    using typename base::call_text;

public:
    /// recv[i] = op over every replica of send[i] (see the class comment for the order).
    /// requires: send.size() == recv.size(), equal on every replica; send == recv or disjoint.
    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                    collective_tag tag = {}) {
        LOCKSTEP_REQUIRE(send.size() == recv.size(), errc::count_mismatch, rank(),
                         "hierarchical_communicator.all_reduce", "send has ", send.size(),
                         " elements, recv ", recv.size());
        const std::size_t n = send.size();
        const auto L = static_cast<std::size_t>(intra_.size());
        if (L > 1 && n >= L * sharded_from) {
            sharded_all_reduce(send, recv, op, tag);
            return;
        }
        const call_text call{"all_reduce", n, trace_type_name<T>(), to_string(op), -1};
        this->template reserve<T>(n, 0);
        step(intra_part, call, [&] { detail::with_tag(intra_, tag).all_reduce(send, recv, op); });
        step(inter_part, call, [&] {
            stage_.inter(intra_, std::span<const T>(recv), recv,
                         [&](std::span<const T> in, std::span<T> out) {
                             detail::with_tag(inter_, tag).all_reduce(in, out, op);
                         });
        });
    }

    /// data on every replica becomes root's data. requires: 0 <= root < size(), equal counts.
    template <class T>
    void broadcast(std::span<T> data, int root, collective_tag tag = {}) {
        require_root(root, "hierarchical_communicator.broadcast");
        const int L = intra_.size();
        const call_text call{"broadcast", data.size(), trace_type_name<T>(), {}, root};
        // Only the root's node runs the intra step, and roots in one node block broadcast
        // across nodes from the same node: nodes that name different roots there would take
        // another replica's data without a word. The nodes compare the call first.
        agree_across_nodes(call, 0, tag);
        this->template reserve<T>(data.size(), 0);
        if (inter_.rank() == root / L)
            step(intra_part, call,
                 [&] { detail::with_tag(intra_, tag).broadcast(data, root % L); });
        step(inter_part, call, [&] {
            stage_.inter(intra_, std::span<const T>(data), data,
                         [&](std::span<const T>, std::span<T> out) {
                             detail::with_tag(inter_, tag).broadcast(out, root / L);
                         });
        });
    }

    /// recv = every replica's send in (global) rank order. requires: recv.size() == size() *
    /// send.size(), equal send counts; send may be this replica's slot of recv.
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    collective_tag tag = {}) {
        const std::size_t s = send.size();
        LOCKSTEP_REQUIRE(recv.size() == static_cast<std::size_t>(size()) * s, errc::count_mismatch,
                         rank(), "hierarchical_communicator.all_gather", "recv has ", recv.size(),
                         " elements, expected ", size(), " x ", s);
        const std::size_t block = static_cast<std::size_t>(intra_.size()) * s;
        const std::span<T> mine =
            recv.subspan(static_cast<std::size_t>(inter_.rank()) * block, block);
        const call_text call{"all_gather", s, trace_type_name<T>(), {}, -1};
        this->template reserve<T>(recv.size(), 0);
        step(intra_part, call, [&] { detail::with_tag(intra_, tag).all_gather(send, mine); });
        step(inter_part, call, [&] {
            stage_.inter(intra_, std::span<const T>(mine), recv,
                         [&](std::span<const T> in, std::span<T> out) {
                             detail::with_tag(inter_, tag).all_gather(in, out);
                         });
        });
    }

    /// As all_reduce, but only root's recv is written. requires: 0 <= root < size(), equal
    /// counts; root's recv.size() == send.size().
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root, collective_tag tag = {}) {
        require_root(root, "hierarchical_communicator.reduce");
        const call_text call{"reduce", send.size(), trace_type_name<T>(), to_string(op), root};
        // The replicas off the root's local rank leave after the node step: they compare the
        // call across nodes first, so that a mismatch fails them too.
        agree_across_nodes(call, 0, tag);
        const int L = intra_.size();
        const int local_root = root % L;
        const bool node_root = intra_.rank() == local_root;
        // The node's partial sum lands in recv on the root, in staging on the other node roots;
        // the rest of the node only sends. One call site for every replica (call-site checks).
        std::span<T> partial =
            !node_root || rank() == root ? recv : this->template scratch<T>(0, send.size());
        if (node_root) {
            LOCKSTEP_REQUIRE(partial.size() == send.size(), errc::count_mismatch, rank(),
                             "hierarchical_communicator.reduce", "root's recv has ", recv.size(),
                             " elements, send ", send.size());
            this->template reserve<T>(partial.size(), 0);
        }
        step(intra_part, call,
             [&] { detail::with_tag(intra_, tag).reduce(send, partial, op, local_root); });
        if (!node_root)
            return;
        step(inter_part, call, [&] {
            stage_.inter(intra_, std::span<const T>(partial), partial,
                         [&](std::span<const T> in, std::span<T> out) {
                             detail::with_tag(inter_, tag).reduce(in, out, op, root / L);
                         });
        });
    }

    /// Block r of recv = block rank() of replica r's send (blocks of b = send.size() / size()
    /// elements), in two exchanges: inside the node, each replica collects the blocks its local
    /// rank receives on every node; across nodes (on its local rank's inter communicator), each
    /// replica sends every node its blocks. Available when both parts have all_to_all.
    /// requires: send.size() equal on every replica and a multiple of size(); recv.size() ==
    /// send.size(); send and recv disjoint.
    template <class T>
    void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    collective_tag tag = {}) requires all_to_all_communicator<Intra> &&
        all_to_all_communicator<Inter> {
        const auto L = static_cast<std::size_t>(intra_.size());
        const auto N = static_cast<std::size_t>(inter_.size());
        const auto n = L * N;
        LOCKSTEP_REQUIRE(send.size() % n == 0 && recv.size() == send.size(), errc::count_mismatch,
                         rank(), "hierarchical_communicator.all_to_all", "send has ", send.size(),
                         " elements, recv ", recv.size(), ", for ", n, " replicas");
        const std::size_t b = send.size() / n;
        const call_text call{"all_to_all", send.size(), trace_type_name<T>(), {}, -1};
        // Step 1 order: by destination local rank l', then destination node n'.
        const std::span<T> by_local = this->template scratch<T>(0, send.size());
        const std::span<T> got = this->template scratch<T>(1, send.size());
        for (std::size_t dl = 0; dl < L; ++dl)
            for (std::size_t dn = 0; dn < N; ++dn)
                copy_block(by_local.subspan((dl * N + dn) * b, b),
                           send.subspan((dn * L + dl) * b, b));
        this->template reserve<T>(recv.size(), by_local.size());
        // got[l][n'] = the block of local replica l for (n', my local rank).
        step(intra_part, call,
             [&] { detail::with_tag(intra_, tag).all_to_all(std::span<const T>(by_local), got); });
        // Step 2 order: by destination node n', then source local rank l.
        for (std::size_t dn = 0; dn < N; ++dn)
            for (std::size_t l = 0; l < L; ++l)
                copy_block(by_local.subspan((dn * L + l) * b, b),
                           std::span<const T>(got).subspan((l * N + dn) * b, b));
        // recv[n][l] = the block of replica n * L + l for this replica: global rank order.
        step(inter_part, call, [&] {
            stage_.inter(intra_, std::span<const T>(by_local), recv,
                         [&](std::span<const T> in, std::span<T> out) {
                             detail::with_tag(inter_, tag).all_to_all(in, out);
                         });
        });
    }

    /// Returns once every replica has entered it.
    void barrier(collective_tag tag = {}) {
        detail::with_tag(intra_, tag).barrier();
        detail::with_tag(inter_, tag).barrier();
        detail::with_tag(intra_, tag).barrier();
    }

    /// The replicas with the same color form a new hierarchical group, ranked by (key, rank).
    /// Collective. `intra_args` go to the node communicator's split (nccl_communicator: a
    /// stream for the child, whose default is the parent's). requires: the group shapes
    /// described in the class comment, else every replica throws errc::unsupported, naming its
    /// own color when that group does not fit (else "another replica's color").
    template <class... IntraArgs>
    hierarchical_communicator split(int color, int key, IntraArgs&&... intra_args) {
        const int n = size();
        std::vector<int> all(2 * static_cast<std::size_t>(n));
        const int mine[2] = {color, key};
        stage_.on_host(intra_, std::span<const int>(mine), std::span<int>(all),
                       [&](std::span<const int> in, std::span<int> out) { all_gather(in, out); });
        detail::hierarchical_split_plan plan = detail::plan_hierarchical_split(
            std::span<const int>(all), color, rank(), intra_.size(), inter_.rank());
        // Every replica learns whether every group fits, so all of them throw or none does.
        int ok[1] = {plan.fits ? 1 : 0};
        stage_.on_host(intra_, std::span<const int>(ok), std::span<int>(ok),
                       [&](std::span<const int> in, std::span<int> out) {
                           all_reduce(in, out, reduce_op::min);
                       });
        if (ok[0] == 0) {
            fail(errc::unsupported, rank(), "hierarchical_communicator.split",
                 plan.fits ? "another replica's color" : "color " + std::to_string(color),
                 " does not form a group of the same local ranks on each of its nodes in "
                 "node-major (key, rank) order; a hierarchical communicator cannot represent it");
        }
        Intra intra =
            intra_.split(plan.color_index, plan.position, std::forward<IntraArgs>(intra_args)...);
        Inter inter = inter_.split(plan.color_index, plan.block);
        const auto child = [&](hierarchical_communicator c) {
            // Its errors name this replica as the group split first does, and the split.
            c.origin_ = origin_.split(color);
            return c;
        };
        if constexpr (has_routes) {
            // The child's rank k is members[k] here: its routes' rank is that one's.
            std::vector<int> members = std::move(plan.members);
            for (int& m : members)
                m = to_routes(m);
            return child(hierarchical_communicator(std::move(intra), std::move(inter),
                                                   routes_.share(), std::move(members)));
        } else {
            return child(hierarchical_communicator(std::move(intra), std::move(inter)));
        }
    }
};

/// Facts for trainers: collectives run on the compute cores when the intra-node ones do.
template <class Intra, class Inter, class Routes>
struct communicator_traits<hierarchical_communicator<Intra, Inter, Routes>> {
    static constexpr bool collectives_use_compute_cores =
        communicator_traits<Intra>::collectives_use_compute_cores;
};

} // namespace lockstep

// Its comm_stream where the intra-node part is a device communicator.
#include "lockstep/comm/detail/hierarchical_stream.hpp"

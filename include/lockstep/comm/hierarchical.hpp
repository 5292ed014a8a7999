// lockstep/comm/hierarchical.hpp: hierarchical_communicator, a communicator composed of a fast
// intra-node one and an inter-node one (threads or NCCL GPUs inside each MPI process).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/hierarchical_call.hpp"
#include "lockstep/comm/detail/hierarchical_origin.hpp"
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

/// The Routes of a hierarchical_communicator without point-to-point messages.
struct no_routes {};

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
class hierarchical_communicator {
    static constexpr bool has_routes = !std::is_same_v<Routes, no_routes>;
    // Routes whose receives take on_timeout (named_timeout_communicator).
    static constexpr bool routes_name_timeouts =
        has_routes && requires(Routes & r, std::span<int> i) {
        r.recv(i, 0, 0, detail::same_error{});
        r.recv_any(i, 0, detail::same_error{});
    };

public:
    using intra_type = Intra;
    using inter_type = Inter;
    using routes_type = Routes;
    using system_type = typename Intra::system_type;
    static_assert(detail::hierarchical_systems_supported<system_type, typename Inter::system_type>,
                  "hierarchical_communicator composes two host-memory communicators of the same "
                  "system, or a device intra-node communicator (nccl_communicator) with a "
                  "host inter-node one (mpi_communicator); other pairs are not supported.");

    /// Large all_reduces (per replica: at least local_size() * this many elements) go through
    /// reduce-scatter / all_gather inside the node.
    static constexpr std::size_t sharded_from = 4096;

    /// Takes both parts (and the routes, when Routes is not no_routes: this replica's routes of
    /// a group of the same shape, whose own rank is rank()). Collective over the whole group
    /// (every replica constructs its handle): checks that every node has the same local_size()
    /// and that the replicas of a node share their inter.rank() and inter.size(), else throws
    /// errc::invalid_argument on every replica naming the values.
    hierarchical_communicator(Intra intra, Inter inter, Routes routes = Routes())
        : hierarchical_communicator(std::move(intra), std::move(inter), std::move(routes), {}) {}
    hierarchical_communicator(hierarchical_communicator&&) noexcept = default;
    hierarchical_communicator& operator=(hierarchical_communicator&&) noexcept = default;

    /// This object's communicator_identity (identified_communicator): what caches of state
    /// derived from the communicator are keyed by.
    std::uint64_t identity() const noexcept { return identity_.value(); }

private:
    // members: the routes' rank of each replica of this group (empty: the same as rank()).
    hierarchical_communicator(Intra intra, Inter inter, Routes routes, std::vector<int> members)
        : intra_(std::move(intra)), inter_(std::move(inter)), routes_(std::move(routes)),
          members_(std::move(members)), origin_{rank(), node(), local_rank(), {}} {
        detail::check_hierarchical_shape(intra_, inter_, stage_, rank());
    }

public:
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
        reserve<T>(n, 0);
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
        reserve<T>(data.size(), 0);
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
        reserve<T>(recv.size(), 0);
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
        std::span<T> partial = !node_root || rank() == root ? recv : scratch<T>(0, send.size());
        if (node_root) {
            LOCKSTEP_REQUIRE(partial.size() == send.size(), errc::count_mismatch, rank(),
                             "hierarchical_communicator.reduce", "root's recv has ", recv.size(),
                             " elements, send ", send.size());
            reserve<T>(partial.size(), 0);
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
        const std::span<T> by_local = scratch<T>(0, send.size());
        const std::span<T> got = scratch<T>(1, send.size());
        for (std::size_t dl = 0; dl < L; ++dl)
            for (std::size_t dn = 0; dn < N; ++dn)
                copy_block(by_local.subspan((dl * N + dn) * b, b),
                           send.subspan((dn * L + dl) * b, b));
        reserve<T>(recv.size(), by_local.size());
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

    /// Sends data to replica dest with tag through the routes (returns once data may be
    /// reused). Matched by (source, tag), in order. Only with routes.
    /// requires: 0 <= dest < size(); the tag and element type the routes accept (MPI: 0 <= tag
    /// <= MPI_TAG_UB).
    template <class T>
    void send(std::span<T> data, int dest, int tag) requires has_routes {
        require_peer(dest, "hierarchical_communicator.send");
        routes_.send(std::span<const std::remove_const_t<T>>(data), to_routes(dest), tag);
    }

    /// Receives the next message from replica source with tag into data. Only with routes.
    /// requires: 0 <= source < size(). ensures: the message held exactly data.size()
    /// elements, else it is consumed and errc::count_mismatch is thrown.
    template <class T>
    void recv(std::span<T> data, int source, int tag) requires has_routes {
        require_peer(source, "hierarchical_communicator.recv");
        routes_.recv(data, to_routes(source), tag);
    }
    /// As recv(data, source, tag), whose timeout fails with on_timeout(e) in place of the
    /// routes' error e (named_timeout_communicator). Only with routes that take on_timeout.
    template <class T, class OnTimeout>
    void recv(std::span<T> data, int source, int tag,
              OnTimeout&& on_timeout) requires routes_name_timeouts {
        require_peer(source, "hierarchical_communicator.recv");
        routes_.recv(data, to_routes(source), tag, on_timeout);
    }

    /// As recv, from any replica; returns the sender's rank. Waits at most the routes' timeout
    /// (then errc::timeout naming the tag). Only with routes.
    template <class T>
    int recv_any(std::span<T> data, int tag) requires has_routes {
        return from_member(routes_.recv_any(data, tag), tag);
    }
    /// As recv_any(data, tag), whose timeout fails with on_timeout(e) in place of the routes'
    /// error e (named_timeout_communicator). Only with routes that take on_timeout.
    template <class T, class OnTimeout>
    int recv_any(std::span<T> data, int tag, OnTimeout&& on_timeout) requires routes_name_timeouts {
        return from_member(routes_.recv_any(data, tag, on_timeout), tag);
    }

    /// This replica's routes (for messages on the whole, unsplit group). Only with routes.
    Routes& routes() noexcept requires has_routes { return routes_; }

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

    /// Returns once every replica has entered it.
    void barrier(collective_tag tag = {}) {
        detail::with_tag(intra_, tag).barrier();
        detail::with_tag(inter_, tag).barrier();
        detail::with_tag(intra_, tag).barrier();
    }

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
        const std::span<T> packed = scratch<T>(0, send.size());
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
            scratch<T>(1, local_counts[static_cast<std::size_t>(intra_.rank())]);
        reserve<T>(recv.size(), mine.size());
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

private:
    // The rank in this group of the routes' replica `from`, a sender of recv_any.
    int from_member(int from, int tag) const {
        if (members_.empty())
            return from;
        const auto it = std::find(members_.begin(), members_.end(), from);
        LOCKSTEP_REQUIRE(it != members_.end(), errc::invalid_argument, rank(),
                         "hierarchical_communicator.recv_any", "a message with tag ", tag,
                         " came from replica ", from,
                         " of the whole group, which is not a member of this split group");
        return static_cast<int>(it - members_.begin());
    }
    void require_peer(int peer, const char* what) const {
        LOCKSTEP_REQUIRE(peer >= 0 && peer < size(), errc::invalid_argument, rank(), what,
                         "replica ", peer, " is not in [0, ", size(), ")");
    }
    int to_routes(int r) const {
        return members_.empty() ? r : members_[static_cast<std::size_t>(r)];
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
        const std::span<T> gathered = exact ? std::span<T>() : scratch<T>(0, shard * L);
        const std::span<T> own = scratch<T>(1, shard);
        reserve<T>(counts[me], 0);
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

/// Facts for trainers: collectives run on the compute cores when the intra-node ones do.
template <class Intra, class Inter, class Routes>
struct communicator_traits<hierarchical_communicator<Intra, Inter, Routes>> {
    static constexpr bool collectives_use_compute_cores =
        communicator_traits<Intra>::collectives_use_compute_cores;
};

} // namespace lockstep

// Its comm_stream where the intra-node part is a device communicator.
#include "lockstep/comm/detail/hierarchical_stream.hpp"

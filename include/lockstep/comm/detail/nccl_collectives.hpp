// lockstep/comm/detail/nccl_collectives.hpp: nccl_collectives, nccl_communicator's collectives
// and send/recv, enqueued on the replica's stream. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/nccl_calls.hpp"
#include "lockstep/comm/detail/nccl_types.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <nccl.h>

namespace lockstep::detail {

/// The collectives half of nccl_communicator (whose comment states what they guarantee): each
/// checks its arguments on the host (a bad one aborts the family, so the peers do not wait),
/// then enqueues its NCCL calls on the replica's stream through nccl_calls.
class nccl_collectives : public nccl_calls {
public:
    /// recv[i] = op over replicas of send[i] (ncclAllReduce); send may equal recv (in place).
    /// requires: send.size() == recv.size(), equal on every replica; send and recv identical
    /// or disjoint (a partial overlap is refused with errc::invalid_argument).
    template <nccl_element T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    reduce_op op) {
        const std::string name = next_operation("all_reduce");
        check_spans(name, send, recv);
        check_op(name, op);
        check_disjoint(name, send, recv, send.data() == recv.data(), "send == recv");
        h_.require(send.size() == recv.size(), errc::shape_mismatch, name, "send has ", send.size(),
                   " elements, recv ", recv.size());
        if (recv.empty())
            return;
        h_.check_memory(name, "send", send.data());
        h_.check_memory(name, "recv", recv.data());
        enqueue(name, [&] {
            return ncclAllReduce(send.data(), recv.data(), recv.size(), detail::nccl_data_type<T>(),
                                 detail::nccl_reduce_op(op), h_.comm(), h_.stream());
        });
        traced("all_reduce", trace_type_name<T>(), send.size(), -1);
    }

    /// data on every replica becomes root's data (ncclBroadcast, in place).
    /// requires: 0 <= root < size(); data.size() equal on every replica.
    template <nccl_element T>
    void broadcast(std::span<T> data, int root) {
        const std::string name = next_operation("broadcast");
        check_spans(name, data, data);
        h_.require(root >= 0 && root < h_.size(), errc::invalid_argument, name, "root ", root,
                   " is not a rank of ", h_.size(), " replicas");
        if (data.empty())
            return;
        h_.check_memory(name, "data", data.data());
        enqueue(name, [&] {
            return ncclBroadcast(data.data(), data.data(), data.size(), detail::nccl_data_type<T>(),
                                 root, h_.comm(), h_.stream());
        });
        traced("broadcast", trace_type_name<T>(), data.size(), root);
    }

    /// recv = every replica's send concatenated in rank order (ncclAllGather).
    /// requires: recv.size() == size() * send.size(); send.size() equal on every replica; send
    /// is recv's block rank() (in place) or disjoint from recv (else errc::invalid_argument).
    template <nccl_element T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
        const std::string name = next_operation("all_gather");
        check_spans(name, send, recv);
        check_disjoint(name, send, recv,
                       reinterpret_cast<std::uintptr_t>(send.data()) ==
                           reinterpret_cast<std::uintptr_t>(recv.data()) +
                               send.size_bytes() * static_cast<std::size_t>(h_.rank()),
                       "send is recv's block rank()");
        std::size_t total = 0;
        const bool overflow =
            mul_overflows(send.size(), static_cast<std::size_t>(h_.size()), &total);
        h_.require(!overflow && recv.size() == total, errc::shape_mismatch, name, "recv has ",
                   recv.size(), " elements, expected ", h_.size(), " x ", send.size());
        if (send.empty())
            return;
        h_.check_memory(name, "send", send.data());
        h_.check_memory(name, "recv", recv.data());
        enqueue(name, [&] {
            return ncclAllGather(send.data(), recv.data(), send.size(), detail::nccl_data_type<T>(),
                                 h_.comm(), h_.stream());
        });
        traced("all_gather", trace_type_name<T>(), send.size(), -1);
    }

    /// Block r of recv = block rank() of replica r's send (blocks of send.size() / size()
    /// elements): one ncclSend and one ncclRecv per replica, itself included, inside
    /// ncclGroupStart/End on the replica's stream.
    /// requires: send.size() equal on every replica and a multiple of size(); recv.size() ==
    /// send.size(); send and recv do not overlap.
    template <nccl_element T>
    void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
        const std::string name = next_operation("all_to_all");
        check_spans(name, send, recv);
        const std::size_t ranks = static_cast<std::size_t>(h_.size());
        h_.require(send.size() % ranks == 0 && recv.size() == send.size(), errc::shape_mismatch,
                   name, "send has ", send.size(), " elements, recv ", recv.size(),
                   " (requires equal sizes, a multiple of ", ranks, ")");
        const std::string overlap = lockstep::detail::overlap_problem(send, "send", recv, "recv");
        h_.require(overlap.empty(), errc::invalid_argument, name, overlap,
                   " (all_to_all has no in-place form)");
        if (send.empty())
            return;
        h_.check_memory(name, "send", send.data());
        h_.check_memory(name, "recv", recv.data());
        const std::size_t block = send.size() / ranks;
        enqueue(name, [&] {
            ncclResult_t r = ncclGroupStart();
            for (std::size_t p = 0; p < ranks && r == ncclSuccess; ++p) {
                r = ncclSend(send.data() + p * block, block, detail::nccl_data_type<T>(),
                             static_cast<int>(p), h_.comm(), h_.stream());
                if (r == ncclSuccess)
                    r = ncclRecv(recv.data() + p * block, block, detail::nccl_data_type<T>(),
                                 static_cast<int>(p), h_.comm(), h_.stream());
            }
            const ncclResult_t end = ncclGroupEnd();
            return r != ncclSuccess ? r : end;
        });
        traced("all_to_all", trace_type_name<T>(), send.size(), -1);
    }

    /// As all_reduce, but only root's recv is written (ncclReduce); on other replicas recv may
    /// be empty. requires: 0 <= root < size(); on root recv.size() == send.size() and send and
    /// recv identical or disjoint (else errc::invalid_argument).
    template <nccl_element T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root) {
        const std::string name = next_operation("reduce");
        check_spans(name, send, h_.rank() == root ? recv : std::span<T>());
        check_op(name, op);
        if (h_.rank() == root)
            check_disjoint(name, send, recv, send.data() == recv.data(), "send == recv");
        h_.require(root >= 0 && root < h_.size(), errc::invalid_argument, name, "root ", root,
                   " is not a rank of ", h_.size(), " replicas");
        h_.require(h_.rank() != root || recv.size() == send.size(), errc::shape_mismatch, name,
                   "send has ", send.size(), " elements, root's recv ", recv.size());
        if (send.empty())
            return;
        h_.check_memory(name, "send", send.data());
        if (h_.rank() == root)
            h_.check_memory(name, "recv", recv.data());
        enqueue(name, [&] {
            return ncclReduce(send.data(), recv.empty() ? nullptr : recv.data(), send.size(),
                              detail::nccl_data_type<T>(), detail::nccl_reduce_op(op), root,
                              h_.comm(), h_.stream());
        });
        traced("reduce", trace_type_name<T>(), send.size(), root);
    }

    /// Rank r receives counts[r] elements: recv[i] = op over replicas of send[offset + i],
    /// offset = counts[0] + ... + counts[rank() - 1], enqueued on the replica's stream: one
    /// ncclReduceScatter when every count is equal, else one ncclReduce per rank with a non-zero
    /// count (root r, its slice) inside ncclGroupStart/End. recv may be this replica's slice of
    /// send (in place). requires: counts has size() entries summing to send.size(), equal on
    /// every replica (NCCL cannot check that: unequal counts are undefined behaviour in NCCL);
    /// recv.size() == counts[rank()]; recv this replica's slice of send or disjoint from it.
    template <nccl_element T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op) {
        const std::string name = next_operation("reduce_scatter");
        check_spans(name, send, recv);
        check_op(name, op);
        const std::string bad_counts = detail::span_problem(counts, "counts");
        h_.require(bad_counts.empty(), errc::invalid_argument, name, bad_counts);
        const std::size_t ranks = static_cast<std::size_t>(h_.size());
        const auto layout = detail::scatter_layout_of(counts, h_.rank());
        h_.require(counts.size() == ranks && !layout.overflow && layout.total == send.size() &&
                       recv.size() == layout.mine,
                   errc::shape_mismatch, name, "counts ", detail::describe_counts(counts), " (",
                   counts.size(), " entries for ", ranks, " replicas), send has ", send.size(),
                   " elements, recv ", recv.size(),
                   " (requires one count per replica summing to send's size, recv's size the "
                   "count of this rank)");
        check_disjoint(name, send, recv,
                       !recv.empty() && recv.data() == send.data() + layout.offset,
                       "recv is send's slice counts[rank()]");
        if (send.empty())
            return;
        h_.check_memory(name, "send", send.data());
        if (!recv.empty())
            h_.check_memory(name, "recv", recv.data());
        if (layout.equal) {
            enqueue(name, [&] {
                return ncclReduceScatter(send.data(), recv.data(), recv.size(),
                                         detail::nccl_data_type<T>(), detail::nccl_reduce_op(op),
                                         h_.comm(), h_.stream());
            });
            traced("reduce_scatter", trace_type_name<T>(), send.size(), -1);
            return;
        }
        enqueue(name, [&] {
            ncclResult_t r = ncclGroupStart();
            std::size_t offset = 0;
            for (std::size_t p = 0; p < ranks && r == ncclSuccess; offset += counts[p], ++p) {
                if (counts[p] == 0)
                    continue;
                const bool mine = static_cast<int>(p) == h_.rank();
                r = ncclReduce(send.data() + offset, mine ? recv.data() : nullptr, counts[p],
                               detail::nccl_data_type<T>(), detail::nccl_reduce_op(op),
                               static_cast<int>(p), h_.comm(), h_.stream());
            }
            const ncclResult_t end = ncclGroupEnd();
            return r != ncclSuccess ? r : end;
        });
        traced("reduce_scatter", trace_type_name<T>(), send.size(), -1);
    }

    /// The equal-count form (ncclReduceScatter): every replica receives recv.size() elements.
    /// requires: send.size() == size() * recv.size(), equal on every replica.
    template <nccl_element T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op) {
        const std::vector<std::size_t> counts(static_cast<std::size_t>(std::max(h_.size(), 0)),
                                              recv.size());
        reduce_scatter<T>(send, recv, std::span<const std::size_t>(counts), op);
    }

    /// Returns once every replica has entered the barrier: a one-element all-reduce on the
    /// replica's stream, then synchronize() (so it also waits for this replica's earlier work
    /// on the stream, and throws on a failure, a failed peer or the timeout). The tag names the
    /// barrier for the caller only: NCCL compares nothing across replicas.
    void barrier(collective_tag /*tag*/ = {}) {
        const std::string name = next_operation("barrier");
        enqueue(name, [&] {
            return ncclAllReduce(h_.scratch(), h_.scratch(), 1, ncclInt32, ncclSum, h_.comm(),
                                 h_.stream());
        });
        traced("barrier", "int32", 1, -1);
        wait_traced(name, true, [&] { h_.wait(name); });
    }

    /// Sends data to replica `peer` (ncclSend); matched in order with peer's recv(data, rank()).
    /// NCCL has no tags and no any-source receive. requires: 0 <= peer < size(), peer != rank().
    template <class T>
    requires nccl_element<std::remove_const_t<T>>
    void send(std::span<T> data, int peer) {
        const std::string name = next_operation("send");
        check_spans(name, data, data);
        check_peer(name, peer);
        if (data.empty())
            return;
        h_.check_memory(name, "data", data.data());
        enqueue(name, [&] {
            return ncclSend(data.data(), data.size(),
                            detail::nccl_data_type<std::remove_const_t<T>>(), peer, h_.comm(),
                            h_.stream());
        });
        traced("send", trace_type_name<T>(), data.size(), peer);
    }
    /// Receives data from replica `peer` (ncclRecv). requires: as send().
    template <nccl_element T>
    void recv(std::span<T> data, int peer) {
        const std::string name = next_operation("recv");
        check_spans(name, data, data);
        check_peer(name, peer);
        if (data.empty())
            return;
        h_.check_memory(name, "data", data.data());
        enqueue(name, [&] {
            return ncclRecv(data.data(), data.size(), detail::nccl_data_type<T>(), peer, h_.comm(),
                            h_.stream());
        });
        traced("recv", trace_type_name<T>(), data.size(), peer);
    }

protected:
    using nccl_calls::nccl_calls;
};

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

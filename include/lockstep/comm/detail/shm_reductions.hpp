// lockstep/comm/detail/shm_reductions.hpp: reduction_handle, the collectives of a
// thread_communicator that reduce (all_reduce, reduce, reduce_scatter, all_combine).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/combine.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/shm_call.hpp"
#include "lockstep/comm/detail/shm_handle.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail::shm {

/// The reducing collectives of thread_communicator (whose comment states what they
/// guarantee), over member_handle: all_reduce, reduce, both reduce_scatter forms and
/// all_combine. thread_communicator derives from it and adds the copying collectives, split,
/// shrink and messages.
class reduction_handle : public member_handle {
public:
    /// recv[i] = op over all replicas (in rank order) of send[i]. send may be recv itself; any
    /// other overlap of the two throws errc::invalid_argument on every replica.
    /// requires: every replica passes the same count, type and op; recv.size() == send.size().
    template <class T>
    /// tag: see collective_tag (compared across replicas; default: none).
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                    collective_tag tag = {}) {
        static_assert(detail::shm::reducible_element<T>,
                      "thread_communicator reduces arithmetic element types (not bool), "
                      "lockstep::half and lockstep::bfloat16 only.");
        const std::size_t count = send.size();
        const bool small = stashed<T>(count);
        auto s = start(record<T>(detail::shm::collective_kind::all_reduce, count, recv.size(),
                                 send.data(), recv.data(), op, 0, tag),
                       small ? 1 : 2, small ? send.data() : nullptr, small ? count : 0);
        const int n = size();
        source_list<T> sources(n);
        if (small) {
            // Everyone reduces every element from the stashes, in the same order.
            for (int j = 0; j < n; ++j)
                sources[j] = stashed_send<T>(j, s);
            guarded(s, [&] {
                detail::shm::reduce_range(system(), sources.data(), n, recv.data(), 0, count, op);
            });
            return;
        }
        // This replica owns one chunk: it reduces it from every replica's send and writes the
        // result into every replica's recv (its own first), reduce-scatter and all-gather in one
        // pass: each byte of the chunk is read once per source and written once per recv.
        // Only the owner reads or writes that chunk of anybody's buffers, so in-place calls are
        // safe.
        dest_list<T> dsts(n);
        dsts[0] = recv.data();
        for (int j = 0, k = 1; j < n; ++j) {
            sources[j] = peer_send<T>(j, s);
            if (j != rank_)
                dsts[k++] = peer_recv<T>(j, s);
        }
        const auto mine = detail::shm::owned_chunk<T>(count, rank_, n);
        guarded(s, [&] {
            detail::shm::reduce_to_all(system(), sources.data(), n, dsts.data(), n, mine.first,
                                       mine.second, op);
        });
        next_phase(s);
    }

    /// As all_reduce, but only recv of replica `root` is written (the others' recv is not
    /// touched and may be empty). On root, send may be recv itself; any other overlap there
    /// throws errc::invalid_argument on every replica.
    /// requires: equal counts, type, op and root; on root recv.size() == send.size().
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root, collective_tag tag = {}) {
        static_assert(detail::shm::reducible_element<T>,
                      "thread_communicator reduces arithmetic element types (not bool), "
                      "lockstep::half and lockstep::bfloat16 only.");
        const std::size_t count = send.size();
        const bool small = stashed<T>(count);
        auto s = start(record<T>(detail::shm::collective_kind::reduce, count, recv.size(),
                                 send.data(), recv.data(), op, root, tag),
                       small ? 1 : 2, small ? send.data() : nullptr, small ? count : 0);
        const int n = size();
        source_list<T> sources(n);
        if (small) {
            if (rank_ != root)
                return;
            for (int j = 0; j < n; ++j)
                sources[j] = stashed_send<T>(j, s);
            guarded(s, [&] {
                detail::shm::reduce_range(system(), sources.data(), n, recv.data(), 0, count, op);
            });
            return;
        }
        for (int j = 0; j < n; ++j)
            sources[j] = peer_send<T>(j, s);
        // Each replica reduces its chunk straight into root's recv; on root, only the owner
        // reads a chunk of root's send, so root may reduce in place.
        const auto mine = detail::shm::owned_chunk<T>(count, rank_, n);
        guarded(s, [&] {
            detail::shm::reduce_range(system(), sources.data(), n, peer_recv<T>(root, s),
                                      mine.first, mine.second, op);
        });
        next_phase(s);
    }

    /// recv[i] = op over all replicas (in rank order) of send[offset + i], where this replica's
    /// slice of send starts at offset = counts[0] + ... + counts[rank() - 1] and holds
    /// counts[rank()] elements. Each element is reduced exactly as all_reduce reduces it, so
    /// reduce_scatter followed by all_gather gives all_reduce's bits. Sends of up to 4 KiB go
    /// through the stash (one rendezvous); larger ones read the peers' send spans (two).
    /// requires: counts has size() entries summing to send.size(), the same on every replica;
    /// recv.size() == counts[rank()]; recv is this replica's slice of send (in place) or does
    /// not overlap send. Violations throw on every replica (errc::count_mismatch for counts,
    /// errc::invalid_argument for overlapping spans) before any data moves.
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op,
                        collective_tag tag = {}) {
        static_assert(detail::shm::reducible_element<T>,
                      "thread_communicator reduces arithmetic element types (not bool), "
                      "lockstep::half and lockstep::bfloat16 only.");
        const std::size_t count = send.size();
        const bool small = stashed<T>(count);
        auto rec = record<T>(detail::shm::collective_kind::reduce_scatter, count, recv.size(),
                             send.data(), recv.data(), op, 0, tag);
        if (counts.data() == nullptr && !counts.empty())
            rec.null_counts = counts.size();
        else
            rec.counts.assign(counts.begin(), counts.end());
        auto s =
            start(std::move(rec), small ? 1 : 2, small ? send.data() : nullptr, small ? count : 0);
        // validate() has checked the counts, so this replica's slice is inside every send.
        const auto slice = detail::scatter_layout_of(counts, rank_);
        const int n = size();
        source_list<T> sources(n);
        for (int j = 0; j < n; ++j)
            sources[j] = (small ? stashed_send<T>(j, s) : peer_send<T>(j, s)) + slice.offset;
        // Peers read only their own slices of this replica's send, never the one recv may be.
        guarded(s, [&] {
            detail::shm::reduce_range(system(), sources.data(), n, recv.data(), 0, slice.mine, op);
        });
        if (!small)
            next_phase(s);
    }

    /// The equal-count form: every rank receives recv.size() elements.
    /// requires: send.size() == size() * recv.size(), recv.size() equal on every replica.
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op, collective_tag tag = {}) {
        const std::vector<std::size_t> counts(static_cast<std::size_t>(std::max(size(), 0)),
                                              recv.size());
        reduce_scatter<T>(send, recv, std::span<const std::size_t>(counts), op, tag);
    }

    /// recv[i] = combine's value for element i of every replica's input arrays, the same bits
    /// on every replica, for a function no reduce_op names (an exact sum, say). Each replica
    /// passes `arrays` input arrays of `count` elements; the replica that owns element i (one
    /// contiguous share each) calls combine(sources, n, first, m, out) for tiles of m elements
    /// from first, where sources are the n = size() * arrays.size() input arrays (replica 0's
    /// arrays in order, then replica 1's, ...) and out a buffer distinct from all of them:
    /// combine writes out[k] for k < m from sources[j][first + k]. The value is stored to every
    /// replica's recv in the same pass (like all_reduce: each input byte read once, each output
    /// byte written once), two rendezvous. An array may be recv itself (in place). combine runs
    /// on this replica's threads and must not call collectives.
    /// requires: equal count and arrays.size() >= 1 on every replica; recv.size() == count;
    /// each array holds count elements. Violations throw on every replica before data moves.
    template <class T, class Combine>
    void all_combine(std::span<const T* const> arrays, std::size_t count, std::span<T> recv,
                     const Combine& combine, collective_tag tag = {}) {
        static_assert(std::is_trivially_copyable_v<T>, "all_combine copies elements as bytes.");
        auto rec = record<T>(detail::shm::collective_kind::all_combine, count, recv.size(), nullptr,
                             recv.data(), reduce_op::sum, 0, tag);
        rec.arrays = reinterpret_cast<const void* const*>(arrays.data());
        rec.array_count = arrays.size();
        auto s = start(std::move(rec), 2);
        const int n = size();
        const std::size_t k = arrays.size(); // validate() has checked that every replica agrees
        source_list<T> sources(n * static_cast<int>(k));
        dest_list<T> dsts(n);
        dsts[0] = recv.data();
        for (int j = 0, d = 1; j < n; ++j) {
            const auto* theirs = static_cast<const T* const*>(
                static_cast<const void*>(group_->call(j, s.seq).arrays));
            for (std::size_t c = 0; c < k; ++c)
                sources[j * static_cast<int>(k) + static_cast<int>(c)] = theirs[c];
            if (j != rank_)
                dsts[d++] = peer_recv<T>(j, s);
        }
        const auto mine = detail::shm::owned_chunk<T>(count, rank_, n);
        guarded(s, [&] {
            combine_in_place(
                system(),
                std::span<const T* const>(sources.data(), static_cast<std::size_t>(n) * k),
                std::span<T* const>(dsts.data(), static_cast<std::size_t>(n)), mine.first,
                mine.second, combine);
        });
        next_phase(s);
    }

protected:
    using member_handle::member_handle;
};

} // namespace lockstep::detail::shm

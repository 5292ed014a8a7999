// lockstep/comm/detail/mpi_reduce_scatter.hpp: mpi_reduce_scatter, the reduce_scatter of an
// mpi_communicator (with per-rank counts, large sends in pieces) and the 16-bit reductions
// built on its exchange. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/mpi_all_to_all.hpp"
#include "lockstep/comm/detail/mpi_float16.hpp"
#include "lockstep/comm/detail/mpi_signature.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/float16.hpp"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <mpi.h>

namespace lockstep::detail {

/// The reduce-scatter of mpi_communicator (whose comment states what it guarantees): the
/// counted and equal-count forms, a large send cut into pieces, and the exchange and
/// rank-order fold with which half and bfloat16 are reduced (detail/mpi_float16.hpp), which
/// mpi_communicator's all_reduce and reduce follow with a gather.
class mpi_reduce_scatter : public mpi_all_to_all {
public:
    /// Rank r receives counts[r] elements: recv[i] = op over replicas of send[offset + i],
    /// offset = counts[0] + ... + counts[rank() - 1] (MPI_Ireduce_scatter_block when every count
    /// is equal, else MPI_Ireduce_scatter; a send of more than 2 MiB in steps of 1 MiB that
    /// take their share of every receiver's slice, or all_reduce pieces when one rank receives
    /// everything, see reduce_scatter_pieces). recv may be this replica's slice of send (in
    /// place: a small result goes through the communicator's scratch, kept between calls,
    /// since MPI_IN_PLACE means another layout).
    /// requires: counts has size() entries summing to send.size(), equal on every replica
    /// (verified through a hash of the counts in the signature); recv.size() == counts[rank()];
    /// recv this replica's slice of send or disjoint from it (an empty recv may point anywhere,
    /// into send too); half and bfloat16: send.size() <= INT_MAX (else errc::unsupported; other
    /// types are cut into pieces past 2 MiB, any size); spans non-null unless empty.
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op,
                        collective_tag tag = {}) {
        check_type<T>();
        const std::string bad = detail::join_problems({detail::span_problem(send, "send"),
                                                       detail::span_problem(recv, "recv"),
                                                       detail::span_problem(counts, "counts")});
        const auto layout =
            bad.empty() ? detail::scatter_layout_of(counts, rank_) : detail::scatter_layout{};
        const bool shaped = bad.empty() && counts.size() == static_cast<std::size_t>(size_) &&
                            !layout.overflow && layout.total == send.size() &&
                            recv.size() == layout.mine;
        // An empty recv holds no element, so it overlaps nothing (it may point into send).
        const bool in_place = shaped && !recv.empty() && recv.data() == send.data() + layout.offset;
        const bool ok = shaped && (in_place || recv.empty() || disjoint(send, recv));
        // Past 2 pieces the send is cut (reduce_scatter_pieces: int counts per piece); only the
        // 16-bit exchange hands MPI whole counts.
        const bool fits =
            !is_wire_float16_v<T> || (send.size() <= std::size_t(std::numeric_limits<int>::max()) &&
                                      (!shaped || detail::float16_fits(counts)));
        const auto traced =
            begin(detail::mpi_collective::reduce_scatter, send.size(), detail::mpi_type<T>::id, 0,
                  op, ok && fits, bad.empty() ? counts : std::span<const std::size_t>(), tag);
        LOCKSTEP_REQUIRE(bad.empty(), errc::invalid_argument, rank_, name(), bad);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "counts ",
                         detail::describe_counts(counts), " (", counts.size(),
                         " entries for a group of ", size_, "), send.size() = ", send.size(),
                         ", recv.size() = ", recv.size(),
                         " (requires one count per replica summing to send.size(), recv.size() "
                         "== counts[rank()], recv this replica's slice of send or disjoint)");
        LOCKSTEP_REQUIRE(fits, errc::unsupported, rank_, name(), "send.size() = ", send.size(),
                         " half or bfloat16 values exceed MPI's int count (",
                         std::numeric_limits<int>::max(),
                         ", also size() * the largest count); reduce-scatter them in pieces");
        if constexpr (is_wire_float16_v<T>) {
            // The exchange completes before the fold writes recv, so in place needs no copy.
            if (layout.total != 0) {
                auto p = detail::float16_plan_of(counts, rank_);
                const auto kept = keep_arrays(p);
                exchange_fold16(send.data(), recv.data(), p, layout.total, op);
            }
            return;
        }
        // Whether to cut pieces depends on send.size() only, the same on every replica.
        if (send.size_bytes() > 2 * piece_bytes) {
            reduce_scatter_pieces(send, recv, counts, op);
            return;
        }
        // In place, the result lands in this communicator's scratch (kept between calls: no
        // allocation, zero fill or page faults per call) and is copied into recv.
        T* staged = in_place ? scratch<T>(recv.size()) : nullptr;
        // MPI refuses a receive buffer that aliases the send buffer even for zero elements: an
        // empty recv is handed over as a distinct (never written) address.
        const auto unused = buffer<T>(recv.empty() ? 1 : 0);
        T* out = in_place ? staged : recv.empty() ? unused.data() : recv.data();
        MPI_Request req = MPI_REQUEST_NULL;
        if (layout.equal) {
            call(MPI_Ireduce_scatter_block(send.data(), out, static_cast<int>(layout.mine),
                                           detail::mpi_type<T>::datatype(),
                                           detail::to_mpi_op<T>(op), comm_, &req),
                 "MPI_Ireduce_scatter_block", send.size());
            finish(req, "MPI_Ireduce_scatter_block", send.size(), send.size_bytes());
        } else {
            std::vector<int> ints(counts.begin(), counts.end());
            const auto kept = keep_arrays(ints);
            call(MPI_Ireduce_scatter(send.data(), out, ints.data(), detail::mpi_type<T>::datatype(),
                                     detail::to_mpi_op<T>(op), comm_, &req),
                 "MPI_Ireduce_scatter", send.size());
            finish(req, "MPI_Ireduce_scatter", send.size(), send.size_bytes());
        }
        if (in_place)
            std::copy(staged, staged + recv.size(), recv.begin());
    }

    /// The equal-count form: every replica receives recv.size() elements
    /// (MPI_Ireduce_scatter_block). requires: send.size() == size() * recv.size(), equal on
    /// every replica; otherwise as the counted form.
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op, collective_tag tag = {}) {
        const std::vector<std::size_t> counts(static_cast<std::size_t>(std::max(size_, 0)),
                                              recv.size());
        reduce_scatter<T>(send, recv, std::span<const std::size_t>(counts), op, tag);
    }

protected:
    using mpi_all_to_all::mpi_all_to_all;
    // An empty handle (mpi_communicator::message_view fills it in).
    mpi_reduce_scatter() = default;

    // half and bfloat16 (detail/mpi_float16.hpp): out = this replica's slice of the rank-order
    // fold of every replica's send, after an MPI_Ialltoallv of the slices. requires: p.mine
    // elements at out; total = send's size > 0.
    template <class W>
    void exchange_fold16(const W* send, W* out, const detail::float16_plan& p, std::size_t total,
                         reduce_op op) {
        const auto gathered =
            buffer<W>(std::max<std::size_t>(1, p.mine * static_cast<std::size_t>(size_)));
        MPI_Request req = MPI_REQUEST_NULL;
        call(MPI_Ialltoallv(send, p.send_counts.data(), p.send_displs.data(), MPI_UINT16_T,
                            gathered.data(), p.recv_counts.data(), p.recv_displs.data(),
                            MPI_UINT16_T, comm_, &req),
             "MPI_Ialltoallv", total);
        finish(req, "MPI_Ialltoallv", total, total * sizeof(W));
        detail::fold_float16(system(), gathered.data(), size_, p.mine, out, op);
    }
    // Pieces whose even split over the ranks keeps every int offset of the plan in range.
    static constexpr std::size_t float16_piece = std::numeric_limits<int>::max() / 2;
    // The exchange and fold, then every replica gathers the folded slices (in place).
    template <class W>
    void all_reduce16(const W* send, W* recv, std::size_t count, reduce_op op) {
        for (std::size_t at = 0; at < count; at += float16_piece) {
            const std::size_t c = std::min(count - at, float16_piece);
            auto p = detail::float16_plan_of(detail::even_counts(c, size_), rank_);
            const auto kept = keep_arrays(p);
            W* out = recv + at;
            exchange_fold16(send + at, out + p.displs[static_cast<std::size_t>(rank_)], p, c, op);
            MPI_Request req = MPI_REQUEST_NULL;
            call(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, p.counts.data(),
                                 p.displs.data(), MPI_UINT16_T, comm_, &req),
                 "MPI_Iallgatherv", count);
            finish(req, "MPI_Iallgatherv", count, c * sizeof(W));
        }
    }
    // The exchange and fold, then root gathers the folded slices (recv: root's, else null).
    template <class W>
    void reduce16(const W* send, W* recv, std::size_t count, reduce_op op, int root) {
        const bool at_root = rank_ == root;
        for (std::size_t at = 0; at < count; at += float16_piece) {
            const std::size_t c = std::min(count - at, float16_piece);
            auto p = detail::float16_plan_of(detail::even_counts(c, size_), rank_);
            const auto kept = keep_arrays(p);
            const auto slice = buffer<W>(at_root ? 0 : std::max<std::size_t>(1, p.mine));
            W* out = at_root ? recv + at + p.displs[static_cast<std::size_t>(rank_)] : slice.data();
            exchange_fold16(send + at, out, p, c, op);
            MPI_Request req = MPI_REQUEST_NULL;
            call(MPI_Igatherv(at_root ? MPI_IN_PLACE : out, static_cast<int>(p.mine), MPI_UINT16_T,
                              at_root ? recv + at : nullptr, p.counts.data(), p.displs.data(),
                              MPI_UINT16_T, root, comm_, &req),
                 "MPI_Igatherv", count);
            finish(req, "MPI_Igatherv", count, c * sizeof(W));
        }
    }

private:
    /// The bytes one step of a large reduce_scatter hands to MPI (sends over twice as large are
    /// cut, see reduce_scatter_pieces): above MPICH's long-message threshold (512 KiB, where it
    /// switches from recursive halving to pairwise exchange), small enough that the piece and
    /// MPI's own buffers stay in cache. On 2 local ranks (MPICH 4.0, 25.6 M floats split evenly,
    /// medians of 9): 1 MiB pieces that take their share of every rank's slice 19.8 ms (512 KiB
    /// 20.1, 2 MiB 21.0), against 43 ms for 1 MiB pieces cut from send in order (each then has
    /// one receiver) and 25.7 ms for all_reduce's 2 MiB pieces.
    static constexpr std::size_t piece_bytes = std::size_t(1) << 20;

    /// A large reduce_scatter (checks done by the caller), in steps that each carry a piece of
    /// at most piece_bytes, shared out over the ranks that receive: step k takes elements
    /// [k per, (k + 1) per) of every receiver's slice (fewer where a slice ends), copies them in
    /// rank order into the scratch (while in cache) and reduce-scatters that, so every receiver
    /// sums in every step (a slice that spans one piece per step when a single rank receives,
    /// as in ZeRO's buckets that lie in one shard). send is only read, so in place needs nothing
    /// more. Every replica cuts the same steps: the counts are equal everywhere.
    template <class T>
    void reduce_scatter_pieces(std::span<const T> send, std::span<T> recv,
                               std::span<const std::size_t> counts, reduce_op op) {
        const std::size_t ranks = counts.size();
        std::size_t receivers = 0, largest = 0;
        std::vector<std::size_t> starts(ranks);
        for (std::size_t r = 0, at = 0; r < ranks; at += counts[r], ++r) {
            starts[r] = at;
            largest = std::max(largest, counts[r]);
            if (counts[r] != 0)
                ++receivers;
        }
        const std::size_t per = std::max<std::size_t>(1, piece_bytes / sizeof(T) / receivers);
        T* staged = scratch<T>(per * ranks);
        // MPI refuses a receive buffer that aliases send even for zero elements: a step with
        // nothing for this rank hands over a distinct, never written address.
        const auto unused = buffer<T>(1);
        std::vector<int> piece_counts(ranks);
        const auto kept = keep_arrays(piece_counts);
        for (std::size_t lo = 0; lo < largest; lo += per) {
            std::size_t total = 0;
            for (std::size_t r = 0; r < ranks; ++r) {
                const std::size_t c = counts[r] > lo ? std::min(per, counts[r] - lo) : 0;
                piece_counts[r] = static_cast<int>(c);
                const T* from = send.data() + starts[r] + lo;
                std::copy(from, from + c, staged + total);
                total += c;
            }
            const bool mine = piece_counts[static_cast<std::size_t>(rank_)] != 0;
            MPI_Request req = MPI_REQUEST_NULL;
            call(MPI_Ireduce_scatter(staged, mine ? recv.data() + lo : unused.data(),
                                     piece_counts.data(), detail::mpi_type<T>::datatype(),
                                     detail::to_mpi_op<T>(op), comm_, &req),
                 "MPI_Ireduce_scatter", send.size());
            finish(req, "MPI_Ireduce_scatter", send.size(), total * sizeof(T));
        }
    }
};

} // namespace lockstep::detail

// lockstep/comm/detail/mpi_all_to_all.hpp: mpi_all_to_all, the all-to-all collectives of an
// mpi_communicator (all_to_all, all_to_all_others). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/mpi_messages.hpp"
#include "lockstep/comm/detail/mpi_signature.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/core/error.hpp"

#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <mpi.h>

namespace lockstep::detail {

/// The all-to-all collectives of mpi_communicator (whose comment states what it guarantees),
/// over its point-to-point layer: every block exchanged in one nonblocking MPI call, polled
/// against the handle's timeout.
class mpi_all_to_all : public mpi_messages {
public:
    /// Block r of recv = block rank() of replica r's send (MPI_Ialltoall; blocks of
    /// send.size() / size() elements). requires: send.size() equal on every replica and a
    /// multiple of size(); recv.size() == send.size(); send and recv disjoint (no in-place
    /// form), non-null unless empty. A block beyond INT_MAX elements is refused with
    /// errc::unsupported.
    template <class T>
    void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    collective_tag tag = {}) {
        const auto traced = begin_all_to_all(detail::mpi_collective::all_to_all, send, recv, tag);
        const std::size_t n = send.size();
        const std::size_t block = n / static_cast<std::size_t>(size_);
        MPI_Request req = MPI_REQUEST_NULL;
        call(MPI_Ialltoall(send.data(), static_cast<int>(block), detail::mpi_type<T>::datatype(),
                           recv.data(), static_cast<int>(block), detail::mpi_type<T>::datatype(),
                           comm_, &req),
             "MPI_Ialltoall", n);
        finish(req, "MPI_Ialltoall", n, send.size_bytes());
    }

    /// As all_to_all, except that recv's own block (block rank()) is neither read nor written:
    /// one MPI_Ialltoallv of whole blocks (a contiguous datatype of one block, so no count or
    /// displacement outgrows an int) that sends nothing to this process. A caller that reads its
    /// own block where it lies in send saves that block's copy (2 ranks on one node, blocks of
    /// 51 MB, MPICH 4.0: 13 ms where MPI_Ialltoall took 21). requires: as
    /// all_to_all (send and recv disjoint, sizes equal and a multiple of size(), blocks of at most
    /// INT_MAX elements, else errc::unsupported); every replica calls all_to_all_others, not
    /// all_to_all (verification tells them apart).
    template <class T>
    void all_to_all_others(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                           collective_tag tag = {}) {
        const auto traced =
            begin_all_to_all(detail::mpi_collective::all_to_all_others, send, recv, tag);
        const std::size_t n = send.size();
        const std::size_t block = n / static_cast<std::size_t>(size_);
        if (block == 0 || size_ == 1)
            return;
        MPI_Datatype whole = MPI_DATATYPE_NULL;
        call(MPI_Type_contiguous(static_cast<int>(block), detail::mpi_type<T>::datatype(), &whole),
             "MPI_Type_contiguous", n);
        call(MPI_Type_commit(&whole), "MPI_Type_commit", n);
        // Block j at displacement j (in blocks); nothing to or from this process.
        std::vector<int> counts(static_cast<std::size_t>(size_), 1);
        std::vector<int> displs(static_cast<std::size_t>(size_));
        for (int j = 0; j < size_; ++j)
            displs[static_cast<std::size_t>(j)] = j;
        counts[static_cast<std::size_t>(rank_)] = 0;
        const auto kept = keep_arrays(counts, displs);
        MPI_Request req = MPI_REQUEST_NULL;
        const int rc = MPI_Ialltoallv(send.data(), counts.data(), displs.data(), whole, recv.data(),
                                      counts.data(), displs.data(), whole, comm_, &req);
        MPI_Type_free(&whole); // a pending operation keeps what it needs of the type
        call(rc, "MPI_Ialltoallv", n);
        finish(req, "MPI_Ialltoallv", n, send.size_bytes());
    }

protected:
    using mpi_messages::mpi_messages;
    // An empty handle (mpi_communicator::message_view fills it in).
    mpi_all_to_all() = default;

private:
    // all_to_all and all_to_all_others (kind): checks the spans, verifies the call (every
    // replica's arguments valid, the same kind and counts) and returns its trace scope; a
    // replica's own bad arguments throw errc::invalid_argument, blocks beyond INT_MAX elements
    // errc::unsupported.
    template <class T>
    [[nodiscard]] flight_recorder::scope begin_all_to_all(detail::mpi_collective kind,
                                                          std::span<const T> send,
                                                          std::span<T> recv, collective_tag tag) {
        check_type<T>();
        const std::size_t n = send.size();
        const std::size_t block = n / static_cast<std::size_t>(size_);
        const std::string bad = detail::join_problems(
            {detail::span_problem(send, "send"), detail::span_problem(recv, "recv")});
        const bool ok = bad.empty() && n % static_cast<std::size_t>(size_) == 0 &&
                        recv.size() == n && disjoint(send, recv);
        const bool fits = block <= std::size_t(std::numeric_limits<int>::max());
        auto traced =
            begin(kind, n, detail::mpi_type<T>::id, 0, reduce_op::sum, ok && fits, {}, tag);
        LOCKSTEP_REQUIRE(bad.empty(), errc::invalid_argument, rank_, name(), bad);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "send.size() = ", n,
                         ", recv.size() = ", recv.size(), " (requires equal sizes, a multiple of ",
                         size_, ", and disjoint buffers)");
        LOCKSTEP_REQUIRE(fits, errc::unsupported, rank_, name(), "blocks of ", block,
                         " elements exceed MPI's int count; exchange them in pieces");
        return traced;
    }
};

} // namespace lockstep::detail

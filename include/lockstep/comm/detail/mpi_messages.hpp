// lockstep/comm/detail/mpi_messages.hpp: mpi_messages, the point-to-point messages of an
// mpi_communicator (send, recv, recv_any, probe) over its mpi_handle.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/mpi_handle.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/core/error.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <mpi.h>

namespace lockstep::detail {

/// The point-to-point half of mpi_communicator (whose comment states what it guarantees): a
/// message is a 16-byte header (element type and count) and the data, received through a
/// matched probe, so that a receiver refuses another type or count before it writes its buffer
/// and consumes the message; every wait is polled against the handle's timeout.
class mpi_messages : public mpi_handle {
public:
    /// Sends data to replica dest with tag (MPI_Isend, waited for within the timeout): a
    /// 16-byte header (element type and count), then the data, so that the receiver can refuse
    /// another type or count before it writes its buffer.
    /// requires: 0 <= dest < size(), 0 <= tag <= MPI_TAG_UB, data.size() <= INT_MAX, data
    /// non-null unless empty.
    template <class T>
    void send(std::span<T> data, int dest, int tag) {
        using E = std::remove_const_t<T>;
        check_type<E>();
        check_peer(dest, tag, data, "send");
        const auto head = buffer<std::int64_t>(2); // kept if the send times out
        head.data()[0] = detail::mpi_type<E>::id;
        head.data()[1] = static_cast<std::int64_t>(data.size());
        std::array<MPI_Request, 2> req{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
        call_p2p(MPI_Isend(head.data(), 2, MPI_INT64_T, dest, tag, comm_, &req[0]), "send",
                 "MPI_Isend", dest, tag);
        call_p2p(MPI_Isend(data.data(), static_cast<int>(data.size()),
                           detail::mpi_type<E>::datatype(), dest, tag, comm_, &req[1]),
                 "send", "MPI_Isend", dest, tag);
        bool done = false;
        call_p2p(
            detail::mpi_poll(
                [&](int& flag) { return MPI_Testall(2, req.data(), &flag, MPI_STATUSES_IGNORE); },
                deadline(), control_, seq_, done,
                detail::mpi_poll_schedule::for_bytes(data.size_bytes())),
            "send", "MPI_Testall", dest, tag);
        if (!done)
            p2p_timeout("send", "MPI_Isend", dest, tag, detail::same_error{});
    }
    /// Receives the next message from replica source with tag into data. ensures: the
    /// message held exactly data.size() elements of T, else it is consumed, data is not
    /// written, and errc::count_mismatch (another count) or errc::shape_mismatch (another
    /// element type) is thrown naming both.
    template <class T>
    void recv(std::span<T> data, int source, int tag) {
        recv(data, source, tag, detail::same_error{});
    }
    /// As recv(data, source, tag) (and recv_any below, as recv_any(data, tag)), except that
    /// where its wait times out the communicator fails with on_timeout(e) (a lockstep::error)
    /// in place of its own errc::timeout error e, under params::on_failure: the caller's account
    /// of what the wait was for is what an abort prints (named_timeout_communicator).
    template <class T, class OnTimeout>
    void recv(std::span<T> data, int source, int tag, OnTimeout&& on_timeout) {
        check_peer(source, tag, data, "recv");
        receive(data, source, tag, "recv", on_timeout);
    }
    /// As recv, from any replica; returns the sender's rank.
    template <class T>
    int recv_any(std::span<T> data, int tag) {
        return recv_any(data, tag, detail::same_error{});
    }
    template <class T, class OnTimeout>
    int recv_any(std::span<T> data, int tag, OnTimeout&& on_timeout) {
        check_peer(0, tag, data, "recv_any");
        return receive(data, MPI_ANY_SOURCE, tag, "recv_any", on_timeout);
    }

    /// probe's source for "from any replica".
    static constexpr int any_source = MPI_ANY_SOURCE;

    /// Whether a message with tag from replica source (or any replica: any_source) has arrived;
    /// returns its sender's rank, or nothing. Does not wait and does not receive: the next recv
    /// from that sender with that tag gets the probed message (MPI's non-overtaking order), as
    /// long as no other thread receives on this communicator meanwhile.
    /// requires: source == any_source or 0 <= source < size(), 0 <= tag <= MPI_TAG_UB. A failing
    /// MPI_Iprobe breaks the communicator (errc::mpi, params::on_failure).
    std::optional<int> probe(int source, int tag) {
        check_peer(source == any_source ? 0 : source, tag, std::span<const int>(), "probe");
        int flag = 0;
        MPI_Status st;
        call_p2p(MPI_Iprobe(source, tag, comm_, &flag, &st), "probe", "MPI_Iprobe", source, tag);
        if (flag == 0)
            return std::nullopt;
        return st.MPI_SOURCE;
    }

protected:
    using mpi_handle::mpi_handle;
    // An empty handle (mpi_communicator::message_view fills it in).
    mpi_messages() = default;

private:
    template <class T>
    void check_peer(int peer, int tag, std::span<T> data, const char* op) const {
        require_usable(op);
        const std::string bad = detail::span_problem(data, "data");
        LOCKSTEP_REQUIRE(bad.empty(), errc::invalid_argument, rank_, op, bad);
        LOCKSTEP_REQUIRE(peer >= 0 && peer < size_, errc::invalid_argument, rank_, op, "replica ",
                         peer, " is not in this group of ", size_);
        LOCKSTEP_REQUIRE(tag >= 0 && tag <= tag_ub_, errc::invalid_argument, rank_, op, "tag ", tag,
                         " is outside [0, ", tag_ub_, "]");
        LOCKSTEP_REQUIRE(data.size() <= std::size_t(std::numeric_limits<int>::max()),
                         errc::unsupported, rank_, op, data.size(),
                         " elements exceed MPI's int count; send it in pieces");
    }

    // A matched probe polled against the deadline (on_timeout's periods of it: patient()): the
    // next message from source (MPI's non-overtaking order) with tag. Its timeout fails with
    // on_timeout(the timeout's error).
    template <class OnTimeout>
    MPI_Message probe_message(int source, int tag, const char* op, MPI_Status& st,
                              OnTimeout&& on_timeout) {
        MPI_Message msg = MPI_MESSAGE_NULL;
        bool done = false;
        for (int left = detail::timeout_periods(on_timeout); !done && left > 0; --left)
            call_p2p(
                detail::mpi_poll(
                    [&](int& flag) { return MPI_Improbe(source, tag, comm_, &flag, &msg, &st); },
                    deadline(), control_, seq_, done),
                op, "MPI_Improbe", source, tag);
        if (!done)
            p2p_timeout(op, "MPI_Improbe", source, tag, on_timeout);
        return msg;
    }

    // Receives a probed message into nothing (its size in bytes may exceed an int: it is
    // received in units of up to 8 bytes, which keeps the unit count within an int for any
    // sender's type of up to 8 bytes); returns its size in bytes.
    MPI_Count discard(MPI_Message& msg, const MPI_Status& st, int tag, const char* op) {
        MPI_Count bytes = 0;
        call_p2p(MPI_Get_elements_x(&st, MPI_BYTE, &bytes), op, "MPI_Get_elements_x", st.MPI_SOURCE,
                 tag);
        int unit = 8;
        while (bytes % unit != 0)
            unit /= 2;
        LOCKSTEP_REQUIRE(bytes / unit <= std::numeric_limits<int>::max(), errc::unsupported, rank_,
                         op, "the message from replica ", st.MPI_SOURCE, " with tag ", tag,
                         " holds ", bytes,
                         " bytes, more than can be discarded; it is still "
                         "queued");
        MPI_Datatype unit_type = MPI_DATATYPE_NULL;
        call_p2p(MPI_Type_contiguous(unit, MPI_BYTE, &unit_type), op, "MPI_Type_contiguous",
                 st.MPI_SOURCE, tag);
        call_p2p(MPI_Type_commit(&unit_type), op, "MPI_Type_commit", st.MPI_SOURCE, tag);
        std::vector<unsigned char> sink(static_cast<std::size_t>(bytes));
        const int rc = MPI_Mrecv(sink.data(), static_cast<int>(bytes / unit), unit_type, &msg,
                                 MPI_STATUS_IGNORE);
        MPI_Type_free(&unit_type);
        call_p2p(rc, op, "MPI_Mrecv", st.MPI_SOURCE, tag);
        return bytes;
    }

    // The sender's header (element type and count, see send), then its data from the same
    // sender: another element type or count is consumed and reported (errc::shape_mismatch or
    // errc::count_mismatch), so the next receive does not match it again, and data is not
    // written.
    template <class T, class OnTimeout>
    int receive(std::span<T> data, int source, int tag, const char* op, OnTimeout&& on_timeout) {
        check_type<T>();
        MPI_Status st;
        MPI_Message msg = probe_message(source, tag, op, st, on_timeout);
        const int from = st.MPI_SOURCE;
        int words = 0;
        call_p2p(MPI_Get_count(&st, MPI_INT64_T, &words), op, "MPI_Get_count", from, tag);
        if (words != 2) { // not a lockstep header: some other sender's message
            const MPI_Count bytes = discard(msg, st, tag, op);
            fail(errc::count_mismatch, rank_, op, "the message from replica ", from, " with tag ",
                 tag, " holds ", bytes,
                 " bytes and no lockstep header (was it sent with MPI_Send "
                 "instead of mpi_communicator::send?); the message was discarded");
        }
        std::array<std::int64_t, 2> head{};
        call_p2p(MPI_Mrecv(head.data(), 2, MPI_INT64_T, &msg, MPI_STATUS_IGNORE), op, "MPI_Mrecv",
                 from, tag);
        msg = probe_message(from, tag, op, st, on_timeout);
        const std::int64_t want = detail::mpi_type<T>::id;
        const auto sent = [&] {
            return detail::concat(head[1], " ", detail::mpi_type_name(head[0]), " elements");
        };
        if (head[0] != want || head[1] != static_cast<std::int64_t>(data.size())) {
            const MPI_Count bytes = discard(msg, st, tag, op);
            fail(head[0] != want ? errc::shape_mismatch : errc::count_mismatch, rank_, op,
                 "the message from replica ", from, " with tag ", tag, " holds ", sent(), " (",
                 bytes, " bytes) but the receive buffer holds ", data.size(), " ",
                 detail::mpi_type<T>::name, " elements; the message was discarded");
        }
        call_p2p(MPI_Mrecv(data.data(), static_cast<int>(data.size()),
                           detail::mpi_type<T>::datatype(), &msg, MPI_STATUS_IGNORE),
                 op, "MPI_Mrecv", from, tag);
        return from;
    }
};

} // namespace lockstep::detail

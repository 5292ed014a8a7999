// lockstep/comm/mpi_communicator.hpp: mpi_communicator, one replica per process over an MPI_Comm
// (and mpi_environment, which starts MPI). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/mpi_signature.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

namespace lockstep {

/// Runtime options of mpi_communicator.
struct mpi_communicator_params {
    bool verify = true; ///< exchange a signature before each collective (see mpi_communicator)
};

/// A communicator whose replicas are the processes of an MPI communicator (one replica per
/// process, within a node or across nodes). Models lockstep::communicator,
/// lockstep::point_to_point_communicator and lockstep::all_to_all_communicator. Element types:
/// float, double, int, std::int64_t, std::uint8_t. Collectives follow MPI's rules: every replica
/// calls them in the same order, from one thread at a time (the thread level of mpi_environment
/// must allow that thread).
///
/// Verification (params::verify, default on): before each collective the replicas exchange a
/// signature {collective, sequence number, count, element type, root, reduce_op, arguments ok}
/// in one MPI_Allreduce of 14 int64 (MPI_MAX over {v, -v} gives min and max at once). Replicas
/// that disagree throw lockstep::error on every replica (errc::count_mismatch for counts) naming
/// the collective, its sequence number and the min/max values; a replica whose own arguments
/// are invalid throws its own error and the others get errc::peer_failure instead of waiting.
/// Cost: one extra 112-byte MPI_Allreduce per collective. bench_allreduce, 2 ranks on one node
/// (MPICH 4.0.2, medians): about +2 us, i.e. 2.3-2.5x raw MPI_Allreduce at 4 B, +25% at
/// 16 KiB, +3-5% at 256 KiB, a few percent or noise from 1 MiB on; without verification
/// lockstep is within 1-2% of raw MPI at every size. Turn it off ({.verify = false}) for many tiny
/// collectives once a program is known to be consistent. Every replica must use the same `verify`.
/// Without it, mismatched counts are MPI's undefined behaviour (truncation errors, garbage or a
/// hang).
///
/// Failure: MPI cannot release peers that wait in a collective for a process that threw. A
/// replica that throws and will not call the next collective must call `abort(e)` (it prints
/// the error and calls MPI_Abort on MPI_COMM_WORLD); destructors run during stack unwinding
/// cannot help the others.
class mpi_communicator {
public:
    using system_type = host_system;
    using params = mpi_communicator_params;

    /// requires: MPI initialised (mpi_environment), comm a valid intra-communicator. Collective
    /// over comm. ensures: owns a duplicate of comm with MPI_ERRORS_RETURN, so MPI failures
    /// become lockstep::error (errc::mpi) instead of aborting.
    explicit mpi_communicator(MPI_Comm comm, params p = {}) : params_(p) {
        int initialized = 0;
        LOCKSTEP_MPI_CHECK(MPI_Initialized(&initialized));
        LOCKSTEP_REQUIRE(initialized, errc::invalid_argument, -1, "mpi_communicator",
                         "MPI is not initialised: create a lockstep::mpi_environment first");
        LOCKSTEP_REQUIRE(comm != MPI_COMM_NULL, errc::invalid_argument, -1, "mpi_communicator",
                         "comm is MPI_COMM_NULL");
        LOCKSTEP_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
        try {
            setup();
            // The cores of a node are shared by every process on it that this group knows of.
            MPI_Comm node = MPI_COMM_NULL;
            LOCKSTEP_MPI_CHECK(
                MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
            LOCKSTEP_MPI_CHECK(MPI_Comm_size(node, &node_ranks_));
            LOCKSTEP_MPI_CHECK(MPI_Comm_free(&node));
        } catch (...) {
            release();
            throw;
        }
    }
    mpi_communicator(const mpi_communicator&) = delete;
    mpi_communicator& operator=(const mpi_communicator&) = delete;
    mpi_communicator(mpi_communicator&& o) noexcept { take(o); }
    mpi_communicator& operator=(mpi_communicator&& o) noexcept {
        if (this != &o) {
            release();
            take(o);
        }
        return *this;
    }
    ~mpi_communicator() { release(); }

    int rank() const noexcept { return rank_; }
    int size() const noexcept { return size_; }
    /// A host_system whose thread budget is the node's cores divided by the processes of this
    /// group on the node (for a split, those of the group it was split from).
    host_system system() const { return host_system(host_system::default_threads(node_ranks_)); }
    /// The owned MPI communicator (MPI_COMM_NULL after a move).
    MPI_Comm native() const noexcept { return comm_; }
    /// True when the processes run on more than one node: collectives then cross a network
    /// instead of running as shared-memory copies on the compute cores.
    bool spans_nodes() const noexcept { return node_ranks_ < size_; }
    bool verifying() const noexcept { return params_.verify; }
    /// The number of collectives this communicator has started (the "#n" in error messages).
    std::int64_t sequence() const noexcept { return seq_; }

    /// recv[i] = op over replicas of send[i]. send == recv runs in place (MPI_IN_PLACE).
    /// requires: send.size() == recv.size(), equal on every replica; send and recv identical
    /// or disjoint.
    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    reduce_op op) {
        check_type<T>();
        const bool in_place = send.data() == recv.data();
        const bool ok = send.size() == recv.size() && (in_place || disjoint(send, recv));
        begin(detail::mpi_collective::all_reduce, send.size(), detail::mpi_type<T>::id, 0, op, ok);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "send.size() = ", send.size(),
                         ", recv.size() = ", recv.size(),
                         " (sizes must be equal; buffers identical or disjoint)");
        for_each_chunk(recv.size(), [&](std::size_t at, int n) {
            call(MPI_Allreduce(in_place ? MPI_IN_PLACE : send.data() + at, recv.data() + at, n,
                               detail::mpi_type<T>::datatype(), detail::to_mpi_op<T>(op), comm_),
                 "MPI_Allreduce", recv.size());
        });
    }

    /// data on every replica becomes root's data. requires: 0 <= root < size(), data.size()
    /// equal on every replica.
    template <class T>
    void broadcast(std::span<T> data, int root) {
        check_type<T>();
        const bool ok = root >= 0 && root < size_;
        begin(detail::mpi_collective::broadcast, data.size(), detail::mpi_type<T>::id, root,
              reduce_op::sum, ok);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "root ", root,
                         " is not a replica of this group of ", size_);
        for_each_chunk(data.size(), [&](std::size_t at, int n) {
            call(MPI_Bcast(data.data() + at, n, detail::mpi_type<T>::datatype(), root, comm_),
                 "MPI_Bcast", data.size());
        });
    }

    /// recv = every replica's send, concatenated in rank order. send may be this replica's
    /// slot of recv (in place). requires: recv.size() == size() * send.size(), send.size()
    /// equal on every replica and <= INT_MAX.
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
        check_type<T>();
        const std::size_t n = send.size();
        const bool in_place = n != 0 && send.data() == recv.data() + rank_ * n;
        const bool ok = recv.size() == static_cast<std::size_t>(size_) * n &&
                        n <= std::size_t(std::numeric_limits<int>::max()) &&
                        (in_place || disjoint(send, recv));
        begin(detail::mpi_collective::all_gather, n, detail::mpi_type<T>::id, 0, reduce_op::sum,
              ok);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "send.size() = ", n,
                         ", recv.size() = ", recv.size(), " (requires recv.size() == ", size_,
                         " * send.size() <= INT_MAX; send disjoint from recv or its own slot)");
        call(MPI_Allgather(in_place ? MPI_IN_PLACE : send.data(), static_cast<int>(n),
                           detail::mpi_type<T>::datatype(), recv.data(), static_cast<int>(n),
                           detail::mpi_type<T>::datatype(), comm_),
             "MPI_Allgather", n);
    }

    /// Block r of recv = block rank() of replica r's send (MPI_Alltoall; blocks of
    /// send.size() / size() elements). requires: send.size() equal on every replica and a
    /// multiple of size(); recv.size() == send.size(); send and recv disjoint (no in-place
    /// form). A block beyond INT_MAX elements is refused with errc::unsupported.
    template <class T>
    void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
        check_type<T>();
        const std::size_t n = send.size();
        const std::size_t block = n / static_cast<std::size_t>(size_);
        const bool ok =
            n % static_cast<std::size_t>(size_) == 0 && recv.size() == n && disjoint(send, recv);
        const bool fits = block <= std::size_t(std::numeric_limits<int>::max());
        begin(detail::mpi_collective::all_to_all, n, detail::mpi_type<T>::id, 0, reduce_op::sum,
              ok && fits);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "send.size() = ", n,
                         ", recv.size() = ", recv.size(), " (requires equal sizes, a multiple of ",
                         size_, ", and disjoint buffers)");
        LOCKSTEP_REQUIRE(fits, errc::unsupported, rank_, name(), "blocks of ", block,
                         " elements exceed MPI's int count; exchange them in pieces");
        call(MPI_Alltoall(send.data(), static_cast<int>(block), detail::mpi_type<T>::datatype(),
                          recv.data(), static_cast<int>(block), detail::mpi_type<T>::datatype(),
                          comm_),
             "MPI_Alltoall", n);
    }

    /// As all_reduce, but only root's recv is written (send == recv at root runs in place);
    /// other replicas' recv is not used. requires: 0 <= root < size(), send.size() equal on
    /// every replica, root's recv.size() == send.size().
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root) {
        check_type<T>();
        const bool at_root = rank_ == root;
        const bool in_place = at_root && send.data() == recv.data();
        const bool ok =
            root >= 0 && root < size_ &&
            (!at_root || (send.size() == recv.size() && (in_place || disjoint(send, recv))));
        begin(detail::mpi_collective::reduce, send.size(), detail::mpi_type<T>::id, root, op, ok);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "root ", root, " of ", size_,
                         ", send.size() = ", send.size(), ", recv.size() = ", recv.size(),
                         " (root's sizes must be equal; buffers identical or disjoint)");
        // MPICH 4.0 and 4.1 crash on MPI_IN_PLACE at a non-zero root (pmodels/mpich#6540,
        // fixed in 4.2): reduce from a copy there.
        std::vector<T> copy;
        const bool pass_in_place = in_place && !(root != 0 && detail::mpi_in_place_reduce_broken);
        if (in_place && !pass_in_place) {
            copy.assign(send.begin(), send.end());
            send = std::span<const T>(copy);
        }
        for_each_chunk(send.size(), [&](std::size_t at, int n) {
            const void* src =
                pass_in_place ? MPI_IN_PLACE : static_cast<const void*>(send.data() + at);
            call(MPI_Reduce(src, at_root ? recv.data() + at : nullptr, n,
                            detail::mpi_type<T>::datatype(), detail::to_mpi_op<T>(op), root, comm_),
                 "MPI_Reduce", send.size());
        });
    }

    /// Returns once every replica has entered it.
    void barrier() {
        begin(detail::mpi_collective::barrier, 0, 0, 0, reduce_op::sum, true);
        // The verification all-reduce already needs every replica's contribution before any
        // replica leaves it, so it is a barrier; MPI_Barrier would be a second one.
        if (!params_.verify)
            call(MPI_Barrier(comm_), "MPI_Barrier", 0);
    }

    /// The replicas with the same color, ranked by (key, rank); same `params` as this one.
    /// requires: color >= 0. Collective over this group.
    mpi_communicator split(int color, int key) {
        begin(detail::mpi_collective::split, 0, 0, 0, reduce_op::sum, color >= 0);
        LOCKSTEP_REQUIRE(color >= 0, errc::invalid_argument, rank_, name(), "color ", color,
                         " is negative");
        MPI_Comm sub = MPI_COMM_NULL;
        call(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", 0);
        return mpi_communicator(sub, params_, node_ranks_);
    }

    /// Sends data to replica dest with tag (blocking, MPI_Send). requires: 0 <= dest < size(),
    /// 0 <= tag <= MPI_TAG_UB, data.size() <= INT_MAX.
    template <class T>
    void send(std::span<T> data, int dest, int tag) {
        using E = std::remove_const_t<T>;
        check_type<E>();
        check_peer(dest, tag, data.size(), "send");
        call_p2p(MPI_Send(data.data(), static_cast<int>(data.size()),
                          detail::mpi_type<E>::datatype(), dest, tag, comm_),
                 "send", "MPI_Send", dest, tag);
    }
    /// Receives the next message from replica source with tag into data. ensures: the
    /// message held exactly data.size() elements, else it is consumed and errc::count_mismatch
    /// is thrown naming both counts.
    template <class T>
    void recv(std::span<T> data, int source, int tag) {
        check_peer(source, tag, data.size(), "recv");
        receive(data, source, tag, "recv");
    }
    /// As recv, from any replica; returns the sender's rank.
    template <class T>
    int recv_any(std::span<T> data, int tag) {
        check_peer(0, tag, data.size(), "recv_any");
        return receive(data, MPI_ANY_SOURCE, tag, "recv_any");
    }

    /// Ends every process of the job (MPI_Abort on MPI_COMM_WORLD, since peers outside this
    /// sub-group may wait for this process too). Use when this replica cannot continue.
    [[noreturn]] void abort(int code = 1) const noexcept {
        MPI_Abort(MPI_COMM_WORLD, code);
        std::abort();
    }
    /// Prints "lockstep: replica R of N aborting: <what>" to stderr, then abort(code).
    [[noreturn]] void abort(const std::exception& e, int code = 1) const noexcept {
        std::fprintf(stderr, "lockstep: replica %d of %d aborting: %s\n", rank_, size_, e.what());
        std::fflush(stderr);
        abort(code);
    }

private:
    // Adopts an MPI communicator made by split (already a fresh communicator: no dup).
    mpi_communicator(MPI_Comm adopted, params p, int node_ranks)
        : comm_(adopted), params_(p), node_ranks_(node_ranks) {
        try {
            setup();
        } catch (...) {
            release();
            throw;
        }
    }

    void setup() {
        LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
        LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
        LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
        int* tag_ub = nullptr;
        int found = 0;
        LOCKSTEP_MPI_CHECK(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found));
        tag_ub_ = found && tag_ub != nullptr ? *tag_ub : 32767; // 32767: the standard's minimum
    }

    void take(mpi_communicator& o) noexcept {
        comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
        params_ = o.params_;
        rank_ = o.rank_;
        size_ = o.size_;
        node_ranks_ = o.node_ranks_;
        tag_ub_ = o.tag_ub_;
        seq_ = o.seq_;
        kind_ = o.kind_;
    }
    void release() noexcept {
        if (comm_ == MPI_COMM_NULL)
            return;
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized)
            MPI_Comm_free(&comm_);
        comm_ = MPI_COMM_NULL;
    }

    template <class T>
    static constexpr void check_type() {
        static_assert(detail::is_mpi_element<T>,
                      "mpi_communicator carries float, double, int, std::int64_t and "
                      "std::uint8_t elements; convert other types to one of these first.");
    }
    template <class A, class B>
    static bool disjoint(std::span<A> a, std::span<B> b) noexcept {
        const auto a0 = reinterpret_cast<std::uintptr_t>(a.data()), a1 = a0 + a.size_bytes();
        const auto b0 = reinterpret_cast<std::uintptr_t>(b.data()), b1 = b0 + b.size_bytes();
        return a1 <= b0 || b1 <= a0;
    }
    // Calls f(offset, count) over [0, n) in pieces MPI's int counts can describe (once for 0).
    template <class F>
    static void for_each_chunk(std::size_t n, F&& f) {
        constexpr std::size_t max_chunk = std::numeric_limits<int>::max();
        std::size_t at = 0;
        do {
            const std::size_t c = std::min(n - at, max_chunk);
            f(at, static_cast<int>(c));
            at += c;
        } while (at < n);
    }

    // "all_reduce #12": the collective in progress and its sequence number.
    std::string name() const { return detail::mpi_operation_name(kind_, seq_); }

    // Starts collective number seq_ + 1; with verification, exchanges the signature and throws
    // on every replica when they disagree. A replica whose own arguments failed (ok == false)
    // returns so that the caller throws its precise error; the others throw peer_failure.
    void begin(detail::mpi_collective kind, std::size_t count, std::int64_t type, int root,
               reduce_op op, bool ok) {
        LOCKSTEP_REQUIRE(comm_ != MPI_COMM_NULL, errc::invalid_argument, rank_,
                         std::string(detail::to_string(kind)), "the communicator was moved from");
        ++seq_;
        kind_ = kind;
        if (!params_.verify)
            return;
        using f = detail::mpi_signature;
        f mine;
        mine.value = {static_cast<std::int64_t>(kind),
                      seq_,
                      static_cast<std::int64_t>(count),
                      type,
                      root,
                      static_cast<std::int64_t>(op),
                      ok ? 1 : 0};
        detail::mpi_signature_range r;
        call(detail::mpi_signature_range_exchange(mine, comm_, r), "MPI_Allreduce (verify)", count);
        if (ok)
            detail::require_agreement(mine, r, rank_);
    }

    void call(int rc, const char* mpi_call, std::size_t count) const {
        if (rc != MPI_SUCCESS)
            fail(errc::mpi, rank_, name(), mpi_call, " failed: ", detail::mpi_error_text(rc),
                 " (count ", count, ", group of ", size_, ")");
    }
    void call_p2p(int rc, const char* op, const char* mpi_call, int peer, int tag) const {
        if (rc != MPI_SUCCESS)
            fail(errc::mpi, rank_, op, mpi_call, " with replica ", peer, ", tag ", tag,
                 " failed: ", detail::mpi_error_text(rc));
    }
    void check_peer(int peer, int tag, std::size_t count, const char* op) const {
        LOCKSTEP_REQUIRE(comm_ != MPI_COMM_NULL, errc::invalid_argument, rank_, op,
                         "the communicator was moved from");
        LOCKSTEP_REQUIRE(peer >= 0 && peer < size_, errc::invalid_argument, rank_, op, "replica ",
                         peer, " is not in this group of ", size_);
        LOCKSTEP_REQUIRE(tag >= 0 && tag <= tag_ub_, errc::invalid_argument, rank_, op, "tag ", tag,
                         " is outside [0, ", tag_ub_, "]");
        LOCKSTEP_REQUIRE(count <= std::size_t(std::numeric_limits<int>::max()), errc::unsupported,
                         rank_, op, count, " elements exceed MPI's int count; send it in pieces");
    }

    // Matched probe (thread-safe), then receive; a message of the wrong size is consumed and
    // reported, so the next receive does not match it again.
    template <class T>
    int receive(std::span<T> data, int source, int tag, const char* op) {
        check_type<T>();
        MPI_Message msg = MPI_MESSAGE_NULL;
        MPI_Status st;
        call_p2p(MPI_Mprobe(source, tag, comm_, &msg, &st), op, "MPI_Mprobe", source, tag);
        int count = 0;
        call_p2p(MPI_Get_count(&st, detail::mpi_type<T>::datatype(), &count), op, "MPI_Get_count",
                 st.MPI_SOURCE, tag);
        if (count == MPI_UNDEFINED || static_cast<std::size_t>(count) != data.size()) {
            int bytes = 0;
            call_p2p(MPI_Get_count(&st, MPI_BYTE, &bytes), op, "MPI_Get_count", st.MPI_SOURCE, tag);
            std::vector<unsigned char> discard(static_cast<std::size_t>(bytes));
            call_p2p(MPI_Mrecv(discard.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE), op,
                     "MPI_Mrecv", st.MPI_SOURCE, tag);
            fail(errc::count_mismatch, rank_, op, "the message from replica ", st.MPI_SOURCE,
                 " with tag ", tag, " holds ", bytes, " bytes (",
                 count == MPI_UNDEFINED ? std::string("not a whole number of")
                                        : std::to_string(count),
                 " ", detail::mpi_type<T>::name, " elements) but the receive buffer holds ",
                 data.size(), "; the message was discarded");
        }
        call_p2p(MPI_Mrecv(data.data(), count, detail::mpi_type<T>::datatype(), &msg, &st), op,
                 "MPI_Mrecv", st.MPI_SOURCE, tag);
        return st.MPI_SOURCE;
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    params params_{};
    int rank_ = -1;
    int size_ = 0;
    int node_ranks_ = 1;
    int tag_ub_ = 32767;
    std::int64_t seq_ = 0;
    detail::mpi_collective kind_ = detail::mpi_collective::none;
};

static_assert(communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::communicator (comm/communicator.hpp).");
static_assert(point_to_point_communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::point_to_point_communicator.");
static_assert(all_to_all_communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::all_to_all_communicator.");

} // namespace lockstep

// lockstep/comm/mpi_communicator.hpp: mpi_communicator, one replica per process over an MPI_Comm
// (and mpi_environment, which starts MPI). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/mpi_float16.hpp"
#include "lockstep/comm/detail/mpi_handle.hpp"
#include "lockstep/comm/detail/mpi_messages.hpp"
#include "lockstep/comm/detail/mpi_reduce_scatter.hpp"
#include "lockstep/comm/detail/mpi_signature.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/detail/split_label.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

namespace lockstep {

/// A communicator whose replicas are the processes of an MPI communicator (one replica per
/// process, within a node or across nodes). Models lockstep::communicator,
/// lockstep::point_to_point_communicator, lockstep::all_to_all_communicator and
/// lockstep::all_to_all_others_communicator. Element types:
/// float, double, int, std::int64_t, std::uint8_t, lockstep::half and lockstep::bfloat16. The
/// 16-bit floats are reduced by lockstep, not by an MPI_Op: an exchange of their slices, a fold
/// in rank order in float rounded once, and a gather (detail/mpi_float16.hpp), so every replica
/// gets round16(the float fold in rank order), the thread group's bits. Collectives follow MPI's
/// rules: every replica calls them in the same order, from one thread at a time (the thread level
/// of mpi_environment must allow that thread).
///
/// Verification (params::verify, default on): before each collective the replicas exchange a
/// signature {collective, sequence number, count, element type, root, reduce_op, arguments ok,
/// a hash of reduce_scatter's per-rank counts, the collective_tag's id} in one MPI_Iallreduce of
/// 18 int64 (MPI_MAX over {v, -v} gives min and max at once). Replicas that disagree throw
/// lockstep::error on every replica (errc::count_mismatch for counts) naming the collective, its
/// sequence number and the min/max values; when the collectives or tags differ (a call swapped,
/// skipped or added on some replica) every replica then all-gathers each replica's call, so the
/// error names them all ("replica 0 called all_gather #7 (4 float), replica 1 called all_reduce
/// #7 (4 float, sum)"), before any data moves. Every data collective takes an optional
/// collective_tag: two calls of the same collective and shape in another order (or one skipped)
/// are told apart by a tag name, or by the call site when params::check_call_sites is on
/// ("all_reduce #7 (4 float, sum, at train.cpp:42)"), and pair silently otherwise; a replica whose
/// own arguments are invalid throws its own error and the others get errc::peer_failure instead of
/// waiting. Cost: one extra 144-byte all-reduce per collective. Measured on the polled nonblocking
/// calls below with `env OMP_NUM_THREADS=1 mpiexec -n 2 build/bench/bench/bench_allreduce`
/// (bench/allreduce.cpp, `bench` preset; raw MPI_Allreduce, plain and verifying lockstep
/// interleaved in each run), 2 ranks on one 2-core node shared with other work (1-minute load
/// 0.3-3.8), MPICH 4.0.2, the median of 5 runs: verification adds 1.5-2.2 us per collective up to
/// 64 KiB, i.e. 2.3x raw MPI at 4 B (3.3 us against 1.4 us), 1.25x at 16 KiB, 1.05x at 64
/// KiB, 1.03x at 256 KiB, 1.01x at 1 MiB. Without it lockstep took 1.25x raw MPI's time at 4 B,
/// 0.87-0.92x from 16 B to 1 KiB, 1.07-1.13x at 4 and 16 KiB, 1.00-1.01x from 64 KiB to 1 MiB
/// and 1.12x at 256 MiB (1.06-1.20x over the runs); from 4 to 64 MiB the runs varied more than the
/// variants differed. Turn it off ({.verify = false}) for many tiny collectives once a program is
/// known to be consistent. Every replica must use the same `verify` (and, with it, the same
/// `check_call_sites`): the constructor compares them and throws errc::invalid_argument on every
/// replica when they differ. Without verification, mismatched counts are MPI's undefined
/// behaviour (truncation errors, garbage or a hang).
///
/// Arguments: a null span with a non-zero count, a span larger than memory can hold, sizes
/// that do not fit together or a count MPI cannot describe are refused with lockstep::error
/// (errc::invalid_argument or errc::unsupported) before any data moves. With verification the
/// other replicas get errc::peer_failure from the same call instead of waiting; without it they
/// are not told (they time out). The communicator stays usable after such an error.
///
/// Timeouts: every MPI operation (collectives, the signature exchange, send, recv) is a
/// nonblocking call polled with MPI_Test against params::timeout (split: the replicas' arrival is
/// polled, by the signature exchange or an MPI_Ibarrier, then the blocking MPI_Comm_split runs)
/// (default LOCKSTEP_TIMEOUT seconds, else 300 s) from its start. The polling spins for about 20
/// us, then sleeps between tests (10 us growing to 100 us), so a long wait does not take a core
/// from the compute threads. Large operations spin longer (about 1 ns per byte, at most 20 ms): MPI
/// moves data only inside MPI calls (shared-memory copies go in pieces), so sleeping while a
/// transfer is under way would stretch it. On a timeout the replica asks every peer where it is (a
/// census on a private duplicate communicator; peers that wait in any operation of this
/// communicator answer within ~100 us, peers that compute, exited or finalised stay silent) and
/// fails with errc::timeout: "all_reduce #12: timed out after 2000 ms in MPI_Iallreduce; missing
/// replica(s) 2
/// (...)". An MPI call that fails inside an operation fails with errc::mpi naming the call. Either
/// way the communicator is broken: every later call throws at once with the first failure's code
/// and message. Then, by params::on_failure, it prints the error and ends the job with MPI_Abort
/// (the default: no replica is left waiting) or throws it (the caller must end the job, e.g.
/// with abort(e): MPI cannot cancel the collective the peers are in, so MPI_Finalize may hang).
/// The timed-out request stays outstanding: MPI may still complete it when the peers arrive,
/// reading the caller's send spans and writing its recv spans (and data) of the failed call. With
/// throw_error the caller must therefore keep those buffers allocated and leave them alone until
/// the job ends, even after the communicator is destroyed; the library keeps its own buffers
/// of that request (the signature, copies, the scratch) allocated for good.
/// A replica that leaves early (returns from main, finalises MPI) or calls one collective too
/// many is therefore an error on the others within the timeout.
///
/// Flight recorder: every collective is recorded in trace() (comm/flight_recorder.hpp); a
/// timeout or a disagreement found by verification writes it (stderr, and LOCKSTEP_TRACE_DIR),
/// before on_failure acts, and the error message ends with "[flight recorder: <file>]".
///
/// Failure elsewhere: a replica that throws from its own code and will not call the next
/// collective should call `abort(e)` (it prints the error and calls MPI_Abort on
/// MPI_COMM_WORLD); otherwise its peers fail only when their timeout passes. A replica that
/// calls exit() while a communicator lives aborts the job the same way (see mpi_environment).
///
/// What every operation stands on (the owned communicators, verification, waits, failure
/// state and flight recorder) is detail::mpi_handle (comm/detail/mpi_handle.hpp); the
/// point-to-point messages are its base detail::mpi_messages (comm/detail/mpi_messages.hpp),
/// all_to_all and all_to_all_others the base detail::mpi_all_to_all
/// (comm/detail/mpi_all_to_all.hpp), and reduce_scatter and the 16-bit reductions the base
/// detail::mpi_reduce_scatter (comm/detail/mpi_reduce_scatter.hpp).
class mpi_communicator : public detail::mpi_reduce_scatter {
public:
    using system_type = host_system;
    using params = mpi_communicator_params;

    /// requires: MPI initialised (mpi_environment), comm a valid intra-communicator, p.timeout
    /// > 0. Collective over comm. ensures: owns two duplicates of comm with MPI_ERRORS_RETURN
    /// (one for the operations, one for the census of a timed-out replica), so MPI failures
    /// become lockstep::error (errc::mpi) instead of aborting. A process of comm that does not
    /// construct its communicator within p.timeout makes this fail with errc::timeout (by
    /// p.on_failure: abort, or throw).
    explicit mpi_communicator(MPI_Comm comm, params p = {}) : mpi_reduce_scatter(comm, p) {}

    /// recv[i] = op over replicas of send[i]. send == recv runs in place (MPI_IN_PLACE). A
    /// buffer of more than 4 MiB runs as 2 MiB pieces, one MPI_Iallreduce each
    /// (all_reduce_piece_bytes: 2x faster than one call at 64 MiB on local ranks).
    /// requires: send.size() == recv.size(), equal on every replica; send and recv identical
    /// or disjoint; non-null unless empty.
    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                    collective_tag tag = {}) {
        check_type<T>();
        const bool in_place = send.data() == recv.data();
        const std::string bad = detail::join_problems(
            {detail::span_problem(send, "send"), detail::span_problem(recv, "recv")});
        const bool ok =
            bad.empty() && send.size() == recv.size() && (in_place || disjoint(send, recv));
        const auto traced = begin(detail::mpi_collective::all_reduce, send.size(),
                                  detail::mpi_type<T>::id, 0, op, ok, {}, tag);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), bad.empty() ? "" : bad + ": ",
                         "send.size() = ", send.size(), ", recv.size() = ", recv.size(),
                         " (sizes must be equal; buffers identical or disjoint)");
        if constexpr (is_wire_float16_v<T>) {
            all_reduce16(send.data(), recv.data(), recv.size(), op);
            return;
        }
        // Long buffers as pieces (all_reduce_piece_bytes): the same cut on every replica.
        for_each_chunk(recv.size(), all_reduce_piece<T>(recv.size()), [&](std::size_t at, int n) {
            MPI_Request req = MPI_REQUEST_NULL;
            call(MPI_Iallreduce(in_place ? MPI_IN_PLACE : send.data() + at, recv.data() + at, n,
                                detail::mpi_type<T>::datatype(), detail::to_mpi_op<T>(op), comm_,
                                &req),
                 "MPI_Iallreduce", recv.size());
            finish(req, "MPI_Iallreduce", recv.size(), std::size_t(n) * sizeof(T));
        });
    }

    /// data on every replica becomes root's data. requires: 0 <= root < size(), data.size()
    /// equal on every replica, data non-null unless empty.
    template <class T>
    void broadcast(std::span<T> data, int root, collective_tag tag = {}) {
        check_type<T>();
        const std::string bad = detail::span_problem(data, "data");
        const bool ok = bad.empty() && root >= 0 && root < size_;
        const auto traced = begin(detail::mpi_collective::broadcast, data.size(),
                                  detail::mpi_type<T>::id, root, reduce_op::sum, ok, {}, tag);
        LOCKSTEP_REQUIRE(bad.empty(), errc::invalid_argument, rank_, name(), bad);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "root ", root,
                         " is not a replica of this group of ", size_);
        for_each_chunk(data.size(), [&](std::size_t at, int n) {
            MPI_Request req = MPI_REQUEST_NULL;
            call(
                MPI_Ibcast(data.data() + at, n, detail::mpi_type<T>::datatype(), root, comm_, &req),
                "MPI_Ibcast", data.size());
            finish(req, "MPI_Ibcast", data.size(), std::size_t(n) * sizeof(T));
        });
    }

    /// recv = every replica's send, concatenated in rank order. send may be this replica's
    /// slot of recv (in place). requires: recv.size() == size() * send.size(), send.size()
    /// equal on every replica and <= INT_MAX (else errc::unsupported); spans non-null unless
    /// empty.
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    collective_tag tag = {}) {
        check_type<T>();
        const std::size_t n = send.size();
        const std::string bad = detail::join_problems(
            {detail::span_problem(send, "send"), detail::span_problem(recv, "recv")});
        std::size_t total = 0;
        const bool no_overflow = !mul_overflows(static_cast<std::size_t>(size_), n, &total);
        const bool fits = n <= std::size_t(std::numeric_limits<int>::max());
        const bool in_place = bad.empty() && no_overflow && n != 0 &&
                              send.data() == recv.data() + static_cast<std::size_t>(rank_) * n;
        const bool ok = bad.empty() && no_overflow && recv.size() == total && fits &&
                        (in_place || disjoint(send, recv));
        const auto traced = begin(detail::mpi_collective::all_gather, n, detail::mpi_type<T>::id, 0,
                                  reduce_op::sum, ok, {}, tag);
        LOCKSTEP_REQUIRE(bad.empty(), errc::invalid_argument, rank_, name(), bad);
        LOCKSTEP_REQUIRE(fits, errc::unsupported, rank_, name(), "send.size() = ", n,
                         " exceeds MPI's int count (", std::numeric_limits<int>::max(),
                         "); gather it in pieces");
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "send.size() = ", n,
                         ", recv.size() = ", recv.size(), " (requires recv.size() == ", size_,
                         " * send.size(); send disjoint from recv or its own slot)");
        MPI_Request req = MPI_REQUEST_NULL;
        call(MPI_Iallgather(in_place ? MPI_IN_PLACE : send.data(), static_cast<int>(n),
                            detail::mpi_type<T>::datatype(), recv.data(), static_cast<int>(n),
                            detail::mpi_type<T>::datatype(), comm_, &req),
             "MPI_Iallgather", n);
        finish(req, "MPI_Iallgather", n, recv.size_bytes());
    }

    /// As all_reduce, but only root's recv is written (send == recv at root runs in place);
    /// other replicas' recv is not used. requires: 0 <= root < size(), send.size() equal on
    /// every replica, root's recv.size() == send.size(); spans non-null unless empty.
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root, collective_tag tag = {}) {
        check_type<T>();
        const bool at_root = rank_ == root;
        const bool in_place = at_root && send.data() == recv.data();
        const std::string bad =
            detail::join_problems({detail::span_problem(send, "send"),
                                   at_root ? detail::span_problem(recv, "recv") : std::string()});
        const bool ok =
            bad.empty() && root >= 0 && root < size_ &&
            (!at_root || (send.size() == recv.size() && (in_place || disjoint(send, recv))));
        const auto traced = begin(detail::mpi_collective::reduce, send.size(),
                                  detail::mpi_type<T>::id, root, op, ok, {}, tag);
        LOCKSTEP_REQUIRE(bad.empty(), errc::invalid_argument, rank_, name(), bad);
        LOCKSTEP_REQUIRE(ok, errc::invalid_argument, rank_, name(), "root ", root, " of ", size_,
                         ", send.size() = ", send.size(), ", recv.size() = ", recv.size(),
                         " (root's sizes must be equal; buffers identical or disjoint)");
        if constexpr (is_wire_float16_v<T>) {
            reduce16(send.data(), at_root ? recv.data() : nullptr, send.size(), op, root);
            return;
        }
        // MPICH 4.0 and 4.1 crash on MPI_IN_PLACE at a non-zero root (pmodels/mpich#6540,
        // fixed in 4.2): reduce from a copy there.
        const bool pass_in_place = in_place && !(root != 0 && detail::mpi_in_place_reduce_broken);
        const auto copy = buffer<T>(in_place && !pass_in_place ? send.size() : 0);
        if (in_place && !pass_in_place) {
            std::copy(send.begin(), send.end(), copy.data());
            send = std::span<const T>(copy.span());
        }
        for_each_chunk(send.size(), [&](std::size_t at, int n) {
            const void* src =
                pass_in_place ? MPI_IN_PLACE : static_cast<const void*>(send.data() + at);
            MPI_Request req = MPI_REQUEST_NULL;
            call(MPI_Ireduce(src, at_root ? recv.data() + at : nullptr, n,
                             detail::mpi_type<T>::datatype(), detail::to_mpi_op<T>(op), root, comm_,
                             &req),
                 "MPI_Ireduce", send.size());
            finish(req, "MPI_Ireduce", send.size(), std::size_t(n) * sizeof(T));
        });
    }

    /// Returns once every replica has entered it.
    void barrier(collective_tag tag = {}) {
        const auto traced =
            begin(detail::mpi_collective::barrier, 0, 0, 0, reduce_op::sum, true, {}, tag);
        // The verification all-reduce already needs every replica's contribution before any
        // replica leaves it, so it is a barrier; MPI_Ibarrier would be a second one.
        if (!params_.verify)
            ibarrier("MPI_Ibarrier");
    }

    /// The replicas with the same color, ranked by (key, rank); same `params` as this one.
    /// requires: color >= 0. Collective over this group.
    mpi_communicator split(int color, int key) {
        const auto traced =
            begin(detail::mpi_collective::split, 0, 0, 0, reduce_op::sum, color >= 0);
        LOCKSTEP_REQUIRE(color >= 0, errc::invalid_argument, rank_, name(), "color ", color,
                         " is negative");
        // MPI has no nonblocking split: make sure every replica has arrived first (the
        // verification exchange already did), so the blocking call cannot wait for long.
        if (!params_.verify)
            ibarrier("MPI_Ibarrier (before MPI_Comm_split)");
        MPI_Comm sub = MPI_COMM_NULL;
        call(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", 0);
        mpi_communicator child(sub, params_, node_ranks_);
        child.label_ = detail::split_label(label_, color);
        return child;
    }

    /// A second handle on the same MPI communicator for point-to-point messages (send, recv,
    /// recv_any, probe) from another thread: messages sent on either handle match receives on
    /// the other and on the peers' handles. It does not own the MPI communicator and has no
    /// census channel (its timeouts name the missing peer without asking where it is).
    /// requires: MPI_THREAD_MULTIPLE when the handles are used by different threads at once;
    /// no two threads send to one replica with one tag at once, or receive from one replica
    /// (or any) with one tag at once (a send is two MPI messages, header and data, that such
    /// threads could interleave);
    /// the MPI communicator lives (this handle, or the one it moved into, is not destroyed)
    /// while the view is used; collectives stay on this handle (the view keeps its own
    /// sequence numbers, so collectives on both would not match).
    mpi_communicator message_view() const {
        require_usable("message_view");
        mpi_communicator v;
        v.comm_ = comm_;
        v.owns_ = false;
        v.params_ = params_;
        v.rank_ = rank_;
        v.size_ = size_;
        v.node_ranks_ = node_ranks_;
        v.label_ = label_;
        v.tag_ub_ = tag_ub_;
        return v;
    }

    /// This object's communicator_identity (identified_communicator): what caches of state
    /// derived from the communicator are keyed by.
    std::uint64_t identity() const noexcept { return identity_.value(); }

private:
    // An empty handle (message_view fills it in).
    mpi_communicator() = default;
    // Adopts an MPI communicator made by split (already a fresh communicator: no dup).
    mpi_communicator(MPI_Comm adopted, params p, int node_ranks)
        : mpi_reduce_scatter(adopted, p, node_ranks) {}

    /// all_reduce cuts a buffer of more than 2 pieces into pieces of this many bytes, one
    /// MPI_Iallreduce each, so that a piece and MPI's own buffers stay in cache. Raw
    /// MPI_Iallreduce of floats on 2 local ranks (MPICH 4.0, medians of 7): 16 MiB in one call
    /// 7.24 ms, in 1, 2, 4 and 8 MiB pieces 6.08, 6.20, 6.40 and 7.47 ms; 64 MiB 48.6 ms against
    /// 19.8, 18.8, 19.6 and 22.0; 256 MiB 153.5 against 73.3, 78.8, 80.1 and 94.7.
    static constexpr std::size_t all_reduce_piece_bytes = std::size_t(2) << 20;
    /// The elements per all_reduce piece for n elements of T (n itself up to 2 pieces).
    template <class T>
    static std::size_t all_reduce_piece(std::size_t n) noexcept {
        const std::size_t piece = std::max<std::size_t>(1, all_reduce_piece_bytes / sizeof(T));
        return n * sizeof(T) > 2 * all_reduce_piece_bytes ? piece : n;
    }

    communicator_identity identity_;
};

static_assert(communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::communicator (comm/communicator.hpp).");
static_assert(point_to_point_communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::point_to_point_communicator.");
static_assert(all_to_all_communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::all_to_all_communicator.");
static_assert(all_to_all_others_communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::all_to_all_others_communicator.");
static_assert(named_timeout_communicator<mpi_communicator>,
              "mpi_communicator must model lockstep::named_timeout_communicator.");

} // namespace lockstep

// lockstep/comm/nccl_communicator.hpp: nccl_communicator, the communicator of GPU replicas
// (NCCL collectives enqueued on each replica's stream). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"

// NCCL needs the CUDA system, hence nvcc; elsewhere this header declares nothing.
#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/nccl_bootstrap.hpp"
#include "lockstep/comm/detail/nccl_handle.hpp"
#include "lockstep/comm/detail/nccl_membership.hpp"
#include "lockstep/comm/detail/nccl_shrink.hpp"
#include "lockstep/comm/detail/nccl_types.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/detail/stream_gap_timer.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nccl.h>
// A replica drives two communicators at once (its own on the compute stream, a split on the
// comm_stream's side stream); NCCL orders their kernels on one device only from 2.26 on
// (NCCL_LAUNCH_ORDER_IMPLICIT, see detail::use_implicit_launch_order): before, two
// communicators active on one GPU can deadlock.
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 26, 0)
#error "lockstep's nccl_communicator needs NCCL 2.26 or newer (NCCL_LAUNCH_ORDER_IMPLICIT)."
#endif
#if LOCKSTEP_HAS_MPI
#include <mpi.h>
#endif

namespace lockstep {

/// A communicator of GPU replicas over NCCL; models lockstep::communicator and
/// lockstep::all_to_all_communicator with
/// system_type = cuda_system (spans are device memory of device()).
///
/// Creation:
/// - one process, several GPUs: lockstep::gpu_group (comm/gpu_group.hpp) runs one host thread
///   per device; underneath, `auto comms = nccl_communicator::init_all(devices);` gives one
///   communicator per device (rank i drives devices[i]).
/// - one process per GPU under MPI (any number of nodes):
///   `nccl_communicator comm(MPI_COMM_WORLD, nccl_communicator::local_device(MPI_COMM_WORLD));`
///   (the NCCL unique id travels by MPI_Bcast).
/// - any other bootstrap: the (ncclUniqueId, size, rank, device) constructor.
/// Every way refuses an NCCL library older than 2.26 loaded at run time (errc::unsupported,
/// naming it and the headers' version; detail::loaded_nccl_problem).
///
/// Streams: every way of creation either creates the communicator's own non-blocking stream
/// (the default) or ADOPTS a stream of the caller (one per device for init_all): collectives
/// are then ordered with the caller's kernels on that stream, and the stream is neither owned
/// nor destroyed (it must outlive the communicator). system() runs on that stream. An adopted
/// stream must belong to the communicator's device; another device's stream is refused with
/// errc::invalid_argument before NCCL is entered (checked with cudaStreamGetDevice on CUDA
/// 12.8 and newer). The legacy default stream (null) cannot be adopted: null asks for an own
/// stream.
///
/// A replica may have two communicators active at once (its own and a split, e.g. the
/// comm_stream's on a side stream): a program that includes this header sets
/// NCCL_LAUNCH_ORDER_IMPLICIT=1 during its static initialisation, before main, unless the
/// environment sets it (detail::use_implicit_launch_order, NCCL 2.26 or newer), so their kernels
/// launch in the order the host issued them. The setting is process-wide (NCCL has no
/// per-communicator field for it): the program's own NCCL communicators are ordered the same
/// way; NCCL_LAUNCH_ORDER_IMPLICIT=0 in the environment keeps NCCL's default, at the risk of the
/// deadlock above.
///
/// Element types: nccl_element (detail/nccl_types.hpp), the 16-bit floats included: half and
/// bfloat16 (lockstep's or CUDA's) are reduced by NCCL natively, in NCCL's order (ring or tree)
/// and precision (its sum kernels round to 16 bits after each addition: error up to about
/// (size() - 1) * u * sum |x|), not in lockstep's rank order; max and min are exact. Its ring
/// and tree algorithms fold each element once and copy the result to every rank, so the
/// replicas get the same bits in practice; NCCL does not document that as a guarantee.
///
/// Driving the replicas: collectives only ENQUEUE work on the replica's stream (system()) and
/// return; NCCL completes them when every replica has enqueued its part. The supported pattern
/// is one host thread per replica (std::thread or a thread pool), each calling the collectives
/// of its own communicator in the same order as the others. One thread may drive several
/// replicas only inside an nccl_group (ncclGroupStart/End), because a blocking call (barrier,
/// synchronize, split) on one replica waits for the others.
///
/// Failures never leave peers hanging: a replica whose call fails aborts its communicator
/// (ncclCommAbort) together with every other communicator of its family (the one it was created
/// with and all splits made from it, in one NCCL group: none is left running a collective that
/// waits for the dead peer) and marks its clique failed (with nccl_options::survivors set and
/// shrink_problem() empty it revokes them instead, for shrink()); peers created in the same process
/// (init_all and splits of those) see the mark in their next call or while they wait in
/// synchronize() or barrier() or wait(), abort too and throw errc::peer_failure. Across processes,
/// the waits poll ncclCommGetAsyncError (NCCL reports a vanished peer as ncclRemoteError) and give
/// up after nccl_options::timeout. NCCL itself cannot check that replicas pass equal counts:
/// unequal counts are undefined behaviour in NCCL (usually a hang until the timeout).
///
/// Not provided: an any-source receive (NCCL has none), so nccl_communicator does NOT model
/// point_to_point_communicator and asynchronous (parameter server) training cannot use it.
/// send/recv between two known ranks exist. A communicator is used by one thread at a time.
/// Spans must be memory of device() (or managed memory): host memory is rejected with
/// errc::invalid_argument before NCCL sees it.
class nccl_communicator {
    struct adopt_tag {};

public:
    using system_type = cuda_system;

    /// One communicator per device of `devices` (ncclCommInitAll), rank i on devices[i]; rank i
    /// adopts streams[i], or, when `streams` is empty, creates its own non-blocking stream.
    /// requires: devices non-empty, distinct, each in [0, cuda_device_count()); streams empty
    /// or one non-null stream per device, streams[i] a stream of devices[i].
    static std::vector<nccl_communicator> init_all(std::span<const int> devices,
                                                   nccl_options options = {},
                                                   std::span<const cudaStream_t> streams = {}) {
        return detail::nccl_init_all<nccl_communicator>(
            devices, streams,
            [&options](ncclComm_t raw, int device, cudaStream_t stream,
                       std::shared_ptr<detail::nccl_clique> clique) {
                return nccl_communicator(adopt_tag{}, raw, device, {.adopted = stream},
                                         std::move(clique), nullptr, options);
            });
    }

    /// Joins communicator `id` as `rank` of `size`, driving `device` (ncclCommInitRank; blocks
    /// until all `size` ranks have joined, at most options.timeout: then errc::timeout, the call
    /// left to a helper thread, as a split's), on the adopted `stream` or (null) its own.
    /// requires: 0 <= rank < size, the same id on every rank, device in
    /// [0, cuda_device_count()), stream null or a stream of `device`.
    /// ensures: `device` is the calling thread's current CUDA device (the replica's kernels go
    /// there).
    nccl_communicator(const ncclUniqueId& id, int size, int rank, int device,
                      nccl_options options = {}, cudaStream_t stream = nullptr)
        : nccl_communicator(adopt_tag{},
                            detail::nccl_init_rank(id, size, rank, device, stream, options.timeout),
                            device, {.adopted = stream}, std::make_shared<detail::nccl_clique>(),
                            nullptr, options) {}

#if LOCKSTEP_HAS_MPI
    /// One process per GPU: every process of `comm` calls this collectively with its own
    /// device (see local_device()) and, optionally, a stream of that device to adopt (null: the
    /// communicator creates its own). Rank and size are those of `comm`; rank 0 creates the
    /// NCCL id and broadcasts it. A process whose device or stream is unusable makes EVERY
    /// process throw (the check is agreed before NCCL is entered, so nobody hangs: the others
    /// get errc::peer_failure naming it). The agreement and the broadcast are polled
    /// mpi_communicator collectives within options.timeout (errc::timeout naming the missing
    /// processes when one does not call this; with a timeout of 0 they wait forever). ensures:
    /// `device` is the calling thread's current CUDA device (the replica's kernels go there, and no
    /// context is made on another GPU).
    nccl_communicator(MPI_Comm comm, int device, nccl_options options = {},
                      cudaStream_t stream = nullptr)
        : nccl_communicator(
              adopt_tag{}, detail::nccl_init_mpi(comm, device, stream, options.timeout), device,
              {.adopted = stream}, std::make_shared<detail::nccl_clique>(), nullptr, options) {}

    /// The device this process should drive: its rank among the processes of `comm` on the
    /// same node, modulo the node's device count. requires: a CUDA device exists.
    static int local_device(MPI_Comm comm) {
        return detail::nccl_local_device(comm);
    }
#endif

    nccl_communicator(const nccl_communicator&) = delete;
    nccl_communicator& operator=(const nccl_communicator&) = delete;
    nccl_communicator(nccl_communicator&&) noexcept = default;
    nccl_communicator& operator=(nccl_communicator&&) noexcept = default;
    /// Destroys the NCCL communicator: once its stream is idle (polled with the checks and the
    /// timeout of synchronize(); on a failure or the timeout it is aborted instead), or at once
    /// by ncclCommAbort when a replica of the clique failed, so the destructor never waits for
    /// a peer that will not come. One thread destroying several ranks of one communicator
    /// (init_all's) uses destroy_all().
    ~nccl_communicator() = default;

    /// Destroys every communicator of `comms` (ranks that one thread owns, as init_all's): each
    /// stream drained as in the destructor, then ncclCommFinalize for all of them inside one
    /// NCCL group, then ncclCommDestroy (local after the finalize); one by one, the first rank's
    /// destroy would wait for the others.
    /// After a failure (an aborted communicator, a failed clique) all of them, and the splits of
    /// their families, are aborted instead, in one group. Returns the first drain's failure (e.g.
    /// errc::timeout: a collective that some rank enqueued and the others never matched), else
    /// null. ensures: comms is empty.
    static std::exception_ptr destroy_all(std::vector<nccl_communicator>& comms) noexcept {
        const auto broken = [](const auto& c) {
            return c.h_.aborted() || (c.h_.clique() && c.h_.clique()->failed_rank.load() >= 0);
        };
        // Each stream drained first, within the timeout (a drain that fails aborts).
        std::exception_ptr drained;
        if (!std::any_of(comms.begin(), comms.end(), broken))
            for (auto& c : comms)
                if ((drained = c.h_.drain()))
                    break;
        const bool failed = std::any_of(comms.begin(), comms.end(), broken);
        const bool grouped = ncclGroupStart() == ncclSuccess;
        for (auto& c : comms)
            if (failed)
                c.abort(); // every rank's family in one group: no abort waits for another's kernel
            else
                (void)c.h_.finalize();
        const bool ended = !grouped || ncclGroupEnd() == ncclSuccess;
        if (!failed && !ended) {
            const bool regrouped = ncclGroupStart() == ncclSuccess;
            for (auto& c : comms)
                c.abort();
            if (regrouped)
                (void)ncclGroupEnd();
        }
        comms.clear();
        return drained;
    }

    /// This replica's rank in [0, size()).
    int rank() const noexcept {
        return h_.rank();
    }
    /// The number of replicas.
    int size() const noexcept {
        return h_.size();
    }
    /// The CUDA device this replica drives.
    int device() const noexcept {
        return h_.device();
    }
    /// The replica's system: device() and the communicator's stream (its own, or the adopted
    /// one). Buffers allocated through it are freed on that stream, so destroy them before the
    /// communicator (before the adopted stream, too).
    cuda_system system() const noexcept {
        return h_.system();
    }
    /// True when the communicator runs on a caller's stream it adopted (and will not destroy).
    bool adopted_stream() const noexcept {
        return h_.adopted_stream();
    }
    /// The options the communicator was made with (its timeout).
    const nccl_options& options() const noexcept {
        return h_.options();
    }
    /// The NCCL handle (null once aborted or moved from).
    ncclComm_t native_handle() const noexcept {
        return h_.comm();
    }
    /// True once this communicator was aborted or revoked (after a failure); every later call
    /// throws (but shrink(), once revoked).
    bool aborted() const noexcept {
        return h_.aborted() || h_.revoked();
    }

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

    /// The sub-group of replicas passing the same color, ranked by (key, rank), as a new
    /// communicator on the same device and on this communicator's stream, so its collectives are
    /// ordered with the replica's work there (ncclCommSplit; collective over this communicator,
    /// blocks until all replicas have called it, at most nccl_options::timeout: then every other
    /// communicator of the family is aborted, this one marked aborted and left to the NCCL call
    /// still running, and errc::timeout thrown). It belongs to this
    /// replica's family: abort() of either (or a failure either notices) aborts both. The stream
    /// stays alive while the split does (shared when it is this communicator's own; an adopted one
    /// must outlive it). requires: color >= 0.
    nccl_communicator split(int color, int key) {
        return split_onto(color, key, {.shared = h_.owned_stream(), .adopted = h_.stream()});
    }

    /// As split(color, key), on `stream` instead (e.g. a side stream of the caller, which must
    /// outlive the split). requires: color >= 0; stream non-null, a stream of device().
    nccl_communicator split(int color, int key, cudaStream_t stream) {
        return split_onto(color, key, {.adopted = stream});
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

    /// Waits until the replica's stream is idle, polling NCCL's asynchronous errors and the
    /// clique's failure mark; aborts the communicator and throws on an error, a failed peer or
    /// after nccl_options::timeout. Prefer it over system().synchronize() while collectives
    /// are in flight (a stream waiting for a dead peer never becomes idle).
    void synchronize() {
        const std::string name = reached("synchronize");
        wait_traced(name, true, [&] { h_.wait(name); });
    }

    /// Waits until `event` has completed (cudaEventQuery, polled), with the checks of
    /// synchronize(): aborts and throws on a CUDA error, a failed peer (errc::peer_failure),
    /// NCCL's asynchronous error or after nccl_options::timeout (errc::timeout). `what` names
    /// the event in the error message. Use it instead of cudaEventSynchronize for an event
    /// recorded after collectives (e.g. "the step's result is ready").
    /// requires: event was created on device() and recorded (an unrecorded event counts as
    /// complete, as in CUDA).
    void wait(cudaEvent_t event, const char* what) {
        const std::string name =
            reached(std::string("wait (") + (what != nullptr ? what : "event") + ")");
        wait_traced(name, false, [&] { h_.wait_event(name, event); });
    }

    /// Throws (after aborting) if NCCL reported an asynchronous error or a peer failed; cheap
    /// enough to call every step.
    void check_async_error() {
        h_.check_usable("check_async_error");
    }

    /// Aborts the NCCL communicator (ncclCommAbort: uncompleted operations are stopped) and
    /// marks the clique failed, so peers of the clique blocked in synchronize(), wait() or
    /// barrier() throw errc::peer_failure. Every later call throws. With nccl_options::survivors
    /// set (can_shrink()), revokes instead (ncclCommRevoke: the same, but the communicators are
    /// kept for shrink(); the destructor aborts them). Idempotent, never throws.
    void abort() noexcept {
        h_.stop();
    }

    /// Why shrink() cannot continue on the survivors here ("" when it can): it needs
    /// nccl_options::survivors, a non-zero timeout, one process per rank (not init_all or
    /// gpu_group) and NCCL 2.28.7 or newer at run time.
    std::string shrink_problem() const {
        return h_.shrink_problem();
    }

    /// The first failure that stopped (aborted or revoked) this communicator's family through its
    /// checks (what shrink_steps asks to tell a lost peer from a deterministic error), or null;
    /// a failed split or shrink is thrown but not kept here.
    std::exception_ptr run_failure() const {
        return h_.failure();
    }

    /// How many times this communicator was shrunk.
    std::uint64_t generation() const noexcept {
        return membership_.generation();
    }

    /// Leaves this communicator, failed (revoked) or not, for one of the survivors (collective
    /// over them). The survivors agree through nccl_options::survivors (e.g. a file_coordinator)
    /// on who continues: every member of this generation that comes within two timeouts. The
    /// family is revoked first (its operations in flight stop); the survivors then join a new
    /// communicator (ncclCommInitRank from the NCCL id the first survivor shares through the
    /// agreement, made on a helper thread, at most the timeout), then the old family (this
    /// communicator's and its splits) is aborted, not destroyed. ensures: rank() is this
    /// replica's position among the survivors in their old rank order, size() their number,
    /// generation() + 1, a new identity() (so splits are made again from the new communicator),
    /// sequence numbers from 0, the same device and stream. Returns the members left out: their
    /// ranks in the communicator this one was created as (generation 0), ascending. Throws
    /// errc::unsupported where shrink_problem() is not empty, errc::peer_failure when the
    /// survivors left this replica out (it came too late: it must not continue), errc::timeout
    /// or errc::nccl when the new communicator could not be made (every communicator aborted).
    std::vector<int> shrink() {
        const std::string op = "nccl_communicator.shrink";
        const std::string problem = h_.shrink_problem();
        LOCKSTEP_REQUIRE(problem.empty(), errc::unsupported, h_.rank(), op, problem);
        std::vector<int> lost = membership_.next(h_, op);
        sequence_ = 0;
        identity_ = communicator_identity();
        return lost;
    }

    /// This replica's record of its last operations (flight_recorder). Operations are recorded
    /// as queued when enqueued and become done when synchronize() or barrier() finds the
    /// stream idle; wait(event) leaves them queued. A timeout or peer failure seen by a wait
    /// writes the record, and the error names the file.
    const flight_recorder& trace() const noexcept {
        return trace_;
    }

    /// Starts timing, on the device, the time this replica's stream spends between this
    /// communicator's collectives (detail::stream_gap_timer: two CUDA events per collective
    /// from now on), which device_between_ns() reads; train_params::report_stragglers_every
    /// turns it on. Collectives driven inside an nccl_group are launched at its end, after
    /// their events: their gaps are not the stream's. Idempotent.
    void time_between_on_device() {
        gaps_.start(h_.device());
    }

    /// Makes this communicator's stream wait on the device (no host wait) for `event`, recorded
    /// after collectives on another stream of the replica (comm_stream's side stream): with the
    /// device timing on, the stream's wait there counts as time in collectives, not as the
    /// replica's own work, as a collective on this stream would (a replica waiting for a slower
    /// one's buckets is not the slow one). requires: event recorded on device(). A CUDA error
    /// stops the family, as a failed collective does, and throws errc::cuda.
    void device_wait(cudaEvent_t event) {
        gaps_.before(h_.stream());
        cudaError_t st = cudaSuccess;
        {
            cuda_device_guard guard(h_.device());
            st = cudaStreamWaitEvent(h_.stream(), event, 0);
        }
        if (st != cudaSuccess) { // as the handle's polled waits report a CUDA error
            (void)cudaGetLastError();
            h_.fail_and_abort(errc::cuda, "device_wait",
                              "cudaStreamWaitEvent: ", cudaGetErrorName(st), " (",
                              cudaGetErrorString(st), ")");
        }
        gaps_.after(h_.stream());
    }

    /// The device time between collectives since time_between_on_device(), in ns, over the
    /// gaps whose next collective the stream has reached (after synchronize(): all of them);
    /// 0 while off. Throws errc::cuda when the timing's events failed.
    std::int64_t device_between_ns() {
        return gaps_.between_ns();
    }

    /// This object's communicator_identity (identified_communicator): what caches of state
    /// derived from the communicator are keyed by.
    std::uint64_t identity() const noexcept {
        return identity_.value();
    }

private:
    /// Takes ownership of `comm` (aborted if anything here throws); see nccl_handle.
    nccl_communicator(adopt_tag, ncclComm_t comm, int device,
                      detail::nccl_handle::stream_source stream,
                      std::shared_ptr<detail::nccl_clique> clique,
                      std::shared_ptr<detail::nccl_family> family, nccl_options options)
        : h_(comm, device, std::move(stream), std::move(clique), std::move(family), options) {}

    nccl_communicator split_onto(int color, int key, detail::nccl_handle::stream_source stream) {
        const std::string name = next_operation("split");
        h_.check_usable(name);
        // A bad argument still enters ncclCommSplit (as "no group"), so the peers do not wait.
        std::string problem;
        if (color < 0)
            problem = "color " + std::to_string(color) + " is negative";
        else if (stream.adopted == nullptr)
            problem = "stream is null (the legacy default stream cannot be adopted)";
        else if (!stream.shared)
            problem = detail::adopted_stream_problem(stream.adopted, h_.device());
        ncclComm_t child = nullptr;
        try {
            const int c = problem.empty() ? color : NCCL_SPLIT_NOCOLOR;
            ncclComm_t parent = h_.comm();
            child = detail::nccl_child_within(
                parent, h_.device(), h_.options().timeout, *h_.family(), h_.rank(), name,
                "the split (ncclCommSplit)", [parent, c, key](ncclComm_t* out) {
                    return ncclCommSplit(parent, c, key, out, nullptr);
                });
        } catch (...) {
            h_.stop();
            throw;
        }
        if (!problem.empty()) {
            if (child != nullptr)
                (void)ncclCommDestroy(child);
            h_.fail_and_abort(errc::invalid_argument, name, problem);
        }
        return nccl_communicator(adopt_tag{}, child, h_.device(), std::move(stream), h_.clique(),
                                 h_.family(), h_.options());
    }

    // "synchronize (after operation #41)": a timeout message then says how far this replica
    // got, so comparing the replicas' messages shows which one skipped or added a call.
    std::string reached(std::string op) const {
        return sequence_ == 0 ? op + " (before any operation)"
                              : op + " (after operation #" + std::to_string(sequence_ - 1) + ")";
    }
    std::string next_operation(const char* op) {
        return std::string(op) + " #" + std::to_string(sequence_++);
    }

    // Makes the enqueueing NCCL call `call()` (nccl_handle::enqueue), between the events of the
    // device timing when it is on.
    template <class Call>
    void enqueue(const std::string& name, Call call) {
        gaps_.before(h_.stream());
        h_.enqueue(name, call);
        gaps_.after(h_.stream());
    }

    // A null span with a non-zero count, or one larger than memory can hold, is refused before
    // anything is enqueued (like every argument error here, it aborts the communicator so the
    // peers get peer_failure instead of waiting).
    // A reduce_op that is none of the enumerators (an integer cast to it): refused (aborting, as
    // check_spans does) instead of being reduced as a sum.
    void check_op(const std::string& name, reduce_op op) {
        h_.require(is_reduce_op(op), errc::invalid_argument, name, "reduce_op value ",
                   static_cast<int>(op), " is none of sum, max, min");
    }
    template <class A, class B>
    void check_spans(const std::string& op, std::span<A> a, std::span<B> b) {
        const std::string problem = detail::join_problems(
            {detail::span_problem(a, "send"), detail::span_problem(b, "recv")});
        h_.require(problem.empty(), errc::invalid_argument, op, problem);
    }

    // send and recv in NCCL's in-place form (in_place, described by `form`) or disjoint: a
    // partial overlap is undefined in NCCL, so it is refused (aborting, as check_spans does).
    template <class A, class B>
    void check_disjoint(const std::string& op, std::span<A> send, std::span<B> recv, bool in_place,
                        const char* form) {
        const std::string overlap =
            in_place ? std::string() : lockstep::detail::overlap_text(send, "send", recv, "recv");
        h_.require(overlap.empty(), errc::invalid_argument, op, overlap,
                   ": give them identical (in place: ", form, ") or disjoint");
    }

    // Records an enqueued operation (sequence_ - 1) as queued: NCCL runs it later on the stream.
    void traced(const char* op, const char* type, std::size_t count, int peer) noexcept {
        trace_.record(op, static_cast<std::uint64_t>(sequence_ - 1), type, count, peer,
                      op_state::queued);
    }
    // Runs a wait; once the whole stream is idle (stream_idle) every queued operation is done.
    // A failed wait writes the flight recorder and the error names its file; the operations
    // stay queued, since the stream does not say which of them hangs.
    template <class Wait>
    void wait_traced(const std::string& op, bool stream_idle, Wait&& wait) {
        try {
            wait();
        } catch (const error& e) {
            if (!flight_recorder::dumps_on(e.code()))
                throw;
            throw flight_recorder::with_trace(
                e, trace_.dump(h_.rank(), h_.size(), op + ": " + e.what()));
        }
        if (stream_idle)
            trace_.complete_queued();
    }

    void check_peer(const std::string& op, int peer) {
        h_.require(peer >= 0 && peer < h_.size() && peer != h_.rank(), errc::invalid_argument, op,
                   "peer ", peer, " is not another rank of ", h_.size(), " replicas");
    }

    detail::nccl_handle h_;
    long long sequence_ = 0;
    flight_recorder trace_{"nccl"};
    detail::stream_gap_timer gaps_; // off unless time_between_on_device()
    communicator_identity identity_;
    detail::nccl_membership membership_; // the generation and its members (shrink())
};

static_assert(communicator<nccl_communicator>,
              "nccl_communicator must model lockstep::communicator.");
static_assert(all_to_all_communicator<nccl_communicator>,
              "nccl_communicator must model lockstep::all_to_all_communicator.");
static_assert(!point_to_point_communicator<nccl_communicator>,
              "nccl_communicator must not claim point_to_point_communicator: NCCL has no "
              "any-source receive, which asynchronous training needs.");

/// Groups NCCL calls so that one host thread can drive several replicas (ncclGroupStart on
/// construction, ncclGroupEnd in end() or the destructor): e.g.
/// `{ nccl_group g; for (auto& c : comms) c.all_reduce(...); g.end(); }`.
class nccl_group {
public:
    nccl_group() { LOCKSTEP_NCCL_CHECK(ncclGroupStart()); }
    nccl_group(const nccl_group&) = delete;
    nccl_group& operator=(const nccl_group&) = delete;
    /// Ends the group; errors of the grouped calls are thrown here (errc::nccl), without aborting
    /// the grouped communicators: on such an error call abort() on each of them, so their peers
    /// are released.
    void end() {
        if (!open_)
            return;
        open_ = false;
        LOCKSTEP_NCCL_CHECK(ncclGroupEnd());
    }
    /// Ends the group if end() was not called (errors are then lost: call end()).
    ~nccl_group() {
        if (open_)
            (void)ncclGroupEnd();
    }

private:
    bool open_ = true;
};

} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL

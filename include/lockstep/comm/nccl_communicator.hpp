// lockstep/comm/nccl_communicator.hpp: nccl_communicator, the communicator of GPU replicas
// (NCCL collectives enqueued on each replica's stream). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

// NCCL needs the CUDA system, hence nvcc; elsewhere this header declares nothing.
#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/nccl_bootstrap.hpp"
#include "lockstep/comm/detail/nccl_collectives.hpp"
#include "lockstep/comm/detail/nccl_failure_state.hpp"
#include "lockstep/comm/detail/nccl_handle.hpp"
#include "lockstep/comm/detail/nccl_membership.hpp"
#include "lockstep/comm/detail/nccl_shrink.hpp"
#include "lockstep/comm/detail/nccl_types.hpp"
#include "lockstep/comm/nccl_group.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
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
///
/// The collectives and send/recv come from its base detail::nccl_collectives, the waits, trace()
/// and the device timing from detail::nccl_calls underneath.
class nccl_communicator : public detail::nccl_collectives {
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
        : nccl_collectives(comm, device, std::move(stream), std::move(clique), std::move(family),
                           options) {}

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

} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL

// lockstep/comm/detail/nccl_handle.hpp: the owning NCCL handle behind nccl_communicator: its
// lifetime, stream (own or adopted), failure state and the polling waits.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/nccl_family.hpp"
#include "lockstep/comm/detail/nccl_shrink.hpp"
#include "lockstep/comm/file_coordinator.hpp"
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/system/cuda_system.hpp"

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace lockstep {

/// Runtime options of an nccl_communicator.
struct nccl_options {
    /// How long synchronize(), wait() and barrier() wait for the replica's stream or event
    /// before they abort (or, where shrink can follow, revoke) the communicator and throw
    /// errc::timeout; the same deadline bounds joining by id (ncclCommInitRank), split, shrink
    /// (its agreement twice as long) and the drain before the destructor's destroy. Zero waits
    /// forever. Default: LOCKSTEP_TIMEOUT seconds when that environment variable is set, else
    /// 10 min.
    std::chrono::milliseconds timeout = default_timeout(std::chrono::minutes(10));
    /// How the survivors agree on who continues after a loss (e.g. a file_coordinator over a
    /// directory of the job). Set, where shrinking can work (a timeout above 0, one process per
    /// rank, an NCCL with ncclCommRevoke: shrink_problem() is empty): a failure revokes the
    /// replica's communicators (ncclCommRevoke) instead of aborting them, and
    /// nccl_communicator::shrink() continues on the survivors (train_params::on_replica_failure
    /// = shrink). Empty (the default), or shrinking impossible: a failure aborts.
    survivor_agreement survivors;
};

namespace detail {

/// Why `stream` cannot be adopted by a communicator of `device` (empty when it can): a caller's
/// stream must belong to the communicator's device. The device of a stream is known to CUDA
/// 12.8 and newer (cudaStreamGetDevice); older runtimes cannot be asked and accept the stream.
inline std::string adopted_stream_problem(cudaStream_t stream, int device) {
    if (stream == nullptr)
        return {};
#if CUDART_VERSION >= 12080
    int stream_device = -1;
    const cudaError_t e = cudaStreamGetDevice(stream, &stream_device);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return std::string("cudaStreamGetDevice failed on the given stream: ") +
               cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    }
    if (stream_device != device)
        return "the given stream belongs to CUDA device " + std::to_string(stream_device) +
               ", the communicator drives device " + std::to_string(device);
#else
    (void)device;
#endif
    return {};
}

/// One replica's NCCL communicator with its stream (its own, one shared with the communicator it
/// was split from, or the caller's adopted one) and a one-int device scratch: owns them (never an
/// adopted stream), belongs to the replica's family (abort() of any member aborts them all),
/// knows whether it (or a peer of its clique) failed, and turns every failure into stop() +
/// lockstep::error, so no replica is left waiting: an abort, or where the communicator can
/// shrink (can_shrink()) a revoke that keeps it for nccl_communicator::shrink(). Move-only.
class nccl_handle {
public:
    /// Where a handle's stream comes from.
    struct stream_source {
        /// A stream the handle shares ownership of (a split on its parent's own stream).
        std::shared_ptr<cuda_stream> shared = nullptr;
        /// A stream of the caller, never destroyed (used when `shared` is null).
        cudaStream_t adopted = nullptr;
    };

    /// Takes ownership of `comm` (aborts it if anything here throws). Both stream sources null:
    /// the handle creates its own non-blocking stream on `device`. `family` null: the handle
    /// starts the family of a new replica (named by its rank), else it joins `family`.
    /// requires: the stream belongs to `device` (checked by the callers before NCCL).
    nccl_handle(ncclComm_t comm, int device, stream_source stream,
                std::shared_ptr<nccl_clique> clique, std::shared_ptr<nccl_family> family,
                nccl_options options)
        : clique_(std::move(clique)), options_(options), device_(device) {
        try {
            if (stream.shared)
                owned_stream_ = std::move(stream.shared);
            else if (stream.adopted == nullptr)
                owned_stream_ = std::make_shared<cuda_stream>(device);
            stream_ = owned_stream_ ? owned_stream_->get() : stream.adopted;
            cuda_device_guard guard(device_);
            LOCKSTEP_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
            LOCKSTEP_NCCL_CHECK(ncclCommCount(comm, &size_));
            LOCKSTEP_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(int)));
            family_ = family ? std::move(family) : std::make_shared<nccl_family>(rank_);
            member_ = family_->add(comm, device_);
            LOCKSTEP_REQUIRE(member_ != 0, errc::communication, rank_, "nccl_communicator",
                             "the replica's communicators were aborted after a failure");
            comm_ = comm;
        } catch (...) {
            if (comm != nullptr) {
                cuda_device_guard_noexcept guard(device);
                (void)ncclCommAbort(comm);
            }
            if (scratch_ != nullptr) {
                cuda_device_guard_noexcept guard(device);
                (void)cudaFree(scratch_);
            }
            throw;
        }
    }
    nccl_handle(const nccl_handle&) = delete;
    nccl_handle& operator=(const nccl_handle&) = delete;
    nccl_handle(nccl_handle&& o) noexcept
        : owned_stream_(std::move(o.owned_stream_)), stream_(std::exchange(o.stream_, nullptr)),
          comm_(std::exchange(o.comm_, nullptr)), member_(std::exchange(o.member_, 0)),
          family_(std::move(o.family_)), scratch_(std::exchange(o.scratch_, nullptr)),
          clique_(std::move(o.clique_)), options_(std::move(o.options_)), device_(o.device_),
          rank_(o.rank_), size_(o.size_), aborted_(o.aborted_), finalized_(o.finalized_) {}
    nccl_handle& operator=(nccl_handle&& o) noexcept {
        if (this != &o) {
            release();
            owned_stream_ = std::move(o.owned_stream_);
            stream_ = std::exchange(o.stream_, nullptr);
            comm_ = std::exchange(o.comm_, nullptr);
            member_ = std::exchange(o.member_, 0);
            family_ = std::move(o.family_);
            scratch_ = std::exchange(o.scratch_, nullptr);
            clique_ = std::move(o.clique_);
            options_ = std::move(o.options_);
            device_ = o.device_;
            rank_ = o.rank_;
            size_ = o.size_;
            aborted_ = o.aborted_;
            finalized_ = o.finalized_;
        }
        return *this;
    }
    /// Destroys the communicator, or aborts it when a replica of the clique failed (so this
    /// never waits for a peer that will not come); then frees the scratch.
    ~nccl_handle() { release(); }

    /// The NCCL communicator; null once aborted (by this handle or another of its family).
    ncclComm_t comm() const noexcept { return aborted() ? nullptr : comm_; }
    cudaStream_t stream() const noexcept { return stream_; }
    cuda_system system() const noexcept { return cuda_system(device_, stream_); }
    /// True when the stream is the caller's (adopted), not owned by the handle (or shared).
    bool adopted_stream() const noexcept { return stream_ != nullptr && !owned_stream_; }
    /// The stream's shared owner (null when adopted), for a split onto the same stream.
    const std::shared_ptr<cuda_stream>& owned_stream() const noexcept { return owned_stream_; }
    int* scratch() const noexcept { return scratch_; }
    const std::shared_ptr<nccl_clique>& clique() const noexcept { return clique_; }
    const std::shared_ptr<nccl_family>& family() const noexcept { return family_; }
    const nccl_options& options() const noexcept { return options_; }
    int device() const noexcept { return device_; }
    int rank() const noexcept { return rank_; }
    int size() const noexcept { return size_; }
    /// True once this communicator or another of its family was aborted.
    bool aborted() const noexcept { return aborted_ || (family_ && family_->aborted()); }
    /// True once the family was revoked (stop() where can_shrink()), until it is aborted.
    bool revoked() const noexcept { return family_ && family_->revoked() && !aborted(); }
    /// Why a failure cannot revoke and shrink() cannot continue on the survivors ("" when they
    /// can): no survivor agreement in the options, a zero timeout, or an NCCL without revoke.
    std::string shrink_problem() const {
        if (!options_.survivors)
            return "nccl_options::survivors is not set (how the survivors agree on who "
                   "continues: e.g. a lockstep::file_coordinator over a directory of the job)";
        if (clique_ && clique_->several_ranks)
            return "its ranks live in one process (init_all, gpu_group): losing one loses the "
                   "process; shrinking needs one process per rank";
        if (options_.timeout.count() <= 0)
            return "nccl_options::timeout is 0: the survivors need a deadline to leave a lost "
                   "replica out";
        return nccl_fault_api::loaded().problem();
    }
    bool can_shrink() const { return shrink_problem().empty(); }
    /// The first failure a handle of the family threw (fail_and_abort), or null.
    std::exception_ptr failure() const { return family_ ? family_->failure() : nullptr; }

    /// After a failure: aborts (abort()), or where can_shrink() revokes every communicator of the
    /// family (their operations stop, every later call throws; they stay for a shrink, and are
    /// aborted when the handle goes). Marks the clique failed either way. Never throws.
    void stop() noexcept {
        bool shrinkable = false;
        try {
            shrinkable = can_shrink();
        } catch (...) {
        }
        if (!shrinkable || !family_) {
            abort();
            return;
        }
        mark_clique_failed();
        family_->revoke_all(nccl_fault_api::loaded().revoke);
    }

    /// Aborts the NCCL communicator and every other communicator of the replica's family
    /// (ncclCommAbort: uncompleted operations are stopped) and marks the clique failed. Every
    /// later call throws. Idempotent; safe on a moved-from handle.
    void abort() noexcept {
        mark_clique_failed();
        if (family_)
            family_->abort_all(); // comm_ is a member: aborted there
        comm_ = nullptr;
        aborted_ = true;
    }

    /// ncclCommFinalize (for nccl_communicator::destroy_all, inside its NCCL group): flushes
    /// the communicator's work, after which the destructor's ncclCommDestroy frees it locally
    /// without waiting for the peers. No-op once aborted.
    ncclResult_t finalize() noexcept {
        if (aborted() || comm_ == nullptr || finalized_)
            return ncclSuccess;
        cuda_device_guard_noexcept guard(device_);
        const ncclResult_t r = ncclCommFinalize(comm_);
        finalized_ = r == ncclSuccess || r == ncclInProgress;
        return r;
    }

    /// Before a destroy: waits until the stream is idle, with wait()'s checks and timeout, so
    /// that ncclCommDestroy never starts while a collective that waits for a peer is in flight
    /// (it would wait for it without a deadline). Returns the wait's failure (null when the
    /// stream went idle): then the family was aborted (a destroy is no longer needed, nor
    /// possible). Never throws.
    std::exception_ptr drain() noexcept {
        if (aborted() || comm_ == nullptr || finalized_)
            return nullptr;
        try {
            wait("destroy");
            return nullptr;
        } catch (...) {
            abort(); // done by the failed wait already; idempotent
            return std::current_exception();
        }
    }

    static std::string describe(ncclResult_t r) {
        return std::string(ncclGetErrorString(r)) + " (ncclResult_t " +
               std::to_string(static_cast<int>(r)) + ")";
    }

    /// Stops (stop(): aborts, or revokes), marks the clique failed and throws `code` naming this
    /// replica (replica(): its rank in the communicator its family was created from, as the
    /// peers' "replica N failed" does, also on a split) and `op`; the family keeps the first such
    /// failure (failure()). A call that fails because another thread revoked the family meanwhile
    /// throws errc::peer_failure, as check_usable() would have.
    template <class... Args>
    [[noreturn]] void fail_and_abort(errc code, const std::string& op, Args&&... details) {
        if (code == errc::nccl && revoked())
            code = errc::peer_failure;
        stop();
        try {
            fail(code, replica(), op, std::forward<Args>(details)...);
        } catch (...) {
            if (family_)
                family_->record_failure(std::current_exception());
            throw;
        }
    }

    template <class... Args>
    void require(bool cond, errc code, const std::string& op, Args&&... details) {
        if (!cond)
            fail_and_abort(code, op, std::forward<Args>(details)...);
    }

    /// NCCL reads and writes spans with device kernels: host memory (a std::vector, say) would
    /// crash or hang them, so it is rejected here with a message (one cheap runtime query).
    void check_memory(const std::string& op, const char* what, const void* p) {
        cudaPointerAttributes a{};
        const cudaError_t e = cudaPointerGetAttributes(&a, p);
        if (e != cudaSuccess)
            (void)cudaGetLastError();
        const bool ok =
            e == cudaSuccess && (a.type == cudaMemoryTypeManaged ||
                                 (a.type == cudaMemoryTypeDevice && a.device == device_));
        require(ok, errc::invalid_argument, op, what, " (", p, ") is not memory of CUDA device ",
                device_, " (type ", static_cast<int>(a.type), ", device ", a.device,
                "); NCCL collectives take spans of the communicator's system (device memory)");
    }

    /// Throws if this communicator was aborted, a peer of the clique failed, or NCCL holds an
    /// asynchronous error on any communicator of the replica's family (this one or a split: a
    /// peer lost on the comm_stream's split shows there first, while this one waits).
    void check_usable(const std::string& op) {
        const int failed = clique_ ? clique_->failed_rank.load() : -1;
        const bool peer_failed = failed >= 0 && failed != replica();
        if (aborted() || comm_ == nullptr)
            fail(peer_failed ? errc::peer_failure : errc::communication, replica(), op,
                 "the communicator was aborted after a failure (of this replica, one of its "
                 "communicators or a peer)");
        if (revoked()) // a failure of its own is the family's failure(): the caller reads that
            fail(errc::peer_failure, replica(), op,
                 "the communicator was revoked after a failure; shrink() continues on the "
                 "survivors");
        if (peer_failed)
            fail_and_abort(errc::peer_failure, op, "replica ", failed,
                           " failed; this replica's communicator was aborted");
        nccl_family::async_state st;
        if (family_) {
            st = family_->async_error(comm_);
        } else {
            st.query = ncclCommGetAsyncError(comm_, &st.async);
            if (st.query != ncclSuccess || st.async != ncclSuccess)
                st.last = ncclGetLastError(comm_);
        }
        const char* where =
            st.sibling ? " (on another communicator of the replica's family: a split)" : "";
        if (st.query != ncclSuccess)
            fail_and_abort(errc::nccl, op, "ncclCommGetAsyncError: ", describe(st.query), where);
        if (st.async != ncclSuccess && st.async != ncclInProgress)
            fail_and_abort(st.async == ncclRemoteError ? errc::peer_failure : errc::nccl, op,
                           "asynchronous NCCL error ", describe(st.async), where, ": ", st.last);
    }

    /// Makes the enqueueing NCCL call `call()` on this replica's device once check_usable()
    /// passed, and checks its result: ncclRemoteError (a peer gone, e.g. while the call set up
    /// a connection on demand) is errc::peer_failure as in the polled wait, so a shrink takes
    /// it for the loss of a replica; any other error is errc::nccl.
    template <class Call>
    void enqueue(const std::string& op, Call call) {
        check_usable(op);
        ncclResult_t r = ncclSuccess;
        {
            cuda_device_guard guard(device_);
            r = call();
        }
        if (r != ncclSuccess && r != ncclInProgress)
            fail_and_abort(r == ncclRemoteError ? errc::peer_failure : errc::nccl, op, describe(r),
                           ": ", ncclGetLastError(comm_));
    }

    /// Polls the stream until idle, checking for failures and the timeout (see
    /// nccl_communicator::synchronize()).
    void wait(const std::string& op) {
        poll(op, "the stream", [&] { return cudaStreamQuery(stream_); });
    }

    /// Polls `event` until it completed, with the same checks as wait(op) (see
    /// nccl_communicator::wait()).
    void wait_event(const std::string& op, cudaEvent_t event) {
        poll(op, "the event", [&] { return cudaEventQuery(event); });
    }

private:
    /// Calls query() (cudaStreamQuery or cudaEventQuery) until it reports completion; between
    /// tries, checks the clique, NCCL's asynchronous error and the deadline, so a dead or
    /// mismatched peer ends in an error, never a hang.
    template <class Query>
    void poll(const std::string& op, const char* what, Query query) {
        using clock = std::chrono::steady_clock;
        const auto start = clock::now();
        cuda_device_guard guard(device_);
        for (;;) {
            check_usable(op);
            const cudaError_t e = query();
            if (e == cudaSuccess)
                return;
            if (e != cudaErrorNotReady) {
                (void)cudaGetLastError();
                fail_and_abort(errc::cuda, op, "waiting for ", what, ": ", cudaGetErrorName(e),
                               " (", cudaGetErrorString(e), ")");
            }
            const auto waited = clock::now() - start;
            if (options_.timeout.count() > 0 && waited > options_.timeout)
                fail_and_abort(errc::timeout, op, what, " did not complete within ",
                               options_.timeout.count(),
                               " ms (a peer is missing or mismatched); communicator aborted");
            // Short collectives finish within microseconds; back off for long ones.
            if (waited < std::chrono::milliseconds(1))
                std::this_thread::yield();
            else
                std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
    }

    /// Names this replica in the clique as the one that failed, unless one is named already.
    void mark_clique_failed() noexcept {
        if (clique_) {
            int none = -1;
            clique_->failed_rank.compare_exchange_strong(none, replica());
        }
    }

    /// The replica the clique names: its rank in the communicator its family started with.
    int replica() const noexcept { return family_ ? family_->replica() : rank_; }

    /// The communicator goes first: cudaFree synchronises the device, which would wait forever
    /// for a kernel of a communicator still waiting for a dead peer. A healthy communicator is
    /// drained first (drain(): bounded by the timeout, else it is aborted), so a destroy after a
    /// throw outside a step (a peer that will never join the last collective) does not hang.
    void release() noexcept {
        if (comm_ != nullptr && revoked() && family_->remove(member_)) {
            // Revoked: its kernels stopped, so it is aborted alone (the others stay for a shrink),
            // never destroyed.
            cuda_device_guard_noexcept guard(device_);
            (void)ncclCommAbort(comm_);
            comm_ = nullptr;
        }
        if (comm_ != nullptr && !(clique_ && clique_->failed_rank.load() >= 0))
            (void)drain();
        if (comm_ != nullptr) {
            const bool peer_failed = clique_ && clique_->failed_rank.load() >= 0;
            if (peer_failed && !finalized_ && family_) {
                // With the rest of the family, in one group: aborted one by one, this abort
                // could wait for a sibling's kernel that waits for the dead peer.
                family_->abort_all();
            } else if (!family_ || family_->remove(member_)) {
                // (remove() is false when an abort of the family already freed it.)
                cuda_device_guard_noexcept guard(device_);
                if (peer_failed && !finalized_)
                    (void)ncclCommAbort(comm_);
                else
                    (void)ncclCommDestroy(comm_);
            }
            comm_ = nullptr;
        }
        if (scratch_ != nullptr) {
            cuda_device_guard_noexcept guard(device_);
            (void)cudaFree(scratch_);
            scratch_ = nullptr;
        }
    }

    std::shared_ptr<cuda_stream> owned_stream_; // null when adopted; declared first: goes last
    cudaStream_t stream_ = nullptr;             // owned_stream_'s, or the caller's (not owned)
    ncclComm_t comm_ = nullptr;                 // owned (through family_ once aborted)
    std::uint64_t member_ = 0;                  // comm_'s id in family_
    std::shared_ptr<nccl_family> family_;
    int* scratch_ = nullptr; // one device int for barrier()
    std::shared_ptr<nccl_clique> clique_;
    nccl_options options_{};
    int device_ = 0;
    int rank_ = 0;
    int size_ = 0;
    bool aborted_ = false;
    bool finalized_ = false;
};

} // namespace detail
} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL

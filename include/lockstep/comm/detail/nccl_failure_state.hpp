// lockstep/comm/detail/nccl_failure_state.hpp: how a replica's NCCL communicator fails:
// nccl_options (its deadline and survivor agreement) and nccl_failure_state, nccl_handle's base,
// which stops the replica's family (abort or revoke) and turns every failure into an error.
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

/// The failure side of one replica's NCCL communicator, the base of nccl_handle (which owns the
/// communicator and sets comm_, family_ and rank_ when it adopts it): knows whether the
/// communicator (or a peer of its clique) failed, and turns every failure into stop() +
/// lockstep::error, so no replica is left waiting: an abort of the replica's whole family, or
/// where the communicator can shrink (can_shrink()) a revoke that keeps it for
/// nccl_communicator::shrink(). Its checked NCCL call (enqueue) and polled wait (poll) check for
/// failures before and while they wait, and give up after nccl_options::timeout. Move-only.
class nccl_failure_state {
public:
    nccl_failure_state(const nccl_failure_state&) = delete;
    nccl_failure_state& operator=(const nccl_failure_state&) = delete;

    /// The NCCL communicator; null once aborted (by this handle or another of its family).
    ncclComm_t comm() const noexcept { return aborted() ? nullptr : comm_; }
    const std::shared_ptr<nccl_clique>& clique() const noexcept { return clique_; }
    const std::shared_ptr<nccl_family>& family() const noexcept { return family_; }
    const nccl_options& options() const noexcept { return options_; }
    int device() const noexcept { return device_; }
    int rank() const noexcept { return rank_; }
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

protected:
    nccl_failure_state(std::shared_ptr<nccl_clique> clique, nccl_options options, int device)
        : clique_(std::move(clique)), options_(std::move(options)), device_(device) {}
    nccl_failure_state(nccl_failure_state&& o) noexcept
        : comm_(std::exchange(o.comm_, nullptr)), family_(std::move(o.family_)),
          clique_(std::move(o.clique_)), options_(std::move(o.options_)), device_(o.device_),
          rank_(o.rank_), aborted_(o.aborted_) {}
    nccl_failure_state& operator=(nccl_failure_state&& o) noexcept {
        if (this != &o) {
            comm_ = std::exchange(o.comm_, nullptr);
            family_ = std::move(o.family_);
            clique_ = std::move(o.clique_);
            options_ = std::move(o.options_);
            device_ = o.device_;
            rank_ = o.rank_;
            aborted_ = o.aborted_;
        }
        return *this;
    }
    ~nccl_failure_state() = default;

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

private:
    /// Names this replica in the clique as the one that failed, unless one is named already.
    void mark_clique_failed() noexcept {
        if (clique_) {
            int none = -1;
            clique_->failed_rank.compare_exchange_strong(none, replica());
        }
    }

    /// The replica the clique names: its rank in the communicator its family started with.
    int replica() const noexcept { return family_ ? family_->replica() : rank_; }

protected:
    // Set by nccl_handle's constructor, which adopts the communicator and frees it.
    ncclComm_t comm_ = nullptr; // owned (through family_ once aborted)
    std::shared_ptr<nccl_family> family_;
    std::shared_ptr<nccl_clique> clique_;
    nccl_options options_{};
    int device_ = 0;
    int rank_ = 0;
    bool aborted_ = false;
};

} // namespace detail
} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL

// lockstep/comm/detail/nccl_family.hpp: what lockstep's NCCL communicators share: the clique (the
// replicas one process created together), the family (one replica's communicator and every split
// made from it) and the process-wide launch order. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/system/cuda_system.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace lockstep::detail {

/// What the communicators one process creates together (init_all, and their splits) share: the
/// replica (its rank in the communicator it was created with) that failed first, so that the
/// others stop waiting and fail too.
struct nccl_clique {
    std::atomic<int> failed_rank{-1};
    /// Several ranks of one process (init_all): they cannot shrink (a lost one is a lost
    /// process, and all of them with it).
    bool several_ranks = false;
};

/// One replica's NCCL communicators: the one it was created with and every split made from it
/// (the comm_stream's, bn::group's). A failure noticed on any of them aborts all of them (or,
/// where the communicator can shrink, revokes them), in one NCCL group: kernels of a communicator
/// left running would spin for the dead peer, and the device synchronisation of a later cudaFree or
/// cudaFreeHost (or of an abort one by one) would then never return. Thread-safe.
class nccl_family {
public:
    /// `replica`: the replica's rank in the communicator the family started with (the one its
    /// clique names).
    explicit nccl_family(int replica) noexcept : replica_(replica) {}
    nccl_family(const nccl_family&) = delete;
    nccl_family& operator=(const nccl_family&) = delete;

    int replica() const noexcept { return replica_; }
    /// True once abort_all() ran: every member was aborted (and their handles are gone).
    bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }

    /// Adds `comm` (of `device`), which the family aborts with the others from now on; returns
    /// its id, or 0 (comm not added) when the family was aborted already.
    std::uint64_t add(ncclComm_t comm, int device) {
        const std::lock_guard<std::mutex> lock(mutex_);
        if (aborted())
            return 0;
        members_.push_back({next_id_, comm, device});
        return next_id_++;
    }

    /// Takes member `id` out of the family. Returns true when it was still there (its owner now
    /// destroys it), false when abort_all() already aborted it.
    bool remove(std::uint64_t id) noexcept {
        const std::lock_guard<std::mutex> lock(mutex_);
        const auto it = std::find_if(members_.begin(), members_.end(),
                                     [&](const member& m) { return m.id == id; });
        if (it == members_.end())
            return false;
        members_.erase(it);
        return true;
    }

    /// NCCL's asynchronous error of any member (ncclCommGetAsyncError on each: the replica's
    /// communicator, the comm_stream's split, bn::group's split), so that a wait on one of them
    /// (`self`) sees a failure that NCCL reported on another. ensures: `query` is the first
    /// failed ncclCommGetAsyncError call's result (else ncclSuccess); `async` the first member's
    /// error other than ncclSuccess and ncclInProgress (else ncclSuccess); `last` NCCL's last
    /// error text then, and `sibling` whether that member is not `self`.
    struct async_state {
        ncclResult_t query = ncclSuccess;
        ncclResult_t async = ncclSuccess;
        bool sibling = false;
        std::string last;
    };
    async_state async_error(ncclComm_t self) const {
        const std::lock_guard<std::mutex> lock(mutex_);
        async_state st;
        for (const member& m : members_) {
            ncclResult_t a = ncclSuccess;
            const ncclResult_t r = ncclCommGetAsyncError(m.comm, &a);
            if (r != ncclSuccess || (a != ncclSuccess && a != ncclInProgress)) {
                st.query = r;
                st.async = r != ncclSuccess ? ncclSuccess : a;
                st.sibling = m.comm != self;
                st.last = ncclGetLastError(m.comm);
                return st;
            }
        }
        return st;
    }

    /// True once revoke_all() ran (and abort_all() did not yet).
    bool revoked() const noexcept { return revoked_.load(std::memory_order_acquire); }

    /// Revokes every member with `revoke` (ncclCommRevoke, looked up at run time: nccl_shrink.hpp):
    /// their operations in flight stop and every later one fails, but the communicators stay, for
    /// a shrink (or an abort); marks the family revoked. When a revoke fails, aborts them all
    /// instead (a shrink then fails at once). Idempotent; a no-op once aborted.
    template <class Revoke>
    void revoke_all(Revoke revoke) noexcept {
        {
            const std::lock_guard<std::mutex> lock(mutex_);
            if (aborted() || revoked())
                return;
            revoked_.store(true, std::memory_order_release);
            // In one group, as abort_all: every member's kernels are told to stop before any
            // revoke waits for its own.
            // A group that was started is always ended, even when a revoke failed: an open group
            // would hold back the aborts of the fallback.
            const bool grouped = ncclGroupStart() == ncclSuccess;
            bool ok = grouped;
            for (const member& m : members_) {
                cuda_device_guard_noexcept guard(m.device);
                ok = revoke(m.comm, 0) == ncclSuccess && ok; // NCCL_REVOKE_DEFAULT
            }
            if (grouped)
                ok = ncclGroupEnd() == ncclSuccess && ok;
            if (ok)
                return;
        }
        abort_all();
    }

    /// Takes `comm` out of the family without ending it: a call still running on it elsewhere
    /// (nccl_child_within's helper past its deadline) keeps it; nobody frees it.
    void forget(ncclComm_t comm) noexcept {
        const std::lock_guard<std::mutex> lock(mutex_);
        members_.erase(std::remove_if(members_.begin(), members_.end(),
                                      [&](const member& m) { return m.comm == comm; }),
                       members_.end());
    }

    /// The first failure any member's handle threw (what nccl_communicator::run_failure
    /// returns), kept by record_failure(); null before one.
    std::exception_ptr failure() const {
        const std::lock_guard<std::mutex> lock(mutex_);
        return failure_;
    }
    void record_failure(std::exception_ptr e) {
        const std::lock_guard<std::mutex> lock(mutex_);
        if (!failure_)
            failure_ = std::move(e);
    }

    /// Aborts every member (ncclCommAbort inside ncclGroupStart/End, so that no abort waits for
    /// a kernel of another member) and marks the family aborted. Idempotent.
    void abort_all() noexcept {
        const std::lock_guard<std::mutex> lock(mutex_);
        aborted_.store(true, std::memory_order_release);
        if (members_.empty())
            return;
        const bool grouped = ncclGroupStart() == ncclSuccess;
        for (const member& m : members_) {
            cuda_device_guard_noexcept guard(m.device);
            (void)ncclCommAbort(m.comm);
        }
        if (grouped)
            (void)ncclGroupEnd();
        members_.clear();
    }

private:
    struct member {
        std::uint64_t id;
        ncclComm_t comm;
        int device;
    };

    mutable std::mutex mutex_;
    std::vector<member> members_; // guarded by mutex_
    std::uint64_t next_id_ = 1;   // guarded by mutex_
    std::exception_ptr failure_;  // guarded by mutex_
    std::atomic<bool> aborted_{false};
    std::atomic<bool> revoked_{false};
    int replica_;
};

/// Sets NCCL_LAUNCH_ORDER_IMPLICIT=1 in the process environment unless the environment names
/// it already (the user's value stays, "0" included). NCCL then launches the kernels of different
/// communicators of one device in the order the host issued them, which lockstep keeps equal on
/// every replica (bucket_plan, the layers' order); without it two communicators active on one
/// GPU (the replica's and the comm_stream's split) can deadlock. ncclConfig_t has no field for
/// it up to NCCL 2.28, and NCCL reads the variable once per process, so the setting is
/// process-wide: it also orders the program's own NCCL communicators. It runs once, during the
/// static initialisation of a program that includes nccl_communicator.hpp (see
/// nccl_launch_order_set below), before main and so before the program's threads exist: a
/// setenv later would race with other threads' getenv.
inline bool use_implicit_launch_order() noexcept {
    (void)::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", 0);
    return true;
}

/// The oldest NCCL library lockstep runs on: 2.26, the first with NCCL_LAUNCH_ORDER_IMPLICIT.
/// The headers are checked when compiling (nccl_communicator.hpp), but a program may load
/// another libnccl.so.2 at run time (LD_LIBRARY_PATH, a Python wheel's), where the setting would
/// be ignored and two active communicators of a replica could deadlock.
inline constexpr int nccl_oldest_runtime = NCCL_VERSION(2, 26, 0);

/// "2.28.9" for NCCL's version code 22809 (NCCL_VERSION's encoding since 2.9).
inline std::string nccl_version_name(int code) {
    return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." +
           std::to_string(code % 100);
}

/// Why NCCL library version `runtime` (ncclGetVersion; 0: unknown) cannot be used, or "" when
/// it can.
inline std::string nccl_runtime_problem(int runtime) {
    if (runtime >= nccl_oldest_runtime)
        return {};
    return "the NCCL library loaded at run time is " +
           (runtime > 0 ? "version " + nccl_version_name(runtime)
                        : std::string("of unknown version (ncclGetVersion failed)")) +
           "; lockstep needs " + nccl_version_name(nccl_oldest_runtime) +
           " or newer (NCCL_LAUNCH_ORDER_IMPLICIT orders a replica's two active communicators) "
           "and was compiled against " +
           nccl_version_name(NCCL_VERSION_CODE) +
           ": put a newer libnccl.so.2 first on the library path (LD_LIBRARY_PATH)";
}

/// nccl_runtime_problem of the library this process loaded (asked once).
inline const std::string& loaded_nccl_problem() {
    static const std::string problem = [] {
        int v = 0;
        return nccl_runtime_problem(ncclGetVersion(&v) == ncclSuccess ? v : 0);
    }();
    return problem;
}

/// Runs use_implicit_launch_order() at static initialisation (one inline variable for the whole
/// program).
inline const bool nccl_launch_order_set = use_implicit_launch_order();

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

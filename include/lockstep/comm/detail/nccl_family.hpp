// lockstep/comm/detail/nccl_family.hpp: what lockstep's NCCL communicators share: the clique (the
// replicas one process created together), the family (one replica's communicator and every split
// made from it) and the process-wide launch order. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_NCCL

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace lockstep::detail {

/// What the communicators one process creates together (init_all, and their splits) share: the
/// replica (its rank in the communicator it was created with) that failed first, so that the
/// others stop waiting and fail too.
struct nccl_clique {
    std::atomic<int> failed_rank{-1};
};

/// Makes a device current for its lifetime without throwing (for noexcept paths).
class cuda_device_guard_noexcept {
public:
    explicit cuda_device_guard_noexcept(int device) {
        switched_ = cudaGetDevice(&previous_) == cudaSuccess && previous_ != device &&
                    cudaSetDevice(device) == cudaSuccess;
    }
    cuda_device_guard_noexcept(const cuda_device_guard_noexcept&) = delete;
    cuda_device_guard_noexcept& operator=(const cuda_device_guard_noexcept&) = delete;
    ~cuda_device_guard_noexcept() {
        if (switched_)
            (void)cudaSetDevice(previous_);
    }

private:
    int previous_ = 0;
    bool switched_ = false;
};

/// One replica's NCCL communicators: the one it was created with and every split made from it
/// (the comm_stream's, bn::group's). A failure noticed on any of them aborts all of them, in one
/// NCCL group: kernels of a communicator left running would spin for the dead peer, and the
/// device synchronisation of a later cudaFree or cudaFreeHost (or of an abort one by one) would
/// then never return. Thread-safe.
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

    std::mutex mutex_;
    std::vector<member> members_; // guarded by mutex_
    std::uint64_t next_id_ = 1;   // guarded by mutex_
    std::atomic<bool> aborted_{false};
    int replica_;
};

/// Sets NCCL_LAUNCH_ORDER_IMPLICIT=1 in the process environment, once, before lockstep creates
/// its first NCCL communicator, unless the environment names it already (the user's value
/// stays). NCCL then launches the kernels of different communicators of one device in the order
/// the host issued them, which lockstep keeps equal on every replica (bucket_plan, the layers'
/// order); without it two communicators active on one GPU (the replica's and the comm_stream's
/// split) can deadlock. NCCL reads the variable at its first launch in the process: a program
/// that launches NCCL work of its own before creating a lockstep communicator sets it itself.
/// (ncclConfig_t has no field for it up to NCCL 2.28.)
inline void use_implicit_launch_order() {
    static std::once_flag once;
    std::call_once(once, [] { (void)::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", 0); });
}

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

// lockstep/comm/detail/nccl_handle.hpp: the owning NCCL handle behind nccl_communicator: its
// lifetime, stream (own or adopted), device scratch and the waits on its stream.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/nccl_failure_state.hpp"
#include "lockstep/comm/detail/nccl_family.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/system/cuda_system.hpp"

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace lockstep::detail {

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
/// adopted stream) and its place in the replica's family, and destroys them without waiting for a
/// peer that failed. What a failure does (stop(): abort or revoke, fail_and_abort) and the checks
/// before and while it waits come from nccl_failure_state. Move-only.
class nccl_handle : public nccl_failure_state {
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
        : nccl_failure_state(std::move(clique), std::move(options), device) {
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
        : nccl_failure_state(std::move(o)), owned_stream_(std::move(o.owned_stream_)),
          stream_(std::exchange(o.stream_, nullptr)), member_(std::exchange(o.member_, 0)),
          scratch_(std::exchange(o.scratch_, nullptr)), size_(o.size_), finalized_(o.finalized_) {}
    nccl_handle& operator=(nccl_handle&& o) noexcept {
        if (this != &o) {
            release();
            owned_stream_ = std::move(o.owned_stream_);
            stream_ = std::exchange(o.stream_, nullptr);
            member_ = std::exchange(o.member_, 0);
            scratch_ = std::exchange(o.scratch_, nullptr);
            size_ = o.size_;
            finalized_ = o.finalized_;
            nccl_failure_state::operator=(std::move(o));
        }
        return *this;
    }
    /// Destroys the communicator, or aborts it when a replica of the clique failed (so this
    /// never waits for a peer that will not come); then frees the scratch.
    ~nccl_handle() { release(); }

    cudaStream_t stream() const noexcept { return stream_; }
    cuda_system system() const noexcept { return cuda_system(device_, stream_); }
    /// True when the stream is the caller's (adopted), not owned by the handle (or shared).
    bool adopted_stream() const noexcept { return stream_ != nullptr && !owned_stream_; }
    /// The stream's shared owner (null when adopted), for a split onto the same stream.
    const std::shared_ptr<cuda_stream>& owned_stream() const noexcept { return owned_stream_; }
    int* scratch() const noexcept { return scratch_; }
    int size() const noexcept { return size_; }

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

    std::shared_ptr<cuda_stream> owned_stream_; // null when adopted; goes after the members below
    cudaStream_t stream_ = nullptr;             // owned_stream_'s, or the caller's (not owned)
    std::uint64_t member_ = 0;                  // comm_'s id in family_
    int* scratch_ = nullptr;                    // one device int for barrier()
    int size_ = 0;
    bool finalized_ = false;
};

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

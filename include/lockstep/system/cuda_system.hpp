// lockstep/system/cuda_system.hpp: device memory and Thrust's CUDA system on one stream of one
// device, plus copies between host and device memory. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

// The CUDA system needs nvcc (Thrust's CUDA backend compiles device code). In a host-only
// translation unit this header declares nothing, so including it there is harmless.
#if LOCKSTEP_HAS_CUDA

#include "lockstep/system/host_sync.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/system.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>

#include <cuda_runtime_api.h>
#include <thrust/system/cuda/execution_policy.h>

namespace lockstep {

/// The number of CUDA devices this process can use; 0 when there is no device or no usable
/// driver. The error CUDA reports then is read (cudaGetLastError), so it does not surface again
/// in an unrelated later check; without a driver every later CUDA call fails anyway.
inline int cuda_device_count() noexcept {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

/// Makes `device` the calling thread's current CUDA device for the guard's lifetime and
/// restores the previous one afterwards.
class cuda_device_guard {
public:
    /// requires: 0 <= device < cuda_device_count().
    explicit cuda_device_guard(int device) : device_(device) {
        LOCKSTEP_CUDA_CHECK(cudaGetDevice(&previous_));
        if (previous_ != device_)
            LOCKSTEP_CUDA_CHECK(cudaSetDevice(device_));
    }
    cuda_device_guard(const cuda_device_guard&) = delete;
    cuda_device_guard& operator=(const cuda_device_guard&) = delete;
    ~cuda_device_guard() {
        if (previous_ != device_)
            (void)cudaSetDevice(previous_);
    }

private:
    int device_;
    int previous_ = 0;
};

namespace detail {
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
} // namespace detail

namespace gpu {
/// cuda_system's (empty) base: it makes namespace lockstep::gpu an associated namespace of
/// cuda_system, so that argument-dependent lookup on a cuda_system finds the CUDA overloads
/// declared there (the batch-norm operations of kernels/bn_cuda.cuh) and lookup on any other
/// lockstep type does not (as host_system's lockstep::host). Not named `cuda`: with `using
/// namespace lockstep;` that would make `cuda::std` ambiguous.
struct adl_tag {
    friend constexpr bool operator==(const adl_tag&, const adl_tag&) = default;
};
} // namespace gpu

/// Where memory lives and kernels run on a GPU: device memory of device `device()`, kernels
/// through Thrust's CUDA system enqueued on `stream()` without implicit synchronisation.
/// A cuda_system is a cheap, non-owning value (device ordinal + stream handle); the stream,
/// when not the default stream, is owned elsewhere (a cuda_stream, or an nccl_communicator)
/// and must outlive every kernel and every allocation made through the system.
class cuda_system : public gpu::adl_tag {
public:
    /// Device memory is never dereferenced on the host.
    static constexpr bool is_host = false;
    /// Bytes every allocation is aligned to (what the CUDA allocators guarantee).
    static constexpr std::size_t alignment = 256;

    /// Device 0 on the legacy default stream.
    cuda_system() = default;
    /// requires: 0 <= device < cuda_device_count(); stream is null (the default stream) or a
    /// stream created on `device`.
    explicit cuda_system(int device, cudaStream_t stream = nullptr)
        : device_(device), stream_(stream) {}

    /// The CUDA device ordinal.
    int device() const noexcept { return device_; }
    /// The stream every kernel, copy and allocation of this system is ordered on.
    cudaStream_t stream() const noexcept { return stream_; }

    /// The Thrust execution policy kernels of this system run with: the CUDA system on
    /// stream(), allowed to skip the synchronisations Thrust would otherwise add (results are
    /// ordered on the stream; call synchronize() before the host reads them). Makes device()
    /// the calling thread's current device first (kernels launch on the current device), as
    /// host_system::policy() sets the calling thread's OpenMP budget.
    auto policy() const {
        LOCKSTEP_CUDA_CHECK(cudaSetDevice(device_));
        return thrust::cuda::par_nosync.on(stream_);
    }

    /// Waits until all work enqueued on stream() has finished; a failed kernel throws.
    /// Counts a host synchronisation (host_sync_count()). Inside a training step lockstep never
    /// calls it: waits there go through the communicator, which polls for peer failures.
    void synchronize() const {
        cuda_device_guard guard(device_);
        detail::count_host_sync();
        LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }

    /// Allocates bytes of device memory, ordered on stream() (cudaMallocAsync): usable by work
    /// on stream() at once, by other streams after synchronize(). ensures: non-null or throws
    /// (null for 0 bytes).
    void* allocate(std::size_t bytes) const {
        if (bytes == 0)
            return nullptr;
        cuda_device_guard guard(device_);
        void* p = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream_));
        if (reinterpret_cast<std::uintptr_t>(p) % alignment != 0) {
            (void)cudaFreeAsync(p, stream_);
            fail(errc::internal, -1, "cuda_system.allocate", "cudaMallocAsync returned ", p,
                 ", not aligned to ", alignment, " bytes");
        }
        return p;
    }
    /// Frees memory from allocate(), ordered after the work already enqueued on stream().
    /// Errors cannot be reported from here (it runs in destructors) and are ignored.
    void deallocate(void* p, std::size_t /*bytes*/) const noexcept {
        if (p == nullptr)
            return;
        int previous = 0;
        const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                              cudaSetDevice(device_) == cudaSuccess;
        (void)cudaFreeAsync(p, stream_);
        if (switched)
            (void)cudaSetDevice(previous);
    }

    friend bool operator==(const cuda_system&, const cuda_system&) = default;

    /// True while stream() is being captured into a CUDA graph (cudaStreamIsCapturing: active,
    /// or invalidated by an error): work enqueued now is recorded into the graph and runs only
    /// when the graph is launched, so the host must not wait for it. Found by
    /// detail::capturing (system/system.hpp) through argument-dependent lookup.
    friend bool is_capturing(const cuda_system& sys) {
        cuda_device_guard guard(sys.device_);
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        LOCKSTEP_CUDA_CHECK(cudaStreamIsCapturing(sys.stream_, &status));
        return status != cudaStreamCaptureStatusNone;
    }

    // Copies between systems, found by argument-dependent lookup from lockstep::copy. Each
    // returns once the bytes have arrived (the copy is synchronised), as copy() promises.

    /// host -> device: ordered after the work already enqueued on the destination's stream.
    friend void copy_bytes(void* dst, const cuda_system& dst_sys, const void* src,
                           const host_system&, std::size_t bytes) {
        if (bytes == 0)
            return;
        cuda_device_guard guard(dst_sys.device_);
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dst_sys.stream_));
        detail::count_host_sync();
        LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(dst_sys.stream_));
    }
    /// device -> host: ordered after the work already enqueued on the source's stream.
    friend void copy_bytes(void* dst, const host_system&, const void* src,
                           const cuda_system& src_sys, std::size_t bytes) {
        if (bytes == 0)
            return;
        cuda_device_guard guard(src_sys.device_);
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, src_sys.stream_));
        detail::count_host_sync();
        LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(src_sys.stream_));
    }
    /// device -> device (same or different devices): waits for the source's stream, then
    /// copies on the destination's stream.
    friend void copy_bytes(void* dst, const cuda_system& dst_sys, const void* src,
                           const cuda_system& src_sys, std::size_t bytes) {
        if (bytes == 0)
            return;
        if (src_sys != dst_sys)
            src_sys.synchronize();
        cuda_device_guard guard(dst_sys.device_);
        if (src_sys.device_ == dst_sys.device_) {
            LOCKSTEP_CUDA_CHECK(
                cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, dst_sys.stream_));
        } else {
            LOCKSTEP_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_sys.device_, src, src_sys.device_,
                                                    bytes, dst_sys.stream_));
        }
        detail::count_host_sync();
        LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(dst_sys.stream_));
    }
    /// device -> device on one system, enqueued on its stream; returns at once (no
    /// synchronisation): the bytes are there for every later kernel of the system.
    friend void copy_bytes_async(void* dst, const void* src, std::size_t bytes,
                                 const cuda_system& sys) {
        if (bytes == 0)
            return;
        cuda_device_guard guard(sys.device_);
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, sys.stream_));
    }

private:
    int device_ = 0;
    cudaStream_t stream_ = nullptr;
};

static_assert(execution_system<cuda_system>);

/// An owning CUDA stream on one device (cudaStreamCreateWithFlags / cudaStreamDestroy).
/// Move-only. Destroy it only after the buffers allocated through its system().
class cuda_stream {
public:
    /// Creates a stream on `device`; by default non-blocking (it does not synchronise with the
    /// legacy default stream). requires: 0 <= device < cuda_device_count().
    explicit cuda_stream(int device = 0, unsigned flags = cudaStreamNonBlocking) : device_(device) {
        cuda_device_guard guard(device_);
        LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, flags));
    }
    cuda_stream(const cuda_stream&) = delete;
    cuda_stream& operator=(const cuda_stream&) = delete;
    cuda_stream(cuda_stream&& o) noexcept
        : device_(o.device_), stream_(std::exchange(o.stream_, nullptr)) {}
    cuda_stream& operator=(cuda_stream&& o) noexcept {
        if (this != &o) {
            release();
            device_ = o.device_;
            stream_ = std::exchange(o.stream_, nullptr);
        }
        return *this;
    }
    ~cuda_stream() { release(); }

    /// The device the stream belongs to.
    int device() const noexcept { return device_; }
    /// The stream handle (null once moved from).
    cudaStream_t get() const noexcept { return stream_; }
    /// The system running on this stream.
    cuda_system system() const noexcept { return cuda_system(device_, stream_); }

private:
    void release() noexcept {
        if (stream_ == nullptr)
            return;
        // Work still enqueued completes; the stream's resources are released afterwards.
        (void)cudaStreamDestroy(stream_);
        stream_ = nullptr;
    }

    int device_ = 0;
    cudaStream_t stream_ = nullptr;
};

/// An owning CUDA event without timing (cudaEventCreateWithFlags(cudaEventDisableTiming)): what
/// one stream records when a piece of work is done and another stream, or the host, waits for.
/// Move-only.
class cuda_event {
public:
    /// Creates the event on `device`. requires: 0 <= device < cuda_device_count().
    explicit cuda_event(int device = 0) : device_(device) {
        cuda_device_guard guard(device_);
        LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    }
    cuda_event(const cuda_event&) = delete;
    cuda_event& operator=(const cuda_event&) = delete;
    cuda_event(cuda_event&& o) noexcept
        : device_(o.device_), event_(std::exchange(o.event_, nullptr)) {}
    cuda_event& operator=(cuda_event&& o) noexcept {
        if (this != &o) {
            release();
            device_ = o.device_;
            event_ = std::exchange(o.event_, nullptr);
        }
        return *this;
    }
    ~cuda_event() { release(); }

    /// The event handle.
    cudaEvent_t get() const noexcept { return event_; }
    /// Records the event after the work enqueued so far on sys's stream, for another stream's
    /// wait (make_wait); inside a stream capture it becomes a dependency between graph nodes.
    void record(const cuda_system& sys) {
        cuda_device_guard guard(sys.device());
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(event_, sys.stream()));
    }
    /// Records the event after the work enqueued so far on sys's stream, for a wait on the
    /// HOST (cudaEventQuery, wait_for). While the stream is being captured into a CUDA graph a
    /// plain record (record()) is only an edge between the graph's nodes, which the host can
    /// never query (cudaErrorCapturedEvent); this one is then an external event record node
    /// (cudaEventRecordExternal), so every launch of the graph records the event again.
    void record_for_host(const cuda_system& sys) {
        cuda_device_guard guard(sys.device());
        if (is_capturing(sys))
            LOCKSTEP_CUDA_CHECK(
                cudaEventRecordWithFlags(event_, sys.stream(), cudaEventRecordExternal));
        else
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(event_, sys.stream()));
    }
    /// Makes every later kernel of sys wait for the work this event recorded (no host wait).
    void make_wait(const cuda_system& sys) const {
        cuda_device_guard guard(sys.device());
        LOCKSTEP_CUDA_CHECK(cudaStreamWaitEvent(sys.stream(), event_, 0));
    }

private:
    void release() noexcept {
        if (event_ != nullptr)
            (void)cudaEventDestroy(event_);
        event_ = nullptr;
    }

    int device_ = 0;
    cudaEvent_t event_ = nullptr;
};

/// n values of page-locked host memory (cudaMallocHost): the target of device-to-host copies
/// that must not block (a pageable copy synchronises and can deadlock next to collectives).
/// Move-only; values start uninitialised.
template <class T>
class pinned_array {
public:
    pinned_array() = default;
    explicit pinned_array(std::size_t n) : size_(n) {
        if (n == 0)
            return;
        void* p = nullptr;
        LOCKSTEP_CUDA_CHECK(
            cudaMallocHost(&p, checked_bytes(n, sizeof(T), -1, "pinned_array", "its size")));
        data_ = static_cast<T*>(p);
    }
    pinned_array(const pinned_array&) = delete;
    pinned_array& operator=(const pinned_array&) = delete;
    pinned_array(pinned_array&& o) noexcept
        : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    pinned_array& operator=(pinned_array&& o) noexcept {
        if (this != &o) {
            if (data_ != nullptr)
                (void)cudaFreeHost(data_);
            data_ = std::exchange(o.data_, nullptr);
            size_ = std::exchange(o.size_, 0);
        }
        return *this;
    }
    ~pinned_array() {
        if (data_ != nullptr)
            (void)cudaFreeHost(data_);
    }
    T* data() noexcept { return data_; }
    const T* data() const noexcept { return data_; }
    std::size_t size() const noexcept { return size_; }

private:
    T* data_ = nullptr;
    std::size_t size_ = 0;
};

} // namespace lockstep

#endif // LOCKSTEP_HAS_CUDA

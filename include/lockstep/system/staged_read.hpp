// lockstep/system/staged_read.hpp: staged_read<T, System>, a small device-to-host read that is
// enqueued without blocking and waited for later. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/system/cuda_system.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep {

/// Reads up to capacity() values of a system's memory into host memory in two halves:
/// enqueue(src) queues the copy behind the system's work and returns at once; once the copy is
/// complete (comm/host_wait.hpp's wait_for polls for it with the communicator's failure checks
/// and timeout) values() holds the data. On CUDA the host side is pinned memory and completion
/// is an event, so the copy never blocks and never synchronises the stream; on the host system
/// the copy happens in enqueue(). A read enqueued while the stream is being captured into a CUDA
/// graph becomes part of the graph: every launch copies into the same host memory and records the
/// event again, and the host waits for a launch, never during the capture (wait_for refuses).
template <class T, class System>
class staged_read;

/// The host system: a plain copy.
template <class T>
class staged_read<T, host_system> {
public:
    static constexpr bool needs_wait = false;

    /// requires: n >= 1.
    explicit staged_read(std::size_t n, const host_system& = host_system{1}) : values_(n) {}

    std::size_t capacity() const noexcept { return values_.size(); }
    /// Copies src (host memory) now. requires: src.size() <= capacity().
    void enqueue(std::span<const T> src) {
        LOCKSTEP_REQUIRE(src.size() <= values_.size(), errc::internal, -1, "staged_read",
                         src.size(), " values for a read of ", values_.size());
        std::copy(src.begin(), src.end(), values_.begin());
        size_ = src.size();
    }
    /// The values of the last enqueue() (valid once waited for).
    std::span<const T> values() const noexcept { return {values_.data(), size_}; }

private:
    std::vector<T> values_;
    std::size_t size_ = 0;
};

#if LOCKSTEP_HAS_CUDA
/// The CUDA system: an asynchronous copy into pinned memory and an event recorded after it.
template <class T>
class staged_read<T, cuda_system> {
public:
    static constexpr bool needs_wait = true;

    /// requires: n >= 1; sys's device exists.
    explicit staged_read(std::size_t n, const cuda_system& sys)
        : sys_(sys), values_(n), done_(sys.device()) {}

    std::size_t capacity() const noexcept { return values_.size(); }
    /// Queues the copy of src (device memory of the system) behind the work already enqueued
    /// on its stream and records the completion event for the host (cuda_event::record_for_host:
    /// inside a stream capture an external record, which each launch of the graph repeats).
    /// requires: src.size() <= capacity(); the previous read was waited for (its host values
    /// are overwritten).
    void enqueue(std::span<const T> src) {
        LOCKSTEP_REQUIRE(src.size() <= values_.size(), errc::internal, -1, "staged_read",
                         src.size(), " values for a read of ", values_.size());
        size_ = src.size();
        if (size_ != 0) {
            cuda_device_guard guard(sys_.device());
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(values_.data(), src.data(), size_ * sizeof(T),
                                                cudaMemcpyDeviceToHost, sys_.stream()));
        }
        done_.record_for_host(sys_);
    }
    /// The event recorded after the copy.
    cudaEvent_t event() const noexcept { return done_.get(); }
    const cuda_system& system() const noexcept { return sys_; }
    /// The values of the last enqueue() (valid once the event completed).
    std::span<const T> values() const noexcept { return {values_.data(), size_}; }

private:
    cuda_system sys_;
    pinned_array<T> values_;
    cuda_event done_;
    std::size_t size_ = 0;
};
#endif

} // namespace lockstep

// tests/support/shared_gpu_group.cuh: shared_gpu_group, N replicas as threads sharing ONE GPU,
// each on its own stream with a shared_gpu_communicator (NCCL refuses two ranks on one device).
// Test support, not public API. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "support/shared_gpu_communicator.cuh"
#include "support/shared_gpu_detail.cuh"

#include <chrono>
#include <concepts>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <cuda_runtime_api.h>

namespace lockstep::testing {

/// Runtime knobs of a shared_gpu_group.
struct shared_gpu_group_params {
    /// How long a replica waits for its peers (host rendezvous, wait(), synchronize()).
    std::chrono::milliseconds timeout = default_timeout(std::chrono::seconds(120));
    /// The device every replica shares.
    int device = 0;
};

/// N replicas as threads sharing one GPU, each on its own non-blocking stream:
///     lockstep::testing::shared_gpu_group group(4);
///     group.run([&](lockstep::testing::shared_gpu_communicator& comm) { ... });
class shared_gpu_group {
public:
    using params = shared_gpu_group_params;

    /// requires: 1 <= size <= 16; p.device a CUDA device; p.timeout > 0.
    explicit shared_gpu_group(int size, params p = {}) : size_(size), params_(p) {
        LOCKSTEP_REQUIRE(size >= 1 && size <= shared_gpu_detail::max_replicas,
                         errc::invalid_argument, -1, "shared_gpu_group", "size ", size,
                         " must be in [1, ", shared_gpu_detail::max_replicas, "]");
    }
    int size() const noexcept { return size_; }

    /// Calls f(comm) on size() threads, rank 0..size()-1, each on its own stream of the
    /// shared device; joins them. If any replica failed, rethrows the root cause (the first
    /// failure that is not errc::peer_failure, else the first).
    template <class F>
    requires std::invocable<F&, shared_gpu_communicator&>
    void run(F&& f) {
        thread_group group(size_, {.timeout = params_.timeout});
        auto state = std::make_shared<shared_gpu_detail::run_state>(params_.device, params_.timeout,
                                                                    &group, size_);
        std::mutex mutex;
        std::vector<std::exception_ptr> failures;
        try {
            group.run([&](thread_communicator& host) {
                try {
                    LOCKSTEP_CUDA_CHECK(cudaSetDevice(params_.device));
                    // Declared first: the stream outlives the communicator's scratch and every
                    // buffer f allocates on it.
                    cuda_stream stream(params_.device);
                    shared_gpu_communicator comm(host, state, stream.system());
                    std::invoke(f, comm);
                } catch (...) {
                    const std::lock_guard lock(mutex);
                    failures.push_back(std::current_exception());
                    throw;
                }
            });
        } catch (...) {
            const std::lock_guard lock(mutex);
            for (const auto& e : failures)
                if (!is_peer_failure(e))
                    std::rethrow_exception(e);
            if (!failures.empty())
                std::rethrow_exception(failures.front());
            throw;
        }
    }

private:
    static bool is_peer_failure(const std::exception_ptr& e) {
        try {
            std::rethrow_exception(e);
        } catch (const error& x) {
            return x.code() == errc::peer_failure;
        } catch (...) {
            return false;
        }
    }

    int size_;
    params params_;
};

} // namespace lockstep::testing

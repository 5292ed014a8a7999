// lockstep/comm/gpu_group.hpp: gpu_group, one replica per GPU as threads of one process, each
// with its own nccl_communicator. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

// NCCL needs the CUDA system, hence nvcc; elsewhere this header declares nothing.
#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <chrono>
#include <concepts>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace lockstep {

/// Runtime knobs of a gpu_group.
struct gpu_group_params {
    /// How long a replica waits for its peers (nccl_communicator's synchronize(), wait() and
    /// barrier()) before it aborts its communicator and throws errc::timeout, failing the run.
    /// Default: LOCKSTEP_TIMEOUT seconds when that environment variable is set, else 10 min.
    std::chrono::milliseconds timeout = default_timeout(std::chrono::minutes(10));
    /// Streams of the caller for the replicas to adopt, streams[i] for the i-th device (not
    /// owned: they must outlive run()); empty: every communicator creates its own stream.
    std::vector<cudaStream_t> streams = {};
};

/// One replica per GPU as threads of one process, each driving its device through its own
/// nccl_communicator (all created together by nccl_communicator::init_all):
///     lockstep::gpu_group group({.timeout = std::chrono::seconds(60)}); // every visible GPU
///     group.run([&](lockstep::nccl_communicator& comm) { ... });
///
/// Several processes, one GPU each, on any number of nodes: no launcher is needed; start them
/// with mpiexec and make each communicator collectively from MPI:
///     lockstep::mpi_environment env(argc, argv);
///     lockstep::nccl_communicator comm(MPI_COMM_WORLD,
///                                      lockstep::nccl_communicator::local_device(MPI_COMM_WORLD));
class gpu_group {
public:
    using params = gpu_group_params;

    /// One replica per visible CUDA device, rank i on device i.
    /// requires: cuda_device_count() >= 1; as gpu_group(devices, p).
    explicit gpu_group(params p = {}) : gpu_group(visible_devices(), std::move(p)) {}

    /// One replica per entry of `devices`, rank i on devices[i].
    /// requires: devices non-empty, distinct, each in [0, cuda_device_count()); p.timeout > 0;
    /// p.streams empty or one stream per device, p.streams[i] a stream of devices[i] (checked
    /// when run() creates the communicators).
    explicit gpu_group(std::vector<int> devices, params p = {})
        : devices_(std::move(devices)), params_(std::move(p)) {
        const int available = cuda_device_count();
        LOCKSTEP_REQUIRE(!devices_.empty(), errc::invalid_argument, -1, "gpu_group",
                         "no devices given (", available, " CUDA devices visible)");
        for (std::size_t i = 0; i < devices_.size(); ++i) {
            LOCKSTEP_REQUIRE(devices_[i] >= 0 && devices_[i] < available, errc::invalid_argument,
                             static_cast<int>(i), "gpu_group", "device ", devices_[i],
                             " does not exist (", available, " CUDA devices)");
            for (std::size_t j = 0; j < i; ++j)
                LOCKSTEP_REQUIRE(devices_[j] != devices_[i], errc::invalid_argument,
                                 static_cast<int>(i), "gpu_group", "device ", devices_[i],
                                 " given twice (ranks ", j, " and ", i, ")");
        }
        LOCKSTEP_REQUIRE(params_.timeout.count() > 0, errc::invalid_argument, -1, "gpu_group",
                         "timeout ", params_.timeout.count(), " ms must be positive");
        LOCKSTEP_REQUIRE(params_.streams.empty() || params_.streams.size() == devices_.size(),
                         errc::invalid_argument, -1, "gpu_group", params_.streams.size(),
                         " streams for ", devices_.size(), " devices; give one per device or none");
    }

    /// The number of replicas run() starts.
    int size() const noexcept { return static_cast<int>(devices_.size()); }
    /// The device of each rank.
    std::span<const int> devices() const noexcept { return devices_; }
    /// The knobs this group was made with.
    const params& parameters() const noexcept { return params_; }

    /// Creates size() communicators together (nccl_communicator::init_all, adopting
    /// parameters().streams if given), then calls f(comm) on size() new threads, each with the
    /// communicator of rank 0..size()-1 and its device made current, and joins them all. f is
    /// called concurrently and must allow that. A replica whose f throws aborts its
    /// communicator, which marks the clique failed: every other replica's next collective or
    /// wait throws errc::peer_failure (within parameters().timeout) instead of hanging. (A
    /// replica blocked inside a host-blocking NCCL call, such as split(), waits for NCCL.)
    /// ensures: returns when every replica has returned and every communicator is destroyed;
    /// if any replica failed, rethrows the root cause: the first failure that is not an
    /// errc::peer_failure (the first failure when all are), not the errors it caused in the
    /// others. Else, when the streams did not go idle at the end (a collective one replica
    /// enqueued and the others never matched: errc::timeout after parameters().timeout),
    /// rethrows that failure.
    template <class F>
    requires std::invocable<F&, nccl_communicator&>
    void run(F&& f) {
        auto comms = nccl_communicator::init_all(devices_, nccl_options{.timeout = params_.timeout},
                                                 params_.streams);
        failure_log log;
        const auto replica_main = [&](std::size_t r) {
            nccl_communicator& comm = comms[r];
            try {
                LOCKSTEP_CUDA_CHECK(cudaSetDevice(comm.device()));
                std::invoke(f, comm);
            } catch (...) {
                // Recorded before the abort, so the root cause precedes the failures it causes.
                log.record(std::current_exception());
                comm.abort();
            }
        };
        std::vector<std::thread> threads;
        threads.reserve(comms.size());
        try {
            for (std::size_t r = 0; r < comms.size(); ++r)
                threads.emplace_back(replica_main, r);
        } catch (...) {
            // A replica without a thread never joins the collectives: release the others.
            log.record(std::current_exception());
            for (std::size_t r = threads.size(); r < comms.size(); ++r)
                comms[r].abort();
        }
        for (auto& t : threads)
            t.join();
        // This thread owns every rank: destroyed together (one by one, each would wait for the
        // others).
        const std::exception_ptr teardown = nccl_communicator::destroy_all(comms);
        if (auto e = log.root_cause())
            std::rethrow_exception(e);
        if (teardown) // e.g. a collective one replica enqueued and the others never matched
            std::rethrow_exception(teardown);
    }

private:
    /// The failures of one run() in the order they happened.
    class failure_log {
    public:
        void record(std::exception_ptr e) {
            const std::lock_guard<std::mutex> lock(mutex_);
            failures_.push_back(std::move(e));
        }
        std::exception_ptr root_cause() const {
            const std::lock_guard<std::mutex> lock(mutex_);
            for (const auto& e : failures_)
                if (!is_peer_failure(e))
                    return e;
            return failures_.empty() ? nullptr : failures_.front();
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

        mutable std::mutex mutex_;
        std::vector<std::exception_ptr> failures_;
    };

    static std::vector<int> visible_devices() {
        const int n = cuda_device_count();
        LOCKSTEP_REQUIRE(n > 0, errc::cuda, -1, "gpu_group", "no CUDA device is visible");
        std::vector<int> devices(static_cast<std::size_t>(n));
        std::iota(devices.begin(), devices.end(), 0);
        return devices;
    }

    std::vector<int> devices_;
    params params_;
};

} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL

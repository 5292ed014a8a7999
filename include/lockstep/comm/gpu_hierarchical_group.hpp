// lockstep/comm/gpu_hierarchical_group.hpp: gpu_hierarchical_group, GPU replicas (NCCL) inside
// every MPI process composed into one hierarchical_communicator. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

// NCCL needs nvcc and the inter-node part needs MPI; elsewhere this header declares nothing.
#if LOCKSTEP_HAS_NCCL && LOCKSTEP_HAS_MPI

#include "lockstep/comm/detail/mpi_job_failure.hpp"
#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <mpi.h>

#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace lockstep {

/// Runtime options of gpu_hierarchical_group.
struct gpu_hierarchical_group_params {
    gpu_group_params gpus = {};       ///< the process's GPU replicas (timeout, adopted streams)
    mpi_communicator_params mpi = {}; ///< each local device index's inter-process communicator
    /// A replica whose function throws (anything, or fails in a collective) ends the whole job
    /// with MPI_Abort after printing the error, so no process is left waiting for it (true), or
    /// run() rethrows it in this process only (false: the other processes find out when their
    /// MPI operations time out). errc::peer_failure only echoes another replica's failure,
    /// which ends the job itself: such a replica leaves without aborting. A failure no replica
    /// ended the job for (a replica thread that returned while the others of its process waited
    /// for it in a collective) ends it when run() would rethrow it.
    bool abort_on_failure = true;
};

/// Every process of an MPI communicator drives its GPUs as threads (a gpu_group, NCCL inside
/// the process); together they form one group of size() = processes x devices replicas, with
/// global rank = process rank x devices + device index. Each replica gets a
/// hierarchical_communicator<nccl_communicator, mpi_communicator>: the intra-node part is the
/// process's NCCL clique, the inter-node part an mpi_communicator (a duplicate of comm) over
/// the replicas of the same device index in every process. Spans passed to its collectives
/// are device memory; the inter-node steps go through pinned host memory (see
/// hierarchical_communicator):
///
///     lockstep::mpi_environment env(argc, argv, {.requested = MPI_THREAD_MULTIPLE,
///                                                .required = MPI_THREAD_MULTIPLE});
///     lockstep::gpu_hierarchical_group group(MPI_COMM_WORLD); // every visible GPU
///     group.run([&](lockstep::gpu_hierarchical_group::communicator_type& comm) { ... });
///
/// Requirements: MPI_THREAD_MULTIPLE (the replica threads of a process call MPI at the same
/// time, each on its own communicator; the constructor throws errc::unsupported otherwise);
/// the same number of devices in every process (checked by the constructor on every process);
/// one process per node, or devices chosen so that processes on one node do not share a GPU.
class gpu_hierarchical_group {
public:
    using communicator_type = hierarchical_communicator<nccl_communicator, mpi_communicator>;
    using params = gpu_hierarchical_group_params;

    /// Every visible CUDA device of this process. Collective over comm.
    /// requires: as gpu_hierarchical_group(comm, devices, p), with cuda_device_count() >= 1.
    explicit gpu_hierarchical_group(MPI_Comm comm, params p = {})
        : gpu_hierarchical_group(comm, std::nullopt, std::move(p)) {}

    /// Replica i of this process on devices[i]. Collective over comm: every process sets up
    /// its devices, then the processes agree (one all_gather over a duplicate of comm, within
    /// params::mpi.timeout): when any process failed (no device, a bad device list, MPI
    /// without MPI_THREAD_MULTIPLE) or the processes give different numbers of devices, every
    /// process throws (its own error, else errc::peer_failure or
    /// errc::invalid_argument naming the counts), so none is left waiting; then it makes one
    /// duplicate of comm per device index. requires: MPI initialised with
    /// MPI_THREAD_MULTIPLE; devices as for gpu_group.
    gpu_hierarchical_group(MPI_Comm comm, std::vector<int> devices, params p = {})
        : gpu_hierarchical_group(comm, std::optional<std::vector<int>>(std::move(devices)),
                                 std::move(p)) {}
    /// Replicas (devices) per process.
    int local_size() const noexcept { return gpus_->size(); }
    /// Processes.
    int processes() const noexcept { return inter_.empty() ? 0 : inter_.front().size(); }
    /// This process's devices, replica i on devices()[i].
    std::span<const int> devices() const noexcept { return gpus_->devices(); }

    /// Calls f(comm) on local_size() new threads of this process, each with its device current
    /// and its replica's communicator, and joins them (gpu_group::run underneath). Every
    /// process calls run() at the same point. ensures: returns when every replica of this
    /// process has returned; a failure of any replica ends the job (params::abort_on_failure)
    /// or is rethrown here (gpu_group's root cause).
    template <class F>
    requires std::invocable<F&, communicator_type&>
    void run(F&& f) {
        detail::run_or_end_job("gpu_hierarchical_group", params_.abort_on_failure, [&] {
            gpus_->run([&](nccl_communicator& intra) { replica_main(f, intra); });
        });
    }

private:
    // One replica: its communicator from this thread's NCCL communicator and its device index's
    // MPI communicator, which returns to the group for the next run(). On a failure the NCCL
    // part is aborted here (gpu_group aborts only the moved-from handle it still holds), so
    // this process's other replicas get errc::peer_failure instead of waiting; when the
    // communicator's construction itself throws, the NCCL part goes with it unaborted and the
    // job ends through abort_on_failure.
    template <class F>
    void replica_main(F& f, nccl_communicator& intra) {
        const auto l = static_cast<std::size_t>(intra.rank());
        std::optional<communicator_type> comm;
        try {
            comm.emplace(std::move(intra), std::move(inter_[l]));
            std::invoke(f, *comm);
            inter_[l] = std::move(comm->inter());
        } catch (const std::exception& e) {
            if (comm)
                comm->abort();
            if (params_.abort_on_failure && !detail::echoes_peer(e))
                detail::abort_mpi_job("gpu_hierarchical_group", "thread", static_cast<int>(l), e);
            throw;
        } catch (...) {
            if (comm)
                comm->abort();
            if (params_.abort_on_failure)
                detail::abort_mpi_job("gpu_hierarchical_group", "thread", static_cast<int>(l),
                                      detail::non_standard_exception());
            throw;
        }
    }

    // devices: the list given, or every visible device (nullopt).
    gpu_hierarchical_group(MPI_Comm comm, std::optional<std::vector<int>> devices, params p)
        : params_(std::move(p)) {
        int process = -1;
        LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm, &process));
        std::exception_ptr failure;
        try {
            detail::require_thread_multiple("gpu_hierarchical_group", process);
            gpus_.emplace(devices ? std::move(*devices) : visible_devices(), params_.gpus);
        } catch (...) {
            failure = std::current_exception();
        }
        const int mine = gpus_ ? gpus_->size() : 0;
        detail::agree_replica_counts(comm, mine, failure, params_.mpi, "gpu_hierarchical_group",
                                     "devices", "every process needs the same number");
        inter_.reserve(static_cast<std::size_t>(mine));
        for (int l = 0; l < mine; ++l)
            inter_.emplace_back(comm, params_.mpi);
    }

    static std::vector<int> visible_devices() {
        const int n = cuda_device_count();
        LOCKSTEP_REQUIRE(n > 0, errc::cuda, -1, "gpu_hierarchical_group",
                         "no CUDA device is visible");
        std::vector<int> devices(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i)
            devices[static_cast<std::size_t>(i)] = i;
        return devices;
    }

    std::optional<gpu_group> gpus_; // engaged once the constructor succeeded
    params params_;
    std::vector<mpi_communicator> inter_;
};

} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL && LOCKSTEP_HAS_MPI

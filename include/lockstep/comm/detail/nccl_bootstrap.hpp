// lockstep/comm/detail/nccl_bootstrap.hpp: how nccl_communicator's NCCL communicators are made
// (ncclCommInitAll, ncclCommInitRank, the id over MPI), every argument checked before NCCL is
// entered. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/detail/nccl_deadline.hpp"
#include "lockstep/comm/detail/nccl_family.hpp"
#include "lockstep/comm/detail/nccl_handle.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>
#if LOCKSTEP_HAS_MPI
#include "lockstep/comm/mpi_communicator.hpp"

#include <mpi.h>
#endif

namespace lockstep::detail {

/// nccl_communicator::init_all: checks `devices` (non-empty, distinct, each in
/// [0, cuda_device_count())), `streams` (empty or one non-null stream of devices[i] per device)
/// and the loaded NCCL library, then makes one NCCL communicator per device (ncclCommInitAll)
/// and hands each to make(raw, device, stream, clique) (stream null when `streams` is empty;
/// one clique shared by all), which returns the Comm that owns raw (aborting raw if it throws).
/// When a make throws, the communicators not yet owned are aborted and the Comms made so far
/// abort()ed, in one NCCL group, and the exception propagates.
template <class Comm, class Make>
std::vector<Comm> nccl_init_all(std::span<const int> devices, std::span<const cudaStream_t> streams,
                                Make make) {
    const int n = static_cast<int>(devices.size());
    LOCKSTEP_REQUIRE(n > 0, errc::invalid_argument, -1, "nccl_communicator.init_all",
                     "no devices given");
    const int available = cuda_device_count();
    for (int i = 0; i < n; ++i) {
        LOCKSTEP_REQUIRE(devices[i] >= 0 && devices[i] < available, errc::invalid_argument, i,
                         "nccl_communicator.init_all", "device ", devices[i], " does not exist (",
                         available, " CUDA devices)");
        for (int j = 0; j < i; ++j)
            LOCKSTEP_REQUIRE(devices[j] != devices[i], errc::invalid_argument, i,
                             "nccl_communicator.init_all", "device ", devices[i],
                             " given twice (ranks ", j, " and ", i,
                             "); NCCL needs one device per rank");
    }
    LOCKSTEP_REQUIRE(streams.empty() || streams.size() == devices.size(), errc::invalid_argument,
                     -1, "nccl_communicator.init_all", streams.size(), " streams for ", n,
                     " devices; give one per device or none");
    for (std::size_t i = 0; i < streams.size(); ++i) {
        LOCKSTEP_REQUIRE(streams[i] != nullptr, errc::invalid_argument, static_cast<int>(i),
                         "nccl_communicator.init_all",
                         "stream is null (the legacy default stream cannot be adopted)");
        const std::string problem = adopted_stream_problem(streams[i], devices[i]);
        LOCKSTEP_REQUIRE(problem.empty(), errc::invalid_argument, static_cast<int>(i),
                         "nccl_communicator.init_all", problem);
    }
    LOCKSTEP_REQUIRE(loaded_nccl_problem().empty(), errc::unsupported, -1,
                     "nccl_communicator.init_all", loaded_nccl_problem());
    std::vector<ncclComm_t> raw(devices.size(), nullptr);
    LOCKSTEP_NCCL_CHECK(ncclCommInitAll(raw.data(), n, devices.data()));
    auto clique = std::make_shared<nccl_clique>();
    clique->several_ranks = n > 1;
    std::vector<Comm> comms;
    comms.reserve(devices.size());
    std::size_t adopted = 0;
    try {
        for (; adopted < raw.size(); ++adopted)
            comms.push_back(make(raw[adopted], devices[adopted],
                                 streams.empty() ? nullptr : streams[adopted], clique));
    } catch (...) {
        // make aborted raw[adopted]; the rest are not owned yet. One thread aborts several
        // ranks: in one NCCL group, so no abort waits for another.
        const bool grouped = ncclGroupStart() == ncclSuccess;
        for (std::size_t k = adopted + 1; k < raw.size(); ++k) {
            cuda_device_guard_noexcept guard(devices[k]);
            (void)ncclCommAbort(raw[k]);
        }
        for (auto& c : comms)
            c.abort();
        if (grouped)
            (void)ncclGroupEnd();
        throw;
    }
    return comms;
}

/// The (ncclUniqueId, size, rank, device) constructor's NCCL communicator: checks rank, device,
/// the adopted `stream` (null: none) and the loaded NCCL library, makes `device` the calling
/// thread's current device (left so: the replica's kernels go there) and joins `id`
/// (ncclCommInitRank on a helper thread, at most `timeout`: then errc::timeout).
/// ensures: the returned communicator is the caller's.
inline ncclComm_t nccl_init_rank(const ncclUniqueId& id, int size, int rank, int device,
                                 cudaStream_t stream, std::chrono::milliseconds timeout) {
    LOCKSTEP_REQUIRE(size > 0 && rank >= 0 && rank < size, errc::invalid_argument, rank,
                     "nccl_communicator", "rank ", rank, " of ", size, " replicas");
    const int available = cuda_device_count();
    LOCKSTEP_REQUIRE(device >= 0 && device < available, errc::invalid_argument, rank,
                     "nccl_communicator", "device ", device, " does not exist (", available,
                     " CUDA devices)");
    const std::string problem = adopted_stream_problem(stream, device);
    LOCKSTEP_REQUIRE(problem.empty(), errc::invalid_argument, rank, "nccl_communicator", problem);
    LOCKSTEP_REQUIRE(loaded_nccl_problem().empty(), errc::unsupported, rank, "nccl_communicator",
                     loaded_nccl_problem());
    // Left current: the replica's kernels go to its device (a guard would restore another).
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(device));
    const nccl_made made = nccl_make_within(device, timeout, [id, size, rank](ncclComm_t* comm) {
        return ncclCommInitRank(comm, size, id, rank);
    });
    LOCKSTEP_REQUIRE(made.in_time, errc::timeout, rank, "nccl_communicator",
                     "ncclCommInitRank did not return within ", timeout.count(),
                     " ms (nccl_options::timeout): a rank of ", size,
                     " did not join (its process ended, or it was given another id)");
    if (made.result != ncclSuccess) {
        if (made.comm != nullptr)
            (void)ncclCommAbort(made.comm);
        fail(errc::nccl, rank, "nccl_communicator",
             "ncclCommInitRank: ", ncclGetErrorString(made.result), " (ncclResult_t ",
             static_cast<int>(made.result), ")");
    }
    return made.comm;
}

#if LOCKSTEP_HAS_MPI
/// The (MPI_Comm, device) constructor's NCCL communicator, collective over `comm`: every
/// process checks its NCCL library, `device` and `stream` (and rank 0 creates the id), all agree
/// on the result before anyone enters NCCL (a process with a problem throws it, the others
/// errc::peer_failure naming it), rank 0 broadcasts the id, then nccl_init_rank. The agreement
/// and the broadcast are polled mpi_communicator collectives within `timeout` (0: forever).
inline ncclComm_t nccl_init_mpi(MPI_Comm comm, int device, cudaStream_t stream,
                                std::chrono::milliseconds timeout) {
    int rank = 0, size = 0;
    LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm, &size));
    // Every process checks what would otherwise fail inside NCCL on one rank only, and all
    // agree before anyone enters ncclCommInitRank.
    ncclUniqueId id{};
    const int available = cuda_device_count();
    std::string problem = loaded_nccl_problem();
    const errc code = problem.empty() ? errc::invalid_argument : errc::unsupported;
    if (problem.empty() && (device < 0 || device >= available))
        problem = "device " + std::to_string(device) + " is not usable (" +
                  std::to_string(available) + " CUDA devices)";
    if (problem.empty())
        problem = adopted_stream_problem(stream, device);
    if (problem.empty() && rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
        problem = "the NCCL id could not be created (ncclGetUniqueId)";
    // Polled within the timeout on a duplicate of comm (so a process that never comes is a
    // timeout, not a hang). The buffers are on the heap: after a timeout MPI may still write
    // them when the peers arrive, so they are then kept for good.
    struct exchange {
        std::vector<int> ok;
        ncclUniqueId id{};
    };
    // (A timeout of 0 waits forever, as in nccl_options: here ten years.)
    const std::chrono::milliseconds wait =
        timeout.count() > 0 ? timeout : std::chrono::hours(24 * 365 * 10);
    mpi_communicator probe(comm, {.timeout = wait, .on_failure = mpi_failure_action::throw_error});
    auto ex = std::make_unique<exchange>();
    ex->ok.assign(static_cast<std::size_t>(size) + 1, 0);
    ex->id = id;
    try {
        ex->ok[0] = problem.empty() ? 1 : 0;
        probe.all_gather(std::span<const int>(ex->ok.data(), 1), std::span<int>(ex->ok).subspan(1));
        LOCKSTEP_REQUIRE(problem.empty(), code, rank, "nccl_communicator(MPI_Comm)", problem);
        std::string failed;
        for (int r = 0; r < size; ++r)
            if (ex->ok[static_cast<std::size_t>(r) + 1] == 0)
                failed += (failed.empty() ? "" : ", ") + std::to_string(r);
        LOCKSTEP_REQUIRE(failed.empty(), errc::peer_failure, rank, "nccl_communicator(MPI_Comm)",
                         "process(es) ", failed,
                         " of the communicator have no usable NCCL library, CUDA device, "
                         "stream or NCCL id (they report why)");
        probe.broadcast(
            std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(&ex->id), sizeof(ex->id)), 0);
    } catch (...) {
        if (probe.broken())
            keep_forever(ex.release());
        throw;
    }
    return nccl_init_rank(ex->id, size, rank, device, stream, timeout);
}

/// nccl_communicator::local_device: this process's rank among the processes of `comm` on its
/// node, modulo the node's device count. requires: a CUDA device exists (else errc::cuda).
inline int nccl_local_device(MPI_Comm comm) {
    MPI_Comm node = MPI_COMM_NULL;
    LOCKSTEP_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    int local_rank = 0;
    const int rc = MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    LOCKSTEP_MPI_CHECK(rc);
    const int devices = cuda_device_count();
    LOCKSTEP_REQUIRE(devices > 0, errc::cuda, local_rank, "nccl_communicator.local_device",
                     "no CUDA device on this node");
    return local_rank % devices;
}
#endif

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

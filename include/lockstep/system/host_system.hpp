// lockstep/system/host_system.hpp: host memory and Thrust's OpenMP (or serial CPP) execution.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/detail/host_cores.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/system/system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include <thrust/system/cpp/execution_policy.h>
#if LOCKSTEP_HAS_OPENMP
#include <omp.h>
#include <thrust/system/omp/execution_policy.h>
#endif

namespace lockstep {

namespace host {
/// host_system's (empty) base: it makes namespace lockstep::host an associated namespace of
/// host_system, so that argument-dependent lookup on a host_system finds the host overloads
/// declared there (the batch-norm operations of kernels/detail/bn_host_path.hpp, copy_bytes
/// below) and lookup on any other lockstep type does not. A base rather than moving the class
/// keeps host_system's name (lockstep::host_system, as errors and type names print it).
struct adl_tag {
    friend constexpr bool operator==(const adl_tag&, const adl_tag&) = default;
};
} // namespace host

/// Where memory lives and kernels run: host memory, kernels through Thrust's OpenMP system
/// (the serial CPP system when OpenMP is absent). A host_system is a cheap value: it carries
/// only its thread budget, so replicas running as threads of one process do not oversubscribe
/// the cores.
class host_system : public host::adl_tag {
public:
    /// True for systems whose memory the host may dereference.
    static constexpr bool is_host = true;
    /// Bytes every allocation is aligned to (a cache line, and enough for vector loads).
    static constexpr std::size_t alignment = 64;

    /// threads: the OpenMP threads of its loops; 0 or less means default_threads(1).
    explicit host_system(int threads = 0) : threads_(threads > 0 ? threads : default_threads(1)) {}

    /// OMP_NUM_THREADS's first value when it is a positive number (OpenMP's convention: the
    /// threads of one process; "4,2" gives 4), else 0.
    static int omp_env_threads() noexcept {
        const char* env = std::getenv("OMP_NUM_THREADS"); // NOLINT(concurrency-mt-unsafe)
        if (env == nullptr)
            return 0;
        long n = 0;
        for (; *env >= '0' && *env <= '9' && n < (1L << 20); ++env)
            n = 10 * n + (*env - '0');
        return *env == '\0' || *env == ',' ? static_cast<int>(n) : 0;
    }
    /// The threads of a process that shares its node with `processes_on_node` processes:
    /// OMP_NUM_THREADS when set, else the cores this process may use divided among them (>= 1).
    static int process_threads(int processes_on_node) {
        if (const int env = omp_env_threads(); env > 0)
            return env;
        return std::max(1, hardware_threads() / std::max(1, processes_on_node));
    }
    /// The threads of each of `replicas_in_process` replicas that share this process: the
    /// process's threads (OMP_NUM_THREADS when set, else the cores it may use divided among the
    /// processes of its job on this node, node_processes()) divided among them (>= 1). A thread
    /// group inside each of several MPI processes so does not oversubscribe the cores, where
    /// OpenMP's spinning barriers can cost a time slice each.
    static int default_threads(int replicas_in_process) {
        return std::max(1, process_threads(node_processes()) / std::max(1, replicas_in_process));
    }

    /// The cores this process may use (>= 1), asked once per process: the machine's hardware
    /// threads capped by the process's affinity mask and its cgroup's CPU quota
    /// (detail/host_cores.hpp). Asked once: reading them costs more than a small MPI
    /// all_reduce, and communicators ask on every collective.
    static int hardware_threads() noexcept {
        static const int n = [] {
            try {
                return detail::usable_cores();
            } catch (...) { // reading the cgroup files failed: the hardware count alone
                return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
            }
        }();
        return n;
    }
    /// The processes of this job on this node, as the launcher's environment tells them
    /// (mpiexec's MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, ...; 1 when none), read
    /// once per process. An mpi_communicator counts them exactly (MPI's shared-memory split).
    static int node_processes() noexcept {
        static const int n = detail::launcher_local_processes(
            [](const char* name) { return std::getenv(name); }); // NOLINT(concurrency-mt-unsafe)
        return n;
    }

    /// The number of OpenMP threads a kernel of this system may use.
    int threads() const noexcept { return threads_; }

    /// The Thrust execution policy kernels of this system run with. Sets the calling thread's
    /// OpenMP thread budget first (an ICV of the calling thread only, so replicas on other
    /// threads keep theirs).
    auto policy() const {
#if LOCKSTEP_HAS_OPENMP
        omp_set_num_threads(threads_);
        return thrust::omp::par;
#else
        return thrust::cpp::par;
#endif
    }

    /// Waits until every kernel of this system has finished (host kernels are synchronous, so
    /// this only counts a host synchronisation, as the CUDA system's would).
    void synchronize() const noexcept {
        detail::count_host_sync();
    }

    /// Allocates bytes of host memory aligned to `alignment`. ensures: non-null or throws.
    void* allocate(std::size_t bytes) const {
        if (bytes == 0)
            return nullptr;
        return ::operator new (bytes, std::align_val_t{alignment});
    }
    /// Frees memory from allocate().
    void deallocate(void* p, std::size_t /*bytes*/) const noexcept {
        if (p != nullptr)
            ::operator delete (p, std::align_val_t{alignment});
    }

    friend bool operator==(const host_system&, const host_system&) = default;

private:
    int threads_;
};

static_assert(execution_system<host_system>);

/// The system a component uses when the caller names none: host_system{} for a host system. A
/// device system has no sensible default (cuda_system{} would be device 0's legacy default
/// stream, silently apart from the replica's stream), so omitting it fails to compile.
template <execution_system System>
System default_system() {
    static_assert(System::is_host,
                  "lockstep: a component on a device system needs the replica's system passed "
                  "explicitly (comm.system()); a default cuda_system would be device 0's legacy "
                  "default stream, unordered with the replica's stream.");
    return System{};
}

namespace host {
/// Copies bytes between two host allocations. Found by argument-dependent lookup from
/// lockstep::copy (system/buffer.hpp), as other systems' copy_bytes are.
inline void copy_bytes(void* dst, const host_system&, const void* src, const host_system&,
                       std::size_t bytes) {
    if (bytes != 0)
        std::memmove(dst, src, bytes);
}
/// Copies bytes within the host system's memory, in order with its kernels (at once: host
/// kernels are synchronous). Found by argument-dependent lookup from lockstep::copy_async.
inline void copy_bytes_async(void* dst, const void* src, std::size_t bytes, const host_system&) {
    if (bytes != 0)
        std::memmove(dst, src, bytes);
}
} // namespace host

} // namespace lockstep

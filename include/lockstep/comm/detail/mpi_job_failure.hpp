// lockstep/comm/detail/mpi_job_failure.hpp: what the groups of replica threads in every MPI
// process (hierarchical_group, gpu_hierarchical_group) share: the thread level they need, and
// how a replica thread ends the job on a failure. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>

namespace lockstep::detail {

/// Throws errc::unsupported (naming `group` and process rank `process`) unless MPI provides
/// MPI_THREAD_MULTIPLE: the replica threads of a process call MPI at the same time.
inline void require_thread_multiple(const char* group, int process) {
    int level = MPI_THREAD_SINGLE;
    LOCKSTEP_MPI_CHECK(MPI_Query_thread(&level));
    LOCKSTEP_REQUIRE(level == MPI_THREAD_MULTIPLE, errc::unsupported, process, group,
                     "MPI provides thread level ", level, ", this needs MPI_THREAD_MULTIPLE (",
                     MPI_THREAD_MULTIPLE,
                     "): initialise MPI with mpi_environment(argc, argv, "
                     "{.requested = MPI_THREAD_MULTIPLE, .required = MPI_THREAD_MULTIPLE})");
}

/// True when e is errc::peer_failure: it only echoes another replica's failure, and that
/// replica ends the job with the root cause, so this one just leaves.
inline bool echoes_peer(const std::exception& e) {
    const auto* le = dynamic_cast<const lockstep::error*>(&e);
    return le != nullptr && le->code() == errc::peer_failure;
}

/// Prints "lockstep: <group> process P <unit> <index> aborting: <what>" to stderr (P: this
/// process's rank in MPI_COMM_WORLD) and ends every process of the job with MPI_Abort, its
/// status exit_status(e) (75 for a timeout or a transport failure: tools/lockstep-run relaunches).
[[noreturn]] inline void abort_mpi_job(const char* group, const char* unit, int index,
                                       const std::exception& e) {
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::fprintf(stderr, "lockstep: %s process %d %s %d aborting: %s\n", group, rank, unit, index,
                 e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, exit_status(e));
    std::abort();
}

/// What abort_mpi_job is given for a thrown value that is no std::exception.
inline std::runtime_error non_standard_exception() {
    return std::runtime_error("a thrown value that is no std::exception");
}

} // namespace lockstep::detail

// lockstep/comm/detail/mpi_job_failure.hpp: what the groups of replica threads in every MPI
// process (hierarchical_group, gpu_hierarchical_group) share: the thread level they need, the
// processes' agreement on their replica counts, and how a replica thread ends the job on a
// failure. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/core/error.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

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

/// The agreement a group makes before it builds anything over comm (collective): every process
/// gives its replica count, or its own setup's failure (`failure`, count ignored), through one
/// all_gather over a duplicate of comm made for that (polled within p.timeout, so no later
/// call's number moves). Then every process throws when any failed or the counts differ: its
/// own failure, else errc::peer_failure naming the process that failed, else
/// errc::invalid_argument naming each process's count (`unit`: what is counted, "replica
/// threads"; `fix`: what to do about it). Returns when every process gives `count`.
inline void agree_replica_counts(MPI_Comm comm, int count, const std::exception_ptr& failure,
                                 const mpi_communicator_params& p, const char* group,
                                 const char* unit, const char* fix) {
    mpi_communicator probe(comm, p);
    std::vector<int> counts(static_cast<std::size_t>(probe.size()));
    const int mine[] = {failure ? 0 : count}; // 0: this process failed
    probe.all_gather(std::span<const int>(mine), std::span<int>(counts));
    if (failure)
        std::rethrow_exception(failure);
    const auto failed = std::ranges::find(counts, 0);
    LOCKSTEP_REQUIRE(failed == counts.end(), errc::peer_failure, probe.rank(), group, "process ",
                     failed - counts.begin(), " could not set up its replicas (it reports why)");
    if (std::ranges::all_of(counts, [&](int c) { return c == count; }))
        return;
    std::string list;
    for (std::size_t i = 0; i < counts.size(); ++i)
        list += concat(i == 0 ? "" : ", ", "process ", i, " runs ", counts[i]);
    throw error(errc::invalid_argument, probe.rank(), group,
                concat("the processes run different numbers of ", unit, " (", list, "): ", fix));
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

/// Runs a group's replica threads (`run_threads()`, which joins them and rethrows their root
/// failure). When it throws and `abort` is set (params::abort_on_failure), ends the job through
/// abort_mpi_job (the error's replica when it names one: unit "replica" for a
/// hierarchical_communicator's error, else "thread") before the error could
/// reach the caller: a replica that threw has ended the job already unless its error only
/// echoed another's (errc::peer_failure), so this is a failure no replica ended it for, e.g. a
/// replica thread that returned while its process's other replicas waited for it in a collective
/// (they throw errc::peer_failure naming it as having left), and the other processes may be
/// waiting for this one in an inter-node step, which only the end of the job releases.
template <class F>
void run_or_end_job(const char* group, bool abort, F&& run_threads) {
    try {
        run_threads();
    } catch (const std::exception& e) {
        if (abort) {
            // A hierarchical_communicator's error names the replica's rank in the whole job,
            // the intra-node part's own error its thread (local rank).
            const auto* le = dynamic_cast<const lockstep::error*>(&e);
            const bool global =
                le != nullptr && le->operation().starts_with("hierarchical_communicator.");
            abort_mpi_job(group, global ? "replica" : "thread", le != nullptr ? le->replica() : -1,
                          e);
        }
        throw;
    } catch (...) {
        if (abort)
            abort_mpi_job(group, "thread", -1, non_standard_exception());
        throw;
    }
}

} // namespace lockstep::detail

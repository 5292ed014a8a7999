// lockstep/comm/detail/mpi_exit_guard.hpp: mpi_exit_guard, which turns a process exit while
// lockstep's MPI objects are alive into MPI_Abort. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if !LOCKSTEP_HAS_MPI
#error                                                                                             \
    "lockstep/comm/detail/mpi_exit_guard.hpp needs MPI: link lockstep::mpi (or define LOCKSTEP_HAS_MPI=1 and add MPI's include path)."
#endif

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include <mpi.h>

namespace lockstep::detail {

/// The number of live mpi_exit_guard objects in this process. Constant-initialised and
/// trivially destructible, so it is valid inside exit handlers at any point of shutdown.
inline std::atomic<long> mpi_live_guards{0};

/// The exit handler: a rank that calls exit() while a guard lives (and MPI is initialised and
/// not finalised) would end with status 0 and leave its peers in a collective, which mpiexec
/// may report as success once it kills them. It aborts the job instead, so that mpiexec
/// reports failure every time.
inline void mpi_exit_check() noexcept {
    if (mpi_live_guards.load() == 0)
        return;
    int initialized = 0, finalized = 0;
    if (MPI_Initialized(&initialized) != MPI_SUCCESS || !initialized)
        return;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized)
        return;
    int rank = -1;
    if (MPI_Comm_rank(MPI_COMM_WORLD, &rank) != MPI_SUCCESS)
        rank = -1;
    std::fprintf(stderr,
                 "lockstep: rank %d exited while its MPI communicator was alive (not finalized); "
                 "aborting the job\n",
                 rank);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/// A member of mpi_environment and mpi_communicator: counts the live objects and registers
/// mpi_exit_check once per process with std::atexit and std::at_quick_exit. A handler
/// registered while a static object is being constructed runs after that object's destructor,
/// so a normal end (return from main, static MPI objects destroyed) never aborts.
/// Not caught: _exit, _Exit and death by a signal skip every handler (a signal gives a
/// non-zero status anyway; _exit(0) does not, so do not call it while MPI objects live).
class mpi_exit_guard {
public:
    mpi_exit_guard() noexcept {
        [[maybe_unused]] static const bool registered = [] {
            const bool at_exit = std::atexit(&mpi_exit_check) == 0;
            const bool at_quick_exit = std::at_quick_exit(&mpi_exit_check) == 0;
            return at_exit && at_quick_exit;
        }();
        mpi_live_guards.fetch_add(1);
    }
    mpi_exit_guard(const mpi_exit_guard&) noexcept : mpi_exit_guard() {}
    mpi_exit_guard& operator=(const mpi_exit_guard&) noexcept = default;
    ~mpi_exit_guard() { mpi_live_guards.fetch_sub(1); }
};

} // namespace lockstep::detail

// lockstep/comm/mpi_environment.hpp: mpi_environment, the RAII owner of MPI_Init_thread and
// MPI_Finalize. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if !LOCKSTEP_HAS_MPI
#error                                                                                             \
    "lockstep/comm/mpi_environment.hpp needs MPI: link lockstep::mpi (or define LOCKSTEP_HAS_MPI=1 and add MPI's include path)."
#endif

#include "lockstep/comm/detail/mpi_exit_guard.hpp"
#include "lockstep/core/error.hpp"

#include <mpi.h>

#include <string>

namespace lockstep {

/// The thread levels mpi_environment asks for and needs.
struct mpi_environment_params {
    /// The level asked of MPI_Init_thread (raised to `required` when below it).
    int requested = MPI_THREAD_SERIALIZED;
    int required = MPI_THREAD_FUNNELED; ///< below this level the constructor throws
};

/// RAII owner of the MPI library: MPI_Init_thread in the constructor, MPI_Finalize in the
/// destructor. If MPI is already initialised (by the user or another library) it does neither
/// and only records the thread level MPI provides.
///
/// The default request is MPI_THREAD_SERIALIZED: lockstep calls MPI from one thread at a time
/// per process, and on this machine's MPICH 4.0 MPI_THREAD_MULTIPLE made a 4-byte
/// MPI_Allreduce about 1 us (~30%) slower. Ask for `.requested = MPI_THREAD_MULTIPLE` when
/// other threads of the process call MPI concurrently.
///
/// Exit: a process that calls exit() or quick_exit() while an mpi_environment or an
/// mpi_communicator lives and MPI is not finalised prints "lockstep: rank R exited while its MPI
/// communicator was alive (not finalized); aborting the job" and calls MPI_Abort, so mpiexec
/// reports failure instead of success with the peers killed mid-collective. _exit() and signals
/// skip every handler and cannot be caught (detail/mpi_exit_guard.hpp).
class mpi_environment {
public:
    using params = mpi_environment_params;

    /// requires: argc/argv as main received them (MPI may remove its own arguments).
    /// ensures: MPI is initialised with thread_level() >= p.required, or throws lockstep::error
    /// (errc::unsupported) after finalising what it initialised.
    mpi_environment(int& argc, char**& argv, params p = {}) { init(&argc, &argv, p); }
    /// As above, without command-line arguments.
    explicit mpi_environment(params p) { init(nullptr, nullptr, p); }
    mpi_environment() { init(nullptr, nullptr, params{}); }
    mpi_environment(const mpi_environment&) = delete;
    mpi_environment& operator=(const mpi_environment&) = delete;
    ~mpi_environment() {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (owns_ && !finalized)
            MPI_Finalize();
    }

    /// The thread level MPI provides (MPI_THREAD_SINGLE .. MPI_THREAD_MULTIPLE).
    int thread_level() const noexcept { return provided_; }
    /// True when this object initialised MPI and will finalise it.
    bool owns() const noexcept { return owns_; }

private:
    void init(int* argc, char*** argv, params p) {
        int initialized = 0, finalized = 0;
        LOCKSTEP_MPI_CHECK(MPI_Initialized(&initialized));
        LOCKSTEP_MPI_CHECK(MPI_Finalized(&finalized));
        LOCKSTEP_REQUIRE(!finalized, errc::invalid_argument, -1, "mpi_environment",
                         "MPI was already finalised and cannot be initialised again");
        const int requested = p.requested < p.required ? p.required : p.requested;
        if (initialized) {
            LOCKSTEP_MPI_CHECK(MPI_Query_thread(&provided_));
        } else {
            LOCKSTEP_MPI_CHECK(MPI_Init_thread(argc, argv, requested, &provided_));
            owns_ = true;
        }
        if (provided_ < p.required) {
            const bool ours = owns_;
            if (owns_)
                MPI_Finalize();
            owns_ = false;
            fail(errc::unsupported, -1, "mpi_environment", "MPI provides thread level ", provided_,
                 " but level ", p.required, " is required (0 single, 1 funneled, 2 serialized, ",
                 "3 multiple); ",
                 ours ? detail::concat("MPI_Init_thread was asked for level ", requested,
                                       ": this MPI library does not provide it")
                      : std::string("MPI was initialised before, at that level: initialise it "
                                    "with MPI_Init_thread at the required level, or let "
                                    "mpi_environment do it"));
        }
    }

    int provided_ = MPI_THREAD_SINGLE;
    bool owns_ = false;
    detail::mpi_exit_guard exit_guard_;
};

} // namespace lockstep

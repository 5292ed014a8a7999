// tests/support/mpi_session.hpp: the body of every MPI test main: Catch2 on each rank, a rank
// that throws aborts the job, and every rank exits non-zero when any rank failed.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/mpi_environment.hpp"

#include <catch2/catch.hpp>
#include <mpi.h>

#include <cstdio>
#include <exception>

namespace lockstep::testing {

/// Runs the Catch2 session of an MPI test on this rank (the file defines CATCH_CONFIG_RUNNER).
/// ensures: returns 1 on every rank when any rank failed, else 0; a rank whose session throws
/// prints the error and calls MPI_Abort, so no peer is left waiting.
inline int run_mpi_session(int argc, char** argv, lockstep::mpi_environment_params p = {}) {
    lockstep::mpi_environment env(argc, argv, p);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    Catch::Session session;
    int failed = 0;
    try {
        failed = session.run(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "replica %d: %s\n", rank, e.what());
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    int any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any != 0 && failed == 0)
        std::fprintf(stderr, "replica %d: passed, but another replica failed\n", rank);
    return any != 0 ? 1 : 0;
}

} // namespace lockstep::testing

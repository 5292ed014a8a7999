// The session of the MPI test executables, compiled once and linked into each of them (each
// defines main() calling run_mpi_session with its MPI thread level); Catch2's implementation is
// in tests/catch2_session.cpp. SPDX-License-Identifier: Apache-2.0
#include "support/catch2_session.hpp"
#include "support/mpi_session.hpp"

#include <mpi.h>

#include <cstdio>
#include <exception>

namespace lockstep::testing {

int run_mpi_session(int argc, char** argv, lockstep::mpi_environment_params p) {
    lockstep::mpi_environment env(argc, argv, p);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int failed = 0;
    try {
        failed = run_catch2(argc, argv);
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

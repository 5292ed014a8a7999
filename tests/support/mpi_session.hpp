// tests/support/mpi_session.hpp: the body of every MPI test main: Catch2 on each rank, a rank
// that throws aborts the job, and every rank exits non-zero when any rank failed.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/mpi_environment.hpp"

namespace lockstep::testing {

/// Runs the Catch2 session of an MPI test on this rank. Defined once, in tests/mpi_test_main.cpp
/// (linked into every MPI test executable, with Catch2's implementation from
/// tests/catch2_session.cpp), so no test translation unit compiles Catch2's implementation.
/// ensures: returns 1 on every rank when any rank failed, else 0; a rank whose session throws
/// prints the error and calls MPI_Abort, so no peer is left waiting.
int run_mpi_session(int argc, char** argv, lockstep::mpi_environment_params p = {});

} // namespace lockstep::testing

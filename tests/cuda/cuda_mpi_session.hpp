// The main of the CUDA tests run under mpiexec (one process per GPU): MPI with
// MPI_THREAD_MULTIPLE, a Catch2 session on every rank, one verdict for the whole job.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "cuda_test_support.hpp"

#include "lockstep/system/cuda_system.hpp"

#include <catch2/catch.hpp>

#include <mpi.h>

#include <cstdio>

namespace lockstep_test {

#ifdef CATCH_CONFIG_RUNNER // Catch::Session exists only where the test main is defined
/// Initialises MPI (MPI_THREAD_MULTIPLE; exit code 2 when that fails) and runs the Catch2 cases
/// on every rank. Without a CUDA device on every rank only the cases not tagged [gpu] run
/// (unless a test spec was given), every rank agreeing, and a job that passed returns
/// skip_return_code (CTest: skipped). The result is the worst over the ranks, so a failure on
/// one rank fails the job.
inline int run_cuda_mpi_session(int argc, char** argv) {
    int provided = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
        return 2;
    int mine = lockstep::cuda_device_count() > 0 ? 1 : 0, gpus_everywhere = 0;
    MPI_Allreduce(&mine, &gpus_everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int result = 0;
    {
        Catch::Session session;
        result = session.applyCommandLine(argc, argv);
        if (result == 0 && !gpus_everywhere && session.configData().testsOrTags.empty())
            session.configData().testsOrTags.emplace_back("~[gpu]");
        if (result == 0)
            result = session.run();
    }
    // Every rank must agree on failure, or CTest sees a half-failed job as passed.
    int worst = 0;
    MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    if (worst == 0 && !gpus_everywhere) {
        if (rank == 0)
            std::printf("no CUDA device on every rank: the GPU cases were not run (skipped)\n");
        return skip_return_code;
    }
    return worst;
}
#endif

} // namespace lockstep_test

// The main of the CUDA tests run under mpiexec (one process per GPU), compiled by the host
// compiler (Catch2's implementation is in tests/catch2_session.cpp): MPI with
// MPI_THREAD_MULTIPLE (exit code 2 when that fails), a Catch2 session on every rank, one verdict
// for the whole job. Without a CUDA device on every rank only the cases not tagged [gpu] run
// (unless a test spec was given), every rank agreeing, and a job that passed returns
// skip_return_code (CTest: skipped). The result is the worst over the ranks, so a failure on one
// rank fails the job. SPDX-License-Identifier: Apache-2.0
#include "cuda_test_main.hpp"
#include "support/catch2_session.hpp"

#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
    int provided = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
        return 2;
    int mine = lockstep_test::device_count() > 0 ? 1 : 0, gpus_everywhere = 0;
    MPI_Allreduce(&mine, &gpus_everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const int result =
        lockstep::testing::run_catch2(argc, argv, gpus_everywhere ? nullptr : "~[gpu]");
    // Every rank must agree on failure, or CTest sees a half-failed job as passed.
    int worst = 0;
    MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    if (worst == 0 && !gpus_everywhere) {
        if (rank == 0)
            std::printf("no CUDA device on every rank: the GPU cases were not run (skipped)\n");
        return lockstep_test::skip_return_code;
    }
    return worst;
}

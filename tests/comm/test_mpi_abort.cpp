// A replica that fails calls mpi_communicator::abort: the job ends instead of the peers waiting
// forever in their next collective. Run as `mpiexec -n 2 test_mpi_abort <result-dir>`: every
// rank writes "passed all_reduce #1" to <result-dir>/rank<r>.txt, the failing one "aborting"
// before its abort, and a peer that catches an error itself (the abort did not reach it) "bad";
// CTest checks the files and a non-zero exit status that is not `timeout`'s (MPI_Abort's output
// can be lost when the job is torn down, files are not). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/mpi_communicator.hpp"

#include <cstdio>
#include <fstream>
#include <span>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    lockstep::mpi_environment env(argc, argv);
    if (argc < 2) {
        std::fprintf(stderr, "usage: test_mpi_abort <result-dir>\n");
        return 2;
    }
    lockstep::mpi_communicator comm(MPI_COMM_WORLD);
    const bool culprit = comm.rank() == comm.size() - 1;
    auto record = [&](const std::string& line) {
        std::ofstream f(std::string(argv[1]) + "/rank" + std::to_string(comm.rank()) + ".txt",
                        std::ios::app);
        f << line << '\n';
    };
    try {
        std::vector<float> x(16, 1.0f);
        comm.all_reduce(std::span<const float>(x), std::span<float>(x), lockstep::reduce_op::sum);
        record("passed all_reduce #1");
        // Every rank's record is written before the culprit can abort the job.
        comm.barrier();
        // The last replica fails between collectives; the others go on into the next one,
        // where only MPI_Abort can reach them.
        if (culprit)
            lockstep::fail(lockstep::errc::internal, comm.rank(), "step 2", "deliberate failure");
        comm.all_reduce(std::span<const float>(x), std::span<float>(x), lockstep::reduce_op::sum);
        record("bad: finished although a peer failed");
        std::printf("replica %d: finished although a peer failed\n", comm.rank());
    } catch (const std::exception& e) {
        record(culprit ? "aborting" : std::string("bad: caught ") + e.what());
        comm.abort(e);
    }
    return 0;
}

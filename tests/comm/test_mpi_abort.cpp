// A replica that fails calls mpi_communicator::abort: the job ends instead of the peers waiting
// forever in their next collective. CTest passes when the abort message appears (the exit code
// is non-zero by design). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/mpi_communicator.hpp"

#include <cstdio>
#include <span>
#include <vector>

int main(int argc, char** argv) {
    lockstep::mpi_environment env(argc, argv);
    lockstep::mpi_communicator comm(MPI_COMM_WORLD);
    try {
        std::vector<float> x(16, 1.0f);
        comm.all_reduce(std::span<const float>(x), std::span<float>(x), lockstep::reduce_op::sum);
        // The last replica fails between collectives; the others go on into the next one,
        // where only MPI_Abort can reach them.
        if (comm.rank() == comm.size() - 1)
            lockstep::fail(lockstep::errc::internal, comm.rank(), "step 2", "deliberate failure");
        comm.all_reduce(std::span<const float>(x), std::span<float>(x), lockstep::reduce_op::sum);
        std::printf("replica %d: finished although a peer failed\n", comm.rank());
    } catch (const std::exception& e) {
        comm.abort(e);
    }
    return 0;
}

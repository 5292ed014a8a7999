// A rank that calls exit(0) (or quick_exit(0)) while its mpi_communicator lives ends the job
// through MPI_Abort, so mpiexec reports failure every time; a run where no rank exits early still
// ends with status 0. Modes: exit, quick_exit, finish. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/mpi_communicator.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>
#include <vector>

int main(int argc, char** argv) {
    lockstep::mpi_environment env(argc, argv);
    const std::string_view mode = argc > 1 ? argv[1] : "exit";
    // The survivor must be ended by MPI_Abort, not by its own timeout: 20 s would show up as a
    // CTest timeout (the loop's limit), never as a pass.
    lockstep::mpi_communicator comm(MPI_COMM_WORLD,
                                    {.timeout = std::chrono::seconds(20),
                                     .on_failure = lockstep::mpi_failure_action::throw_error});
    std::vector<float> x(16, 1.0f);
    const auto sum = [&] {
        comm.all_reduce(std::span<const float>(x), std::span<float>(x), lockstep::reduce_op::sum);
    };
    try {
        sum(); // every rank is inside the job
        if (comm.rank() == 1 && mode == "exit")
            std::exit(0);
        if (comm.rank() == 1 && mode == "quick_exit")
            std::quick_exit(0);
        sum(); // rank 0 waits here for the rank that left
    } catch (const std::exception& e) {
        // The guard's MPI_Abort should have ended this rank first (CTest fails on this line).
        std::printf("rank %d: caught an error instead of the abort: %s\n", comm.rank(), e.what());
        return 3;
    }
    if (mode != "finish")
        std::printf("rank %d: finished although a peer exited\n", comm.rank());
    return 0;
}

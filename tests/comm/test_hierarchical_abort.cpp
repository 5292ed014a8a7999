// A hierarchical_group replica thread that returns while the others wait for it in a collective
// ends the job (abort_on_failure, the default): its process's other replicas only echo its
// departure (errc::peer_failure), so no replica aborts for it, and the other process waits in an
// inter-node step that only the end of the job releases. Run as `mpiexec -n 2
// test_hierarchical_abort <result-dir>` (2 threads per process, an MPI timeout of 60 s): every
// replica writes "passed all_reduce #1" to <result-dir>/rank<r>.txt, the last replica
// "returning" before it returns, and a process whose run() hands the error back "bad"; CTest
// checks the files and a non-zero exit status that is not `timeout 30`'s (124: the job was not
// ended, the other process waited for its MPI timeout). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/hierarchical_group.hpp"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <span>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    lockstep::mpi_environment env(
        argc, argv, {.requested = MPI_THREAD_MULTIPLE, .required = MPI_THREAD_MULTIPLE});
    if (argc < 2) {
        std::fprintf(stderr, "usage: test_hierarchical_abort <result-dir>\n");
        return 2;
    }
    const std::string dir = argv[1];
    const auto record = [&](int replica, const std::string& line) {
        std::ofstream f(dir + "/rank" + std::to_string(replica) + ".txt", std::ios::app);
        f << line << '\n';
    };
    lockstep::hierarchical_group_params p;
    p.mpi.timeout = std::chrono::seconds(60);
    lockstep::hierarchical_group group(MPI_COMM_WORLD, 2, p);
    int process = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &process);
    try {
        group.run([&](lockstep::hierarchical_group::communicator_type& comm) {
            std::vector<float> x(16, 1.0f);
            comm.all_reduce(std::span<const float>(x), std::span<float>(x),
                            lockstep::reduce_op::sum);
            record(comm.rank(), "passed all_reduce #1");
            if (comm.rank() == comm.size() - 1) {
                record(comm.rank(), "returning");
                return; // leaves its process's other replica waiting in all_reduce #2
            }
            comm.all_reduce(std::span<const float>(x), std::span<float>(x),
                            lockstep::reduce_op::sum);
            record(comm.rank(), "bad: finished although a replica returned early");
        });
        record(2 * process, "bad: run() returned");
    } catch (const std::exception& e) {
        record(2 * process, std::string("bad: run() threw instead of ending the job: ") + e.what());
    }
    return 0;
}

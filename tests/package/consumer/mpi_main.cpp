// A consumer of lockstep's mpi component: every rank all_reduces differing data; checks the sum.
// SPDX-License-Identifier: Apache-2.0
#include <lockstep/comm/mpi_communicator.hpp>
#include <lockstep/system/buffer.hpp>

#include <cstdio>

#if !LOCKSTEP_HAS_MPI
#error "lockstep::mpi must define LOCKSTEP_HAS_MPI"
#endif

int main(int argc, char** argv) {
    lockstep::mpi_environment env(argc, argv);
    lockstep::mpi_communicator comm(MPI_COMM_WORLD);
    constexpr std::size_t n = 101;
    const int r = comm.rank();
    const int p = comm.size();
    lockstep::buffer<int> send(n, comm.system());
    lockstep::buffer<int> recv(n, comm.system());
    for (std::size_t i = 0; i < n; ++i)
        send[i] = (r + 1) * static_cast<int>(i);
    const auto& csend = send; // the send side is a std::span<const int>
    comm.all_reduce(csend.span(), recv.span(), lockstep::reduce_op::sum);
    int bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
        if (recv[i] != static_cast<int>(i) * p * (p + 1) / 2)
            ++bad;
    }
    std::printf("rank %d of %d: all_reduced %zu ints, %d wrong\n", r, p, n, bad);
    return bad == 0 ? 0 : 1;
}

// A consumer of the lockstep package: 4 replicas all_reduce differing data and check the sum.
// SPDX-License-Identifier: Apache-2.0
#include <lockstep/comm/thread_group.hpp>
#include <lockstep/system/buffer.hpp>

#include <cstdio>
#include <vector>

#if !LOCKSTEP_HAS_OPENMP
#error "lockstep::openmp must put the host system on Thrust's OpenMP backend"
#endif

int main() {
    constexpr int replicas = 4;
    constexpr std::size_t n = 1009; // prime: no replica owns an even share
    std::vector<int> failures(replicas, 0);
    lockstep::thread_group group(replicas);
    group.run([&](lockstep::thread_communicator& comm) {
        const int r = comm.rank();
        lockstep::buffer<double> send(n, comm.system());
        lockstep::buffer<double> recv(n, comm.system());
        for (std::size_t i = 0; i < n; ++i)
            send[i] = static_cast<double>((r + 1) * i);
        const auto& csend = send; // the send side is a std::span<const double>
        comm.all_reduce(csend.span(), recv.span(), lockstep::reduce_op::sum);
        // sum over r of (r + 1) * i = i * replicas * (replicas + 1) / 2, exact in double.
        for (std::size_t i = 0; i < n; ++i) {
            if (recv[i] != static_cast<double>(i * replicas * (replicas + 1) / 2))
                ++failures[r];
        }
    });
    int bad = 0;
    for (int f : failures)
        bad += f;
    std::printf("lockstep %d.%d.%d consumer: %d replicas all_reduced %zu doubles, %d wrong\n",
                lockstep::version.major, lockstep::version.minor, lockstep::version.patch, replicas,
                n, bad);
    return bad == 0 ? 0 : 1;
}

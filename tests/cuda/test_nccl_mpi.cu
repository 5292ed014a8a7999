// Tests of nccl_communicator bootstrapped through MPI (one process per GPU), run by CTest under
// mpiexec with the MPI main of the CUDA tests (cuda_mpi_test_main.cpp). GPU cases skip on every
// rank unless every rank has a GPU; then the job exits with lockstep_test::skip_return_code on
// every rank (CTest: skipped).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/buffer.hpp"

#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <mpi.h>

#include <cstdio>
#include <vector>

namespace {

using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::host_system;
using lockstep::nccl_communicator;
using lockstep::reduce_op;

int world_rank() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}
int world_size() {
    int s = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &s);
    return s;
}

/// True on every rank when some rank has no GPU (all ranks skip together, so nobody waits).
bool any_rank_without_gpu() {
    int mine = lockstep::cuda_device_count() > 0 ? 1 : 0, all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (all == 1)
        return false;
    WARN("no CUDA device on every rank: skipped");
    return true;
}

// Small integers plus quarters: every partial sum is exact in float and double.
double input_value(int rank, std::size_t i) {
    return static_cast<double>(static_cast<int>((rank * 131 + i * 7) % 23) - 11) +
           0.25 * static_cast<double>(i % 3);
}

template <class T>
buffer<T, cuda_system> device_input(int rank, std::size_t n, const cuda_system& sys) {
    buffer<T, host_system> h(n);
    for (std::size_t i = 0; i < n; ++i)
        h[i] = static_cast<T>(input_value(rank, i));
    buffer<T, cuda_system> d(n, sys);
    lockstep::copy(h, d);
    return d;
}

template <class T>
buffer<T, host_system> to_host(const buffer<T, cuda_system>& d) {
    buffer<T, host_system> h(d.size());
    lockstep::copy(d, h);
    return h;
}

} // namespace

TEST_CASE("an unusable device on one process makes every process throw", "[comm][nccl][mpi]") {
    // Rank 1 names a device that never exists; the others name device 0 (which does not exist
    // either on a machine without a GPU). The constructor agrees over MPI before NCCL is
    // entered, so every rank throws and none waits in ncclCommInitRank.
    const int rank = world_rank();
    const bool has_gpu = lockstep::cuda_device_count() > 0;
    int gpus_everywhere = has_gpu ? 1 : 0, tmp = 0;
    MPI_Allreduce(&gpus_everywhere, &tmp, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    gpus_everywhere = tmp;
    const int device = rank == 1 ? -1 : 0;
    try {
        nccl_communicator comm(MPI_COMM_WORLD, device);
        FAIL("the constructor did not throw on rank " << rank);
    } catch (const lockstep::error& e) {
        CHECK(e.replica() == rank);
        if (rank == 1 || !gpus_everywhere)
            CHECK(e.code() == lockstep::errc::invalid_argument);
        else
            CHECK(e.code() == lockstep::errc::peer_failure);
    }
}

TEST_CASE("MPI-bootstrapped NCCL collectives match the host reference", "[comm][nccl][mpi][gpu]") {
    if (any_rank_without_gpu())
        return;
    const int rank = world_rank(), size = world_size();
    // The documented form: one process per GPU, on any number of nodes.
    nccl_communicator comm(MPI_COMM_WORLD, nccl_communicator::local_device(MPI_COMM_WORLD));
    REQUIRE(comm.rank() == rank);
    REQUIRE(comm.size() == size);
    // The replica's device is left current: the caller's kernels go there, and no rank makes a
    // context on another GPU.
    int current = -1;
    REQUIRE(cudaGetDevice(&current) == cudaSuccess);
    CHECK(current == comm.device());
    const std::size_t n = 100003;
    const auto sys = comm.system();

    auto x = device_input<float>(rank, n, sys);
    comm.all_reduce(x.span(), x.span(), reduce_op::sum);
    auto d = device_input<double>(rank, n, sys);
    comm.broadcast(d.span(), size - 1);
    buffer<double, cuda_system> gathered(n * static_cast<std::size_t>(size), sys);
    auto mine = device_input<double>(rank, n, sys);
    comm.all_gather(mine.span(), gathered.span());
    comm.barrier();
    const auto hx = to_host(x);
    const auto hd = to_host(d), hg = to_host(gathered);
    for (std::size_t i = 0; i < n; ++i) {
        double sum = 0;
        for (int q = 0; q < size; ++q)
            sum += input_value(q, i);
        REQUIRE(hx[i] == static_cast<float>(sum));
        REQUIRE(hd[i] == input_value(size - 1, i));
        for (int q = 0; q < size; ++q)
            REQUIRE(hg[static_cast<std::size_t>(q) * n + i] == input_value(q, i));
    }

    // A sub-communicator of the even and the odd ranks.
    nccl_communicator sub = comm.split(rank % 2, rank);
    auto y = device_input<double>(rank, n, sub.system());
    sub.all_reduce(y.span(), y.span(), reduce_op::max);
    sub.synchronize();
    const auto hy = to_host(y);
    for (std::size_t i = 0; i < n; ++i) {
        double mx = input_value(rank % 2, i);
        for (int q = rank % 2; q < size; q += 2)
            mx = std::max(mx, input_value(q, i));
        REQUIRE(hy[i] == mx);
    }
}

TEST_CASE("the MPI constructor adopts the caller's stream", "[comm][nccl][mpi][gpu]") {
    if (any_rank_without_gpu())
        return;
    const int rank = world_rank(), size = world_size();
    const int device = nccl_communicator::local_device(MPI_COMM_WORLD);
    lockstep::cuda_stream mine(device);
    {
        nccl_communicator comm(MPI_COMM_WORLD, device, {}, mine.get());
        REQUIRE(comm.adopted_stream());
        REQUIRE(comm.system().stream() == mine.get());
        const std::size_t n = 517;
        auto x = device_input<double>(rank, n, comm.system());
        comm.all_reduce(x.span(), x.span(), reduce_op::sum);
        comm.synchronize();
        const auto hx = to_host(x);
        for (std::size_t i = 0; i < n; ++i) {
            double sum = 0;
            for (int q = 0; q < size; ++q)
                sum += input_value(q, i);
            REQUIRE(hx[i] == sum);
        }
    }
    // The communicator is gone; the adopted stream still works.
    lockstep::cuda_device_guard guard(device);
    CHECK(cudaStreamQuery(mine.get()) == cudaSuccess);
}

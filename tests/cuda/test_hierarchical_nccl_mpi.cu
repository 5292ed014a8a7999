// hierarchical_communicator<nccl_communicator, mpi_communicator> through gpu_hierarchical_group
// (GPU replicas as threads inside each MPI process, the inter-node steps staged through pinned
// host memory), run by CTest under mpiexec with the MPI main of the CUDA tests
// (cuda_mpi_test_main.cpp): the collectives against exact sums, and data_parallel over it
// against a double-precision reference. GPU cases skip on every rank unless every rank has a GPU;
// then every rank exits with the skip code (CTest: skipped). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/gpu_hierarchical_group.hpp"
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "cuda_test_support.hpp"
#include "gpu_linear_net.hpp"

#include <catch2/catch.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace {

using lockstep::cuda_system;
using lockstep::host_system;
using lockstep::reduce_op;
using group_type = lockstep::gpu_hierarchical_group;
using comm_type = group_type::communicator_type;

static_assert(lockstep::communicator<comm_type>);
static_assert(lockstep::all_to_all_communicator<comm_type>);
static_assert(!lockstep::point_to_point_communicator<comm_type>);
static_assert(std::is_same_v<comm_type::system_type, cuda_system>);
static_assert(!lockstep::communicator_traits<comm_type>::collectives_use_compute_cores);

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

/// This process's devices: an equal share of the visible ones (every process the same count;
/// with fewer devices than processes, processes share device 0 in separate NCCL cliques).
std::vector<int> my_devices() {
    const int count = lockstep::cuda_device_count();
    const int share = std::max(1, count / world_size());
    std::vector<int> d;
    for (int i = 0; i < share; ++i)
        d.push_back(count >= world_size() ? world_rank() * share + i : i % count);
    return d;
}

// Small integers plus quarters: every partial sum is exact in float and double.
double input_value(int rank, std::size_t i) {
    return static_cast<double>(static_cast<int>((rank * 131 + i * 7) % 23) - 11) +
           0.25 * static_cast<double>(i % 3);
}

std::vector<float> input(int rank, std::size_t n) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i)
        v[i] = static_cast<float>(input_value(rank, i));
    return v;
}

lockstep::buffer<float, cuda_system> upload(const std::vector<float>& h, const cuda_system& sys) {
    lockstep::buffer<float, cuda_system> d(h.size(), sys);
    lockstep::copy(std::span<const float>(h), host_system{1}, d.span(), sys);
    return d;
}

std::vector<float> download(std::span<const float> d, comm_type& comm) {
    comm.synchronize(); // polled: a failed peer is an error, not a hang
    std::vector<float> h(d.size());
    lockstep::copy(d, comm.system(), std::span<float>(h), host_system{1});
    return h;
}

/// Mismatches found by the replica threads (Catch2 assertions stay on the main thread).
struct findings {
    std::mutex m;
    std::vector<std::string> errors;
    void check(bool ok, const std::string& what) {
        if (ok)
            return;
        std::lock_guard<std::mutex> lock(m);
        errors.push_back(what);
    }
};

/// The collectives of one replica against sums computed on the host.
void check_collectives(comm_type& comm, findings& f) {
    const int n = comm.size();
    const int me = comm.rank();
    const cuda_system sys = comm.system();
    const std::string who = "rank " + std::to_string(me) + ": ";
    // all_reduce: a small message and one large enough for the reduce-scatter path.
    for (const std::size_t count :
         {std::size_t{5},
          comm_type::sharded_from * static_cast<std::size_t>(comm.local_size()) + 3}) {
        auto d = upload(input(me, count), sys);
        comm.all_reduce<float>(d.span(), d.span(), reduce_op::sum);
        const auto h = download(d.span(), comm);
        bool ok = true;
        for (std::size_t i = 0; i < count; ++i) {
            double sum = 0;
            for (int q = 0; q < n; ++q)
                sum += input_value(q, i);
            ok = ok && h[i] == static_cast<float>(sum);
        }
        f.check(ok, who + "all_reduce of " + std::to_string(count));
    }
    // broadcast from the last rank (another node's replica for most ranks).
    {
        auto d = upload(input(me, 7), sys);
        comm.broadcast(d.span(), n - 1);
        f.check(download(d.span(), comm) == input(n - 1, 7), who + "broadcast");
    }
    // all_gather: every replica's block in global rank order.
    {
        auto send = upload(input(me, 3), sys);
        lockstep::buffer<float, cuda_system> recv(3 * static_cast<std::size_t>(n), sys);
        comm.all_gather<float>(send.span(), recv.span());
        const auto h = download(recv.span(), comm);
        bool ok = true;
        for (int q = 0; q < n; ++q)
            ok = ok && std::equal(h.begin() + 3 * q, h.begin() + 3 * (q + 1), input(q, 3).begin());
        f.check(ok, who + "all_gather");
    }
    // reduce_scatter with uneven counts (rank r receives r + 1 elements).
    {
        std::vector<std::size_t> counts(static_cast<std::size_t>(n));
        std::size_t total = 0, offset = 0;
        for (int r = 0; r < n; ++r) {
            counts[static_cast<std::size_t>(r)] = static_cast<std::size_t>(r) + 1;
            if (r < me)
                offset += counts[static_cast<std::size_t>(r)];
            total += counts[static_cast<std::size_t>(r)];
        }
        auto send = upload(input(me, total), sys);
        lockstep::buffer<float, cuda_system> recv(counts[static_cast<std::size_t>(me)], sys);
        comm.reduce_scatter<float>(send.span(), recv.span(), counts, reduce_op::sum);
        const auto h = download(recv.span(), comm);
        bool ok = true;
        for (std::size_t i = 0; i < h.size(); ++i) {
            double sum = 0;
            for (int q = 0; q < n; ++q)
                sum += input_value(q, offset + i);
            ok = ok && h[i] == static_cast<float>(sum);
        }
        f.check(ok, who + "reduce_scatter");
    }
    // reduce to rank 1 % n and max all_reduce.
    {
        const int root = 1 % n;
        auto send = upload(input(me, 6), sys);
        lockstep::buffer<float, cuda_system> recv(6, sys);
        comm.reduce<float>(send.span(), recv.span(), reduce_op::sum, root);
        if (me == root) {
            const auto h = download(recv.span(), comm);
            bool ok = true;
            for (std::size_t i = 0; i < 6; ++i) {
                double sum = 0;
                for (int q = 0; q < n; ++q)
                    sum += input_value(q, i);
                ok = ok && h[i] == static_cast<float>(sum);
            }
            f.check(ok, who + "reduce");
        }
    }
    // all_to_all: block q of recv is block `me` of replica q's input.
    {
        const std::size_t b = 2;
        auto send = upload(input(me, b * static_cast<std::size_t>(n)), sys);
        lockstep::buffer<float, cuda_system> recv(b * static_cast<std::size_t>(n), sys);
        comm.all_to_all<float>(send.span(), recv.span());
        const auto h = download(recv.span(), comm);
        bool ok = true;
        for (int q = 0; q < n; ++q) {
            const auto theirs = input(q, b * static_cast<std::size_t>(n));
            ok = ok && std::equal(h.begin() + b * q, h.begin() + b * (q + 1),
                                  theirs.begin() + b * static_cast<std::size_t>(me));
        }
        f.check(ok, who + "all_to_all");
    }
    comm.barrier();
    // split by local rank parity keeps the node shape: a sum over the new group.
    {
        comm_type half = comm.split(comm.local_rank() % 2, me);
        auto d = upload(input(me, 4), sys);
        half.all_reduce<float>(d.span(), d.span(), reduce_op::sum);
        half.synchronize();
        std::vector<float> h(4);
        lockstep::copy(std::span<const float>(d.span()), half.system(), std::span<float>(h),
                       host_system{1});
        bool ok = true;
        for (std::size_t i = 0; i < 4; ++i) {
            double sum = 0;
            for (int q = 0; q < n; ++q)
                if ((q % comm.local_size()) % 2 == comm.local_rank() % 2)
                    sum += input_value(q, i);
            ok = ok && h[i] == static_cast<float>(sum);
        }
        f.check(ok, who + "split");
    }
}

/// Every rank's error count, summed over MPI (so every rank fails together).
int errors_everywhere(findings& f) {
    int mine = static_cast<int>(f.errors.size()), all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    for (const auto& e : f.errors)
        UNSCOPED_INFO(e);
    return all;
}

// data_parallel over the hierarchical communicator: a linear model, gradients on the device.
namespace lin = lockstep_test::linear;
using lin::inputs;
using lin::lr;
using lin::steps;
constexpr std::size_t global_batch = 16;
using linear_net = lin::net<comm_type>;
using context_type = linear_net::context_type;

template <class Reduce>
using trainer_type = lockstep::data_parallel<linear_net, lockstep::optim::sgd<float, cuda_system>,
                                             lockstep::sync::synchronous, Reduce, comm_type>;

template <class Reduce>
void check_training(lockstep::overlap_mode overlap) {
    group_type group(MPI_COMM_WORLD, my_devices());
    findings f;
    const std::vector<double> ref = lin::reference_parameters(global_batch);
    group.run([&](comm_type& comm) {
        trainer_type<Reduce> trainer(comm, [](context_type& ctx) { return linear_net(ctx); },
                                     {.lr = lr}, {.overlap = overlap});
        for (int k = 0; k < steps; ++k)
            (void)trainer.step(global_batch, [](linear_net& net, lockstep::shard_range sr,
                                                context_type& ctx) { lin::step(net, sr, ctx); });
        const auto mine = download(trainer.parameters(), comm);
        // Every replica holds rank 0's bits, and all match the reference within float rounding.
        auto first = upload(mine, comm.system());
        comm.broadcast(first.span(), 0);
        const auto zero = download(first.span(), comm);
        const std::string who = "rank " + std::to_string(comm.rank()) + ": ";
        f.check(mine == zero, who + "parameters differ from rank 0's");
        bool close = mine.size() == ref.size();
        for (std::size_t i = 0; close && i < ref.size(); ++i)
            close = std::abs(static_cast<double>(mine[i]) - ref[i]) <= 1e-5;
        f.check(close, who + "parameters differ from the reference");
    });
    CHECK(errors_everywhere(f) == 0);
}

} // namespace

TEST_CASE("gpu_hierarchical_group without any device throws errc::cuda on every process",
          "[comm][hierarchical][nccl][mpi]") {
    int mine = lockstep::cuda_device_count() > 0 ? 1 : 0, gpus_somewhere = 0;
    MPI_Allreduce(&mine, &gpus_somewhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (gpus_somewhere != 0)
        return; // with devices somewhere the other cases run instead
    try {
        group_type group(MPI_COMM_WORLD);
        FAIL("constructed without a device");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::cuda);
    }
}

TEST_CASE("gpu_hierarchical_group: the collectives equal the exact sums",
          "[comm][hierarchical][nccl][mpi][gpu]") {
    group_type group(MPI_COMM_WORLD, my_devices());
    REQUIRE(group.processes() == world_size());
    findings f;
    group.run([&](comm_type& comm) { check_collectives(comm, f); });
    CHECK(errors_everywhere(f) == 0);
}

TEST_CASE("data_parallel over gpu_hierarchical_group trains like flat replicas",
          "[train][hierarchical][nccl][mpi][gpu]") {
    check_training<lockstep::reduce::bucketed<>>(lockstep::overlap_mode::never);
    check_training<lockstep::reduce::bucketed<>>(lockstep::overlap_mode::always);
    check_training<lockstep::reduce::per_tensor>(lockstep::overlap_mode::never);
}

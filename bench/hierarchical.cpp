// bench_hierarchical: all_reduce (sum, float) over the same 4 MPI processes, flat (one
// mpi_communicator) beside hierarchical_communicator (2 "nodes" of 2 processes: an intra-node
// mpi_communicator and an inter-node one), on shared memory and with the link between the two
// halves modelled as 10 Gb/s and as 1 Gb/s Ethernet (simulated_link).
// SPDX-License-Identifier: Apache-2.0
//
//     mpiexec -n 4 bench_hierarchical [--quick] [--csv FILE]
//
// The modelled rows: flat, every all_reduce idles for the wire time of the whole message (every
// replica's traffic crosses a node boundary in a flat ring spanning two nodes); hierarchical,
// only the inter-node all_reduce of each replica's shard (1/2 of the message) does. Each time is
// the median over repetitions of one call started right after a barrier.
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#include "lockstep/comm/simulated_link.hpp"
#include "median.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

using namespace lockstep;

namespace {

using bench_stats::median;

template <class Comm>
double time_all_reduce(Comm& comm, mpi_communicator& fence, std::vector<float>& x, int reps) {
    std::vector<double> t;
    for (int r = -1; r < reps; ++r) {
        fence.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        comm.all_reduce(std::span<const float>(x), std::span<float>(x), reduce_op::sum);
        fence.barrier();
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        if (r >= 0)
            t.push_back(ms);
    }
    return median(t);
}

} // namespace

int main(int argc, char** argv) {
    mpi_environment env(argc, argv);
    bool quick = false;
    std::string csv;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc)
            csv = argv[++i];
    }
    mpi_communicator world(MPI_COMM_WORLD);
    if (world.size() != 4) {
        if (world.rank() == 0)
            std::fprintf(stderr, "bench_hierarchical: run with mpiexec -n 4 (got %d)\n",
                         world.size());
        return 2;
    }
    const int me = world.rank();
    const simulated_link_params link{.latency = std::chrono::microseconds(20), .bandwidth = 1.25e9};
    const simulated_link_params slow{.latency = std::chrono::microseconds(50), .bandwidth = 1.25e8};
    using linked = simulated_link<mpi_communicator>;
    using two_level_linked = hierarchical_communicator<mpi_communicator, linked>;
    mpi_communicator flat(MPI_COMM_WORLD);
    linked flat_linked(mpi_communicator(MPI_COMM_WORLD), link);
    linked flat_slow(mpi_communicator(MPI_COMM_WORLD), slow);
    hierarchical_communicator<mpi_communicator, mpi_communicator> two(world.split(me / 2, me),
                                                                      world.split(me % 2, me));
    two_level_linked two_linked(world.split(me / 2, me), linked(world.split(me % 2, me), link));
    two_level_linked two_slow(world.split(me / 2, me), linked(world.split(me % 2, me), slow));

    std::FILE* out = nullptr;
    if (me == 0) {
        std::printf("all_reduce (sum, float) over 4 MPI processes; hierarchical: 2 nodes x 2\n");
        std::printf("%12s %10s %10s %9s %11s %11s %9s %10s %10s %9s\n", "bytes", "flat ms",
                    "hier ms", "hier/flat", "flat 10G ms", "hier 10G ms", "hier/flat", "flat 1G ms",
                    "hier 1G ms", "hier/flat");
        if (!csv.empty()) {
            out = std::fopen(csv.c_str(), "w");
            if (out != nullptr)
                std::fprintf(out, "bench,bytes,variant,ms,ratio_to_flat\n");
        }
    }
    const std::size_t top = quick ? (std::size_t{4} << 20) : (std::size_t{64} << 20);
    for (std::size_t bytes = 64 << 10; bytes <= top; bytes *= 4) {
        const int reps = quick ? 3 : (bytes >= (16u << 20) ? 7 : 15);
        std::vector<float> x(bytes / sizeof(float), 1e-3f * static_cast<float>(me + 1));
        const double f = time_all_reduce(flat, world, x, reps);
        const double h = time_all_reduce(two, world, x, reps);
        const double fl = time_all_reduce(flat_linked, world, x, reps);
        const double hl = time_all_reduce(two_linked, world, x, reps);
        const int slow_reps = std::max(3, reps / 3);
        const double fs = time_all_reduce(flat_slow, world, x, slow_reps);
        const double hs = time_all_reduce(two_slow, world, x, slow_reps);
        if (me == 0) {
            std::printf("%12zu %10.3f %10.3f %9.3f %11.3f %11.3f %9.3f %10.3f %10.3f %9.3f\n",
                        bytes, f, h, h / f, fl, hl, hl / fl, fs, hs, hs / fs);
            if (out != nullptr) {
                std::fprintf(out, "hierarchical,%zu,flat,%.6f,1\n", bytes, f);
                std::fprintf(out, "hierarchical,%zu,hierarchical,%.6f,%.6f\n", bytes, h, h / f);
                std::fprintf(out, "hierarchical,%zu,flat_10g,%.6f,1\n", bytes, fl);
                std::fprintf(out, "hierarchical,%zu,hierarchical_10g,%.6f,%.6f\n", bytes, hl,
                             hl / fl);
                std::fprintf(out, "hierarchical,%zu,flat_1g,%.6f,1\n", bytes, fs);
                std::fprintf(out, "hierarchical,%zu,hierarchical_1g,%.6f,%.6f\n", bytes, hs,
                             hs / fs);
            }
            std::fflush(stdout);
        }
    }
    if (out != nullptr)
        std::fclose(out);
    return 0;
}

// bench_reduce: gradient reduction of a ResNet-50-shaped parameter list (161 tensors, 25.6 M
// floats) with every ReducePolicy against one all_reduce of the whole flat buffer, in the same
// run. Thread group (2 replicas) by default; built with LOCKSTEP_BENCH_MPI it runs one replica
// per process under mpiexec. SPDX-License-Identifier: Apache-2.0
//
//   bench_reduce [reps = 10] [replicas = 2] [--csv FILE]
//   mpiexec -n 2 bench_reduce_mpi [reps = 10] [--csv FILE]
//
// --csv FILE (written by replica 0): one row per method with its collectives, best and median
// time and the ratios to the flat all_reduce (best, median) and to bucketed<> (median).
#include "csv.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/train/detail/bucketed_collective.hpp"
#include "lockstep/train/detail/compressed_collective.hpp"
#include "lockstep/train/detail/parameter_server_collective.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "resnet50.hpp"
#if LOCKSTEP_BENCH_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

using namespace lockstep;
using lockstep::bench_nets::resnet50_tensors;

namespace {

// One reduction method: a name, the collectives it issues, and the call that runs it.
struct method {
    std::string name;
    std::size_t calls = 0;
    std::function<void()> run;
    std::vector<double> ms;
    std::function<std::size_t()> issued; ///< if set: collectives issued so far (after one run)
};

template <class Policy, class Comm>
method make_method(const char* name, Comm& comm, const std::vector<tensor_info>& tensors,
                   std::vector<float>& grads, std::vector<float>& values) {
    auto red = std::make_shared<detail::collective<Policy, float, Comm>>(comm, tensors);
    std::span<float> g(grads), v(values);
    method m{name};
    m.calls = red->plan().size() * (Policy::update_root >= 0 ? 2 : 1);
    m.run = [red, g, v] {
        red->begin(g);
        red->finish();
        if constexpr (Policy::update_root >= 0)
            red->broadcast(v); // parameter_server: the broadcast of the parameters is part of it
        else
            (void)v;
    };
    // compressed: two collectives per chunk of every bucket (all_to_all, all_gather).
    if constexpr (Policy::rounds_on_wire)
        m.issued = [red] { return red->collectives(); };
    return m;
}

template <class Comm>
void bench(Comm& comm, int reps, const char* backend, const std::string& csv_path) {
    const auto tensors = resnet50_tensors();
    const std::size_t n = tensors.back().offset + tensors.back().size;
    std::vector<float> init(n), grads(n), values(n, 0.5f);
    for (std::size_t i = 0; i < n; ++i)
        init[i] = 1e-3f * float((i * 2654435761u + 977u * comm.rank()) % 2001) - 1.0f;

    std::vector<method> methods;
    methods.push_back({"flat all_reduce (anchor)", 1, [&] {
                           comm.all_reduce(std::span<const float>(grads), std::span<float>(grads),
                                           reduce_op::sum);
                       }});
    methods.push_back(make_method<reduce::per_tensor>("per_tensor", comm, tensors, grads, values));
    methods.push_back(
        make_method<reduce::bucketed<>>("bucketed<25 MiB, 1 MiB>", comm, tensors, grads, values));
    methods.push_back(make_method<reduce::parameter_server<0>>("parameter_server<0> (+bcast)", comm,
                                                               tensors, grads, values));
    methods.push_back(make_method<reduce::compressed<lockstep::half>>("compressed<half>", comm,
                                                                      tensors, grads, values));
    methods.push_back(make_method<reduce::compressed<lockstep::bfloat16>>(
        "compressed<bfloat16>", comm, tensors, grads, values));
    // Round-robin over the methods, so load from other processes hits them alike; a warm-up
    // round first. Every timing: fresh gradients (untimed), barrier, reduce, barrier.
    for (int rep = 0; rep <= reps; ++rep)
        for (method& m : methods) {
            std::copy(init.begin(), init.end(), grads.begin());
            comm.barrier();
            const auto t0 = std::chrono::steady_clock::now();
            m.run();
            comm.barrier();
            const auto t1 = std::chrono::steady_clock::now();
            if (rep > 0)
                m.ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
            else if (m.issued)
                m.calls = m.issued();
        }
    if (comm.rank() != 0)
        return;
    for (method& m : methods)
        std::sort(m.ms.begin(), m.ms.end());
    const double flat_best = methods[0].ms.front(), flat_median = methods[0].ms[reps / 2];
    const double bucketed_median = methods[2].ms[reps / 2];
    std::printf("gradient reduction, ResNet-50 list: %zu tensors, %zu floats (%.1f MB), %s, %d "
                "replicas, %d round-robin repetitions\n",
                tensors.size(), n, n * 4 / 1e6, backend, comm.size(), reps);
    std::printf("%-30s %12s %9s %9s %8s %12s %14s %14s\n", "method", "collectives", "best ms",
                "median ms", "GB/s", "best / flat", "median / flat", "med / bucketed");
    for (const method& m : methods)
        std::printf("%-30s %12zu %9.2f %9.2f %8.2f %12.3f %14.3f %14.3f\n", m.name.c_str(), m.calls,
                    m.ms.front(), m.ms[reps / 2], n * 4 / 1e6 / m.ms.front(),
                    m.ms.front() / flat_best, m.ms[reps / 2] / flat_median,
                    m.ms[reps / 2] / bucketed_median);
    bench_csv::writer csv(csv_path, {"bench", "backend", "replicas", "method", "collectives",
                                     "best_ms", "median_ms", "best_over_flat", "median_over_flat",
                                     "median_over_bucketed"});
    for (const method& m : methods)
        csv.row({"reduce", backend, comm.size(), m.name, m.calls, m.ms.front(), m.ms[reps / 2],
                 m.ms.front() / flat_best, m.ms[reps / 2] / flat_median,
                 m.ms[reps / 2] / bucketed_median});
}

} // namespace

int main(int argc, char** argv) {
#if LOCKSTEP_BENCH_MPI
    mpi_environment env(argc, argv);
#endif
    const std::string csv = bench_csv::take_option(argc, argv);
    const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
#if LOCKSTEP_BENCH_MPI
    mpi_communicator comm(MPI_COMM_WORLD);
    bench(comm, reps, "MPI", csv);
#else
    const int replicas = argc > 2 ? std::atoi(argv[2]) : 2;
    thread_group(replicas).run(
        [&](thread_communicator& comm) { bench(comm, reps, "thread_group", csv); });
#endif
}

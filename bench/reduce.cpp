// bench_reduce: gradient reduction of a ResNet-50-shaped parameter list (161 tensors, 25.6 M
// floats) with every ReducePolicy against one all_reduce of the whole flat buffer, in the same
// run. Thread group (2 replicas) by default; built with LOCKSTEP_BENCH_MPI it runs one replica
// per process under mpiexec. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/train/detail/reducer.hpp"
#include "lockstep/train/parameter_registry.hpp"
#if LOCKSTEP_BENCH_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace lockstep;

namespace {

// torchvision's resnet50 parameters in registration order: conv1, bn1, layer1..4 (bottlenecks
// of conv1x1, bn, conv3x3, bn, conv1x1, bn, plus a downsample conv1x1 + bn in each layer's
// first block), fc. 161 tensors, 25 557 032 floats.
std::vector<tensor_info> resnet50_tensors() {
    std::vector<tensor_info> out;
    std::size_t offset = 0;
    auto add = [&](std::string name, std::vector<std::size_t> shape) {
        std::size_t n = 1;
        for (auto e : shape)
            n *= e;
        out.push_back(tensor_info{std::move(name), std::move(shape), offset, n});
        offset += n;
    };
    auto bn = [&](const std::string& name, std::size_t c) {
        add(name + ".weight", {c});
        add(name + ".bias", {c});
    };
    add("conv1.weight", {64, 3, 7, 7});
    bn("bn1", 64);
    std::size_t in = 64;
    const std::size_t blocks[] = {3, 4, 6, 3};
    for (std::size_t l = 0; l < 4; ++l) {
        const std::size_t width = std::size_t{64} << l, outc = width * 4;
        for (std::size_t b = 0; b < blocks[l]; ++b) {
            const std::string p = "layer" + std::to_string(l + 1) + "." + std::to_string(b);
            add(p + ".conv1.weight", {width, in, 1, 1});
            bn(p + ".bn1", width);
            add(p + ".conv2.weight", {width, width, 3, 3});
            bn(p + ".bn2", width);
            add(p + ".conv3.weight", {outc, width, 1, 1});
            bn(p + ".bn3", outc);
            if (b == 0) {
                add(p + ".downsample.0.weight", {outc, in, 1, 1});
                bn(p + ".downsample.1", outc);
            }
            in = outc;
        }
    }
    add("fc.weight", {1000, 2048});
    add("fc.bias", {1000});
    return out;
}

struct timing {
    std::string name;
    double ms = 0;         // median over repetitions
    std::size_t calls = 0; // collectives per reduction
};

// Runs one reduction method `reps` times after a warm-up; returns the median time (rank 0's view:
// barrier, start, reduce, barrier, stop).
template <class Comm, class Reduce>
double time_reps(Comm& comm, int reps, std::vector<float>& grads, const std::vector<float>& init,
                 Reduce&& reduce) {
    std::vector<double> ms;
    for (int i = 0; i < reps + 1; ++i) {
        std::copy(init.begin(), init.end(), grads.begin()); // fresh gradients, outside the timing
        comm.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        reduce();
        comm.barrier();
        const auto t1 = std::chrono::steady_clock::now();
        if (i > 0)
            ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

template <class Policy, class Comm>
timing run_policy(const char* name, Comm& comm, const std::vector<tensor_info>& tensors, int reps,
                  std::vector<float>& grads, std::vector<float>& values,
                  const std::vector<float>& init) {
    detail::reducer<Policy, float, Comm> red(comm, tensors);
    std::span<float> g(grads), v(values);
    timing t{name};
    t.ms = time_reps(comm, reps, grads, init, [&] {
        red.begin(g);
        red.finish();
        red.apply(v, [] {}); // parameter_server: the broadcast of the parameters is part of it
    });
    t.calls = red.plan().size() * (Policy::kind == reduce_kind::parameter_server ? 2 : 1);
    return t;
}

template <class Comm>
void bench(Comm& comm, int reps, const char* backend) {
    const auto tensors = resnet50_tensors();
    const std::size_t n = tensors.back().offset + tensors.back().size;
    std::vector<float> init(n), grads(n), values(n, 0.5f);
    for (std::size_t i = 0; i < n; ++i)
        init[i] = 1e-3f * float((i * 2654435761u + 977u * comm.rank()) % 2001) - 1.0f;

    std::vector<timing> rows;
    timing flat{"flat all_reduce (anchor)"};
    flat.calls = 1;
    flat.ms = time_reps(comm, reps, grads, init, [&] {
        comm.all_reduce(std::span<const float>(grads), std::span<float>(grads), reduce_op::sum);
    });
    rows.push_back(flat);
    rows.push_back(
        run_policy<reduce::per_tensor>("per_tensor", comm, tensors, reps, grads, values, init));
    rows.push_back(run_policy<reduce::bucketed<>>("bucketed<25 MiB, 1 MiB>", comm, tensors, reps,
                                                  grads, values, init));
    rows.push_back(run_policy<reduce::parameter_server<0>>("parameter_server<0> (+bcast)", comm,
                                                           tensors, reps, grads, values, init));
    rows.push_back(run_policy<reduce::compressed<lockstep::half>>("compressed<half>", comm, tensors,
                                                                  reps, grads, values, init));
    rows.push_back(run_policy<reduce::compressed<lockstep::bfloat16>>(
        "compressed<bfloat16>", comm, tensors, reps, grads, values, init));
    if (comm.rank() != 0)
        return;
    std::printf("gradient reduction, ResNet-50 list: %zu tensors, %zu floats (%.1f MB), %s, %d "
                "replicas, median of %d\n",
                tensors.size(), n, n * 4 / 1e6, backend, comm.size(), reps);
    std::printf("%-30s %10s %12s %10s %14s\n", "method", "ms", "collectives", "GB/s",
                "time / flat");
    for (const timing& t : rows)
        std::printf("%-30s %10.2f %12zu %10.2f %14.3f\n", t.name.c_str(), t.ms, t.calls,
                    n * 4 / 1e6 / t.ms, t.ms / flat.ms);
}

} // namespace

int main(int argc, char** argv) {
    const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
#if LOCKSTEP_BENCH_MPI
    mpi_environment env(argc, argv);
    mpi_communicator comm(MPI_COMM_WORLD);
    bench(comm, reps, "MPI");
#else
    const int replicas = argc > 2 ? std::atoi(argv[2]) : 2;
    thread_group(replicas).run(
        [&](thread_communicator& comm) { bench(comm, reps, "thread_group"); });
#endif
}

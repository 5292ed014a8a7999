// bench_reproducible: the step of a network with ResNet-50's 161 parameter tensors (25.6 M
// floats) trained with reduce::reproducible<C> (chunks of C samples, anchored fixed-point sums,
// replica-count-independent bits) and reduce::sharded<> (ZeRO stage 1: reduce-scatter, sharded
// optimizer state, all_gather) beside reduce::bucketed<> (one all_reduce per bucket), on 2
// thread replicas, or under `mpiexec -n 2` (bench_reproducible_mpi). SPDX-License-Identifier:
// Apache-2.0
//
//     bench_reproducible [--quick] [--reps N] [--csv FILE]
//     mpiexec -n 2 bench_reproducible_mpi [--quick] [--reps N] [--csv FILE]
//
// The network's "backward" writes every gradient once per call (what accumulating weight
// gradients costs; no other compute), so the rows isolate what the reduction policy costs: the
// bucketed step calls it once per replica and all_reduces 4 bytes per parameter; the
// reproducible step calls it once per chunk, keeps every chunk but the last, sends each chunk's
// values of every block of elements to the block's owner (an all_to_all per chunk index: 4
// bytes per parameter and chunk), which sums them in fixed point anchored at each element's
// largest exponent and rounds once, and all-gathers the blocks (4 bytes per parameter).
// Global batch 64; SGD with momentum; each time is the median over repetitions of one step
// between barriers.
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "resnet50.hpp"
#if LOCKSTEP_BENCH_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace lockstep;

namespace {

constexpr std::size_t global_batch = 64;

/// ResNet-50's tensors in the registry; backward fills every gradient (a value that depends on
/// the chunk, so the sums are not trivial).
template <class Context>
struct resnet_shaped {
    std::vector<typename Context::handle> params;
    explicit resnet_shaped(Context& ctx) {
        for (const tensor_info& t : bench_nets::resnet50_tensors())
            params.push_back(ctx.registry().add(t.name, t.shape));
    }
    double train(const shard_range& r, Context& ctx) {
        const float g = 1e-4f * static_cast<float>(r.begin + 1) * static_cast<float>(r.scale);
        for (std::size_t t = params.size(); t-- > 0;) {
            const std::span<float> grad = params[t].grad();
            for (float& x : grad)
                x += g;
            ctx.mark_ready(params[t]);
        }
        return 0.0;
    }
};

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

struct row {
    std::string name;
    double ms = 0;
};

template <class Comm, class Reduce>
double time_steps(Comm& comm, int reps) {
    using net = resnet_shaped<replica_context<float, Comm>>;
    data_parallel<net, optim::sgd<float, typename Comm::system_type>, sync::synchronous, Reduce,
                  Comm>
        dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 1e-3, .momentum = 0.9});
    std::vector<double> t;
    for (int r = -1; r < reps; ++r) {
        comm.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        dp.step(global_batch,
                [](net& n, const shard_range& s, auto& ctx) { return n.train(s, ctx); });
        comm.barrier();
        if (r >= 0)
            t.push_back(
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                    .count());
    }
    return median(t);
}

template <class Comm>
std::vector<row> run_all(Comm& comm, int reps) {
    std::vector<row> rows;
    rows.push_back({"bucketed<>", time_steps<Comm, reduce::bucketed<>>(comm, reps)});
    rows.push_back({"sharded<> (ZeRO stage 1)", time_steps<Comm, reduce::sharded<>>(comm, reps)});
    rows.push_back({"reproducible<32> (1 chunk per replica)",
                    time_steps<Comm, reduce::reproducible<32>>(comm, reps)});
    rows.push_back({"reproducible<8> (4 chunks per replica)",
                    time_steps<Comm, reduce::reproducible<8>>(comm, reps)});
    return rows;
}

void report(const std::vector<row>& rows, const char* backend, const std::string& csv) {
    std::printf("%s, 2 replicas, global batch %zu, ResNet-50's 161 tensors (25.6 M floats)\n",
                backend, global_batch);
    std::printf("%-42s %10s %14s\n", "reduce policy", "step ms", "/ bucketed");
    for (const row& r : rows)
        std::printf("%-42s %10.2f %14.3f\n", r.name.c_str(), r.ms, r.ms / rows[0].ms);
    if (csv.empty())
        return;
    if (std::FILE* f = std::fopen(csv.c_str(), "w")) {
        std::fprintf(f, "bench,backend,policy,step_ms,ratio_to_bucketed\n");
        for (const row& r : rows)
            std::fprintf(f, "reproducible,%s,\"%s\",%.6f,%.6f\n", backend, r.name.c_str(), r.ms,
                         r.ms / rows[0].ms);
        std::fclose(f);
    }
}

} // namespace

int main(int argc, char** argv) {
#if LOCKSTEP_BENCH_MPI
    mpi_environment env(argc, argv);
#endif
    int reps = 10;
    std::string csv;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0)
            reps = 3;
        else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = std::max(1, std::atoi(argv[++i]));
        else if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc)
            csv = argv[++i];
        else {
            std::fprintf(stderr, "usage: %s [--quick] [--reps N] [--csv FILE]\n", argv[0]);
            return 2;
        }
    }
#if LOCKSTEP_BENCH_MPI
    mpi_communicator comm(MPI_COMM_WORLD);
    const auto rows = run_all(comm, reps);
    if (comm.rank() == 0)
        report(rows, "mpi", csv);
#else
    thread_group group(2);
    std::vector<row> rows;
    group.run([&](thread_communicator& comm) {
        auto mine = run_all(comm, reps);
        if (comm.rank() == 0)
            rows = std::move(mine);
    });
    report(rows, "thread_group", csv);
#endif
    return 0;
}

// tests/train/test_async_hierarchical_mpi.cpp: the asynchronous trainers over hierarchical_group
// (2 replica threads in each MPI process), with its own Catch2 main.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "train_runner.hpp"

#include "lockstep/comm/hierarchical_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/parameter_server.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace lockstep_test;
using lockstep::hierarchical_group;
using comm_t = hierarchical_group::communicator_type;

namespace {

constexpr int threads_per_process = 2;
constexpr std::size_t steps = 12, batch = 6;
using sgd = lockstep::optim::sgd<double>;
const lockstep::optim::sgd_params opt{.lr = 0.1, .momentum = 0.9};

/// What one replica saw (recorded in the replica thread, checked after run()).
struct seen {
    std::vector<double> before, after;
    lockstep::async_result result;
    int rank = -1, size = 0;
};

auto step_fn() {
    return [](auto& n, const lockstep::shard_range& r, auto& ctx) { return n.train(r, ctx); };
}

/// data_parallel<net, sgd, SyncPolicy, per_tensor> over hierarchical_group.
template <class SyncPolicy>
std::vector<seen> run_hierarchical() {
    using net = mlp<double, comm_t, storage::registry, lockstep::bn::local>;
    hierarchical_group group(MPI_COMM_WORLD, threads_per_process);
    std::vector<seen> out(threads_per_process);
    group.run([&](comm_t& comm) {
        seen& s = out[static_cast<std::size_t>(comm.local_rank())];
        lockstep::data_parallel<net, sgd, SyncPolicy, lockstep::reduce::per_tensor, comm_t> dp(
            comm, [](auto& ctx) { return net(ctx); }, opt, {.seed = 42});
        const auto v0 = dp.parameters();
        s.before.assign(v0.begin(), v0.end());
        s.result = dp.train(steps, batch, step_fn());
        const auto v = dp.parameters();
        s.after.assign(v.begin(), v.end());
        s.rank = comm.rank();
        s.size = comm.size();
    });
    return out;
}

/// The same trainer with SyncPolicy on `replicas` flat thread replicas: replica 0's parameters.
template <class SyncPolicy>
std::vector<double> run_flat(int replicas) {
    using net = mlp<double, lockstep::thread_communicator, storage::registry, lockstep::bn::local>;
    lockstep::thread_group group(replicas);
    std::vector<double> out;
    group.run([&](lockstep::thread_communicator& comm) {
        lockstep::data_parallel<net, sgd, SyncPolicy, lockstep::reduce::per_tensor,
                                lockstep::thread_communicator>
            dp(comm, [](auto& ctx) { return net(ctx); }, opt, {.seed = 42});
        dp.train(steps, batch, step_fn());
        if (comm.rank() == 0) {
            const auto v = dp.parameters();
            out.assign(v.begin(), v.end());
        }
    });
    return out;
}

/// Every replica of every process ends with global replica 0's final parameters.
void check_agreement(const std::vector<seen>& out) {
    std::vector<double> root = out[0].after;
    MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
    for (const seen& s : out) {
        INFO("replica " << s.rank);
        REQUIRE(s.after.size() == root.size());
        CHECK(std::memcmp(s.after.data(), root.data(), root.size() * sizeof(double)) == 0);
    }
}

} // namespace

TEST_CASE("asynchronous training over processes x 2 threads", "[train][async][hierarchical][mpi]") {
    const auto out = run_hierarchical<lockstep::sync::asynchronous>();
    int processes = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &processes);
    for (const seen& s : out)
        CHECK(s.size == processes * threads_per_process);
    check_agreement(out);
    for (const seen& s : out) {
        INFO("replica " << s.rank);
        CHECK(std::isfinite(s.result.mean_loss));
        CHECK(s.after != s.before); // the server applied gradients
        for (const double v : s.after)
            CHECK(std::isfinite(v));
        if (s.rank != 0)
            continue;
        // The server applied every step, each worker's gradients counted once.
        const auto& st = s.result.staleness;
        CHECK(st.applied == steps);
        std::uint64_t pushed = 0;
        for (const std::uint64_t k : st.per_rank)
            pushed += k;
        CHECK(pushed == steps);
        CHECK(st.per_rank.size() == static_cast<std::size_t>(s.size));
    }
}

TEST_CASE("bounded_staleness<0> over processes x 2 threads is sequential SGD: the same "
          "parameters as one worker on flat threads",
          "[train][async][hierarchical][mpi]") {
    // With staleness 0 every gradient is computed on the newest parameters, and work item k is
    // the same batch whichever worker takes it (dropout keyed by the global sample index): the
    // server's trajectory is the one of a single worker.
    const auto out = run_hierarchical<lockstep::sync::bounded_staleness<0>>();
    check_agreement(out);
    const auto one = run_flat<lockstep::sync::bounded_staleness<0>>(2);
    for (const seen& s : out) {
        INFO("replica " << s.rank);
        REQUIRE(s.after.size() == one.size());
        double worst = 0;
        for (std::size_t i = 0; i < one.size(); ++i)
            worst = std::max(worst,
                             std::fabs(s.after[i] - one[i]) / std::max(1e-300, std::fabs(one[i])));
        CHECK(worst <= 1e-12);
        if (s.rank == 0)
            CHECK(s.result.staleness.max == 0);
    }
}

TEST_CASE("a stalled worker over processes x 2 threads is named in the abort",
          "[.][stall_abort][train][async][hierarchical][mpi]") {
    // Hidden: CTest test_async_hierarchical_mpi_stall_abort runs it at 2 processes with
    // LOCKSTEP_RESULT_DIR set, since MPI_Abort ends the job. Worker 1 (process 0, thread 1)
    // stalls on its first item past the MPI timeout under the default failure policy (abort):
    // the server's wait times out first (a worker's wait for its next item lasts two timeouts)
    // and must end the job with the parameter server's account naming worker 1, not with the
    // routes' receive, which names nobody. Each process's stderr goes to a file (an aborted job's
    // last output may never reach the launcher), which CTest reads.
    const char* dir = std::getenv("LOCKSTEP_RESULT_DIR");
    REQUIRE(dir != nullptr);
    int process = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &process);
    const std::string base = std::string(dir) + "/rank" + std::to_string(process);
    REQUIRE(std::freopen((base + ".stderr").c_str(), "w", stderr) != nullptr);
    lockstep::hierarchical_group_params p;
    p.mpi.timeout = std::chrono::milliseconds(3000); // margin for a loaded machine's start-up
    REQUIRE(p.mpi.on_failure == lockstep::mpi_failure_action::abort);
    hierarchical_group group(MPI_COMM_WORLD, threads_per_process, p);
    std::ofstream(base + ".txt") << "started\n";
    group.run([&](comm_t& comm) {
        lockstep::buffer<float, lockstep::host_system> params(2, comm.system());
        std::fill(params.begin(), params.end(), 0.0f);
        (void)lockstep::run_parameter_server<lockstep::sync::asynchronous>(
            comm, params.span(), {}, 0, {.steps = 8},
            [&](const lockstep::work_item&, std::span<float> g, std::span<float>) {
                if (comm.rank() == 1) // its first item: the others may take all the rest
                    std::this_thread::sleep_for(std::chrono::seconds(20));
                std::fill(g.begin(), g.end(), 1.0f);
            },
            [](std::span<const float>, std::span<const float>, const lockstep::apply_info&) {});
    });
    std::ofstream(base + ".txt", std::ios::app) << "bad: finished\n";
    FAIL("the run went on past the timeout");
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(
        argc, argv, {.requested = MPI_THREAD_MULTIPLE, .required = MPI_THREAD_MULTIPLE});
}

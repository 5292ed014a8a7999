// hierarchical_group under mpiexec: every process runs 2 replica threads, composed with MPI into
// one group of 2 x processes replicas. The collective suite, and data_parallel over it against
// the same number of flat thread replicas and against one replica.
// SPDX-License-Identifier: Apache-2.0
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "collective_suite.hpp"
#include "train/train_runner.hpp"

#include "lockstep/comm/hierarchical_group.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/sgd.hpp"

#include <cstring>
#include <mutex>
#include <span>
#include <vector>

using lockstep::hierarchical_group;
using comm_t = hierarchical_group::communicator_type;

namespace {
constexpr int threads_per_process = 2;
} // namespace

TEST_CASE("hierarchical_group passes the collective suite", "[comm][hierarchical][mpi]") {
    hierarchical_group group(MPI_COMM_WORLD, threads_per_process);
    std::vector<lockstep::testing::suite_report> reports(threads_per_process);
    std::vector<int> shape(threads_per_process, -1);
    group.run([&](comm_t& comm) {
        const auto l = static_cast<std::size_t>(comm.local_rank());
        shape[l] = comm.size() * 100 + comm.rank();
        reports[l] = lockstep::testing::run_collective_suite(comm, {.rank_order_sums = false});
    });
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    for (int l = 0; l < threads_per_process; ++l) // node-major global ranks
        CHECK(shape[static_cast<std::size_t>(l)] ==
              size * threads_per_process * 100 + rank * threads_per_process + l);
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.failed == 0);
        CHECK(r.checks > 200);
    }
}

namespace {

using namespace lockstep_test;

template <class T, class Opt, class Reduce>
void check_like_flat(typename Opt::params_type p) {
    using net = mlp<T, comm_t, storage::registry, lockstep::bn::global>;
    hierarchical_group group(MPI_COMM_WORLD, threads_per_process);
    std::vector<std::vector<std::vector<T>>> mine(threads_per_process);
    int replicas = 0, first_rank = 0;
    group.run([&](comm_t& comm) {
        lockstep::data_parallel<net, Opt, lockstep::sync::synchronous, Reduce, comm_t> dp(
            comm, [](auto& ctx) { return net(ctx); }, p, {.seed = 42});
        for (std::size_t b : batch_schedule()) {
            dp.step(b, [](net& n, const lockstep::shard_range& r, auto& ctx) {
                return n.train(r, ctx);
            });
            auto v = dp.parameters();
            mine[static_cast<std::size_t>(comm.local_rank())].emplace_back(v.begin(), v.end());
        }
        if (comm.local_rank() == 0) {
            replicas = comm.size();
            first_rank = comm.rank();
        }
    });
    // Every replica of every process holds the same bits: compare with global replica 0's.
    for (std::size_t s = 0; s < mine[0].size(); ++s) {
        std::vector<T> root = mine[0][s];
        MPI_Bcast(root.data(), static_cast<int>(root.size() * sizeof(T)), MPI_BYTE, 0,
                  MPI_COMM_WORLD);
        for (const auto& m : mine)
            REQUIRE(std::memcmp(root.data(), m[s].data(), root.size() * sizeof(T)) == 0);
    }
    const auto flat = train_run<T, Opt, lockstep::sync::synchronous, Reduce, storage::registry>(
        {.replicas = replicas}, p);
    const auto one = train_run<T, Opt, lockstep::sync::synchronous, lockstep::reduce::per_tensor,
                               storage::registry>({.replicas = 1}, p);
    CAPTURE(replicas, first_rank);
    for (std::size_t s = 0; s < mine[0].size(); ++s) {
        INFO("step " << s);
        // Only the summation order differs: rounding, within 1e-10 in double.
        CHECK(max_tensor_rel_error(mine[0][s], flat.params[0][s], flat.layout) <= 1e-10);
        CHECK(max_tensor_rel_error(mine[0][s], one.params[0][s], one.layout) <= 1e-10);
    }
}

} // namespace

TEST_CASE("data_parallel over processes x 2 threads trains like flat replicas and like one",
          "[comm][hierarchical][mpi][train]") {
    SECTION("sgd, bucketed") {
        check_like_flat<double, lockstep::optim::sgd<double>, lockstep::reduce::bucketed<>>(
            {.lr = 0.1, .momentum = 0.9});
    }
    SECTION("lamb, per-tensor") {
        check_like_flat<double, lockstep::optim::lamb<double>, lockstep::reduce::per_tensor>(
            {.lr = 1e-3, .weight_decay = 0.01});
    }
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(
        argc, argv, {.requested = MPI_THREAD_MULTIPLE, .required = MPI_THREAD_MULTIPLE});
}

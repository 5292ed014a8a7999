// The agreement and non-finite probes of test_step_control over MPI (one replica per process):
// a global_batch or lr that differs on the last rank, and one NaN gradient element on one rank,
// fail on every rank naming both values (or the tensor and the rank); the communicator stays
// usable afterwards. SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "train_runner.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/optim/sgd.hpp"

#include <string>

using namespace lockstep_test;

namespace {
using net = mlp<double, mpi_communicator, storage::registry>;
using trainer =
    data_parallel<net, optim::sgd<double>, sync::synchronous, reduce::bucketed<>, mpi_communicator>;
auto train_fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
} // namespace

TEST_CASE("MPI: global_batch 24 vs 23 on the last rank fails on every rank, then training goes on",
          "[train][mpi][agreement]") {
    mpi_communicator world(MPI_COMM_WORLD);
    const int last = world.size() - 1;
    trainer dp(world, [](auto& ctx) { return net(ctx); }, {.lr = 0.1});
    dp.step(24, train_fn);
    std::string msg;
    int code = -1;
    try {
        dp.step(world.rank() == last ? 23 : 24, train_fn);
    } catch (const error& e) {
        msg = e.what();
        code = static_cast<int>(e.code());
    }
    INFO(msg);
    CHECK(code == static_cast<int>(errc::invalid_argument));
    CHECK_THAT(msg, Catch::Contains("global_batch: 24 on replica 0, 23 on replica " +
                                    std::to_string(last) + ";"));
    CHECK_FALSE(dp.step(24, train_fn).skipped); // the communicator is still usable
}

TEST_CASE("MPI: another lr on one rank fails at construction on every rank",
          "[train][mpi][agreement]") {
    mpi_communicator world(MPI_COMM_WORLD);
    std::string msg;
    try {
        trainer dp(world, [](auto& ctx) { return net(ctx); },
                   {.lr = world.rank() == 1 ? 0.2 : 0.1});
    } catch (const error& e) {
        msg = e.what();
    }
    INFO(msg);
    CHECK_THAT(msg, Catch::Contains("lr: 0.1 on replica 0, 0.2 on replica 1;"));
}

TEST_CASE("MPI: one NaN gradient element on rank 1 is named with its tensor and count 1",
          "[train][mpi][non_finite]") {
    mpi_communicator world(MPI_COMM_WORLD);
    trainer dp(world, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, {.skip_non_finite = false});
    dp.network().poison = world.rank() == 1;
    std::string msg;
    try {
        dp.step(12, train_fn);
    } catch (const error& e) {
        msg = e.what();
    }
    INFO(msg);
    CHECK_THAT(msg, Catch::Contains(" 1 non-finite gradient element(s) on replica 1, the first "
                                    "in 'fc2.weight' (element 0);"));
    CHECK_THAT(msg, !Catch::Contains("on replica 0"));
    CHECK_THAT(msg, !Catch::Contains("on replica 2"));
}

TEST_CASE("MPI: a rank that stops early is an error at finish on every rank, itself included",
          "[train][mpi][finish]") {
    mpi_communicator world(MPI_COMM_WORLD);
    const int last = world.size() - 1;
    trainer dp(world, [](auto& ctx) { return net(ctx); }, {.lr = 0.1});
    std::string msg;
    try {
        for (int s = 0; s < (world.rank() == last ? 1 : 2); ++s)
            dp.step(24, train_fn);
        dp.finish();
    } catch (const error& e) {
        msg = e.what();
    }
    INFO(msg);
    CHECK_THAT(msg, Catch::Contains("] replica " + std::to_string(world.rank()) + ": "));
    CHECK_THAT(msg, Catch::Contains("replica " + std::to_string(last) + " called all_reduce") &&
                        Catch::Contains("tag 'data_parallel.finish'"));
    if (world.rank() == last)
        CHECK_THAT(msg, Catch::Contains("finished after 1 step(s)"));
    CHECK_FALSE(world.broken());
    // Every rank is at the same collective again.
    std::vector<int> one{1};
    world.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
    CHECK(one[0] == world.size());
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

// train_params::max_consecutive_skips over MPI (one replica per process): a rank whose gradient
// is NaN at every step stops every rank at the limit with errc::non_finite naming it and the
// tensor, at step() and, with read_result = false, at finish(). SPDX-License-Identifier: Apache-2.0
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

TEST_CASE("MPI: a rank with a NaN gradient at every step stops every rank at the limit",
          "[train][mpi][non_finite]") {
    mpi_communicator world(MPI_COMM_WORLD);
    const int last = world.size() - 1;
    for (const bool read_each : {true, false}) {
        trainer dp(world, [](auto& ctx) { return net(ctx); }, {.lr = 0.1},
                   {.max_consecutive_skips = 3, .read_result = read_each});
        dp.network().poison = world.rank() == last;
        std::string msg;
        int code = -1, thrown_at = -1, k = 0;
        try {
            for (; k < 6; ++k) {
                const bool skipped = dp.step(12, train_fn).skipped; // not inside CHECK: it catches
                CHECK(skipped == read_each);
            }
            dp.finish();
        } catch (const error& e) {
            msg = e.what();
            code = static_cast<int>(e.code());
            thrown_at = k;
        }
        INFO("read_result " << read_each << ": " << msg);
        CHECK(code == static_cast<int>(errc::non_finite));
        CHECK(thrown_at == (read_each ? 2 : 6)); // at the limit, or at finish()'s read
        CHECK_THAT(msg, Catch::Contains("step 2: 3 consecutive steps skipped"));
        CHECK_THAT(msg, Catch::Contains(" 1 non-finite gradient element(s) on replica " +
                                        std::to_string(last) +
                                        ", the first in 'fc2.weight' (element 0);"));
        CHECK_THAT(msg, Catch::Contains((read_each ? "3" : "6") + std::string(" step(s) skipped")));
    }
}

TEST_CASE("MPI: isolated NaN steps do not stop training; finish() counts them",
          "[train][mpi][non_finite]") {
    mpi_communicator world(MPI_COMM_WORLD);
    trainer dp(world, [](auto& ctx) { return net(ctx); }, {.lr = 0.1},
               {.max_consecutive_skips = 2, .read_result = false});
    for (int k = 0; k < 6; ++k) {
        dp.network().poison = world.rank() == k % world.size() && k % 2 == 0;
        dp.step(12, train_fn);
    }
    CHECK(dp.finish() == 6);
    CHECK(dp.skipped_steps() == 3);
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

// Loss scaling over MPI (one replica per process): an overflow on one rank skips the step and
// backs off the scale on every rank, with bitwise equal weights and scaler states everywhere.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "mixed_fixture.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <cstdint>
#include <cstring>
#include <vector>

using namespace lockstep_test;

TEST_CASE("an overflow on one MPI rank skips the step and backs off the scale on every rank",
          "[train][mixed][mpi]") {
    mpi_communicator world(MPI_COMM_WORLD);
    using net = linreg<lockstep::half, mpi_communicator>;
    const loss_scaling cfg{.init_scale = 1024, .growth_interval = 2};
    data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>, mpi_communicator>
        dp(world, [](auto& ctx) { return net(ctx); }, {.lr = 0.1},
           {.read_result = false, .loss_scale = cfg});
    const int last = world.size() - 1;
    // Rank `last` overflows at steps 1 and 4; rank 0 at step 2.
    auto overflow_on = [&](int step, int rank) {
        return (rank == last && (step == 1 || step == 4)) || (rank == 0 && step == 2);
    };
    // GradScaler's rule on the host: growth after 2 applied steps, backoff 0.5.
    double scale = cfg.init_scale;
    std::int64_t tracker = 0;
    for (int k = 0; k < 7; ++k) {
        dp.network().poison = overflow_on(k, world.rank());
        (void)dp.step(n_samples, [](net& n, shard_range r, auto& ctx) { return n.train(r, ctx); });
        const step_result res = dp.read_result();
        const bool overflow = overflow_on(k, 0) || overflow_on(k, last);
        INFO("rank " << world.rank() << ", step " << k);
        CHECK(res.skipped == overflow);
        CHECK(res.loss_scale == scale);
        if (overflow) {
            scale *= 0.5;
            tracker = 0;
        } else if (++tracker == 2) {
            scale *= 2;
            tracker = 0;
        }
        // Every rank holds the same weights (rank 0's, by broadcast and bitwise comparison).
        const auto p = dp.parameters();
        std::vector<float> mine(p.begin(), p.end()), root = mine;
        world.broadcast(std::span<float>(root), 0);
        CHECK(std::memcmp(root.data(), mine.data(), mine.size() * sizeof(float)) == 0);
    }
    CHECK(dp.scaler().state() == loss_scaler_state{scale, tracker});
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

// train_params::verify_every over MPI (one replica per process): one bit flipped on the last
// rank in a parameter, an optimizer moment or a BN running statistic fails every rank at the next
// check, naming the step, the rank, the tensor and the element; a healthy run passes.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "verify_cases.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/optim/adam.hpp"

#include <string>

using namespace lockstep_test;

namespace {
using net = mlp<double, mpi_communicator, storage::registry>;
using trainer = data_parallel<net, optim::adam<double>, sync::synchronous, reduce::bucketed<256>,
                              mpi_communicator>;
auto train_fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
train_params verified() {
    return {.frozen = [](const tensor_info& t) { return t.name == "fc1.weight"; },
            .verify_every = 2};
}
} // namespace

TEST_CASE("MPI: a healthy run passes verify_every", "[train][mpi][verify]") {
    mpi_communicator world(MPI_COMM_WORLD);
    trainer dp(
        world, [](auto& ctx) { return net(ctx); }, {.lr = 0.01}, verified());
    for (int s = 0; s < 4; ++s)
        CHECK_NOTHROW(dp.step(12 + static_cast<std::size_t>(s), train_fn));
    CHECK(dp.finish() == 4);
}

TEST_CASE("MPI: one flipped bit on the last rank fails every rank, naming it",
          "[train][mpi][verify]") {
    for (const auto target :
         {flip_target::parameter, flip_target::optimizer_state, flip_target::running_stat}) {
        CAPTURE(static_cast<int>(target));
        mpi_communicator world(MPI_COMM_WORLD);
        const int odd = world.size() - 1;
        trainer dp(
            world, [](auto& ctx) { return net(ctx); }, {.lr = 0.01}, verified());
        dp.step(12, train_fn);
        dp.step(12, train_fn);
        dp.step(12, train_fn);
        // Every rank learns the site from the flip's own description (the same on every rank).
        flip_site site = world.rank() == odd ? flip_one_bit(dp, target) : flip_site{};
        std::string msg;
        int code = -1;
        try {
            dp.step(12, train_fn);
        } catch (const error& e) {
            msg = e.what();
            code = static_cast<int>(e.code());
        }
        if (world.rank() != odd) {
            // The site names the same tensor on every rank; recompute it on a scratch copy.
            site.tensor = target == flip_target::parameter      ? "param.fc2.weight"
                          : target == flip_target::running_stat ? "state.bn1.running_var"
                                                                : "optimizer.";
            site.element = target == flip_target::parameter      ? 4
                           : target == flip_target::running_stat ? 2
                                                                 : 7;
        }
        INFO(msg);
        CHECK(code == static_cast<int>(errc::divergence));
        CHECK(dp.steps() == 4);
        CHECK_THAT(msg, Catch::Contains("replica " + std::to_string(world.rank()) +
                                        ": data_parallel.verify_replicas"));
        const std::string want = expected_divergence(3, odd, world.size(), site);
        // Up to the tensor name (the optimizer slot's name is known on the odd rank only).
        CHECK_THAT(msg, Catch::Contains(want.substr(0, want.size() - 1)));
        CHECK_THAT(msg,
                   Catch::Contains(" at element " + std::to_string(site.element) + ": replica 0 "));
        // The communicator stays usable: the next collective pairs on every rank.
        std::vector<int> one{1};
        world.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
        CHECK(one[0] == world.size());
    }
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

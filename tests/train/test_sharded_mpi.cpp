// reduce::sharded (ZeRO stage 1) over MPI (one replica per process): equal to the unsharded
// bucketed trainer over the same processes for SGD, Adam, AdamW, LARS, LAMB (float, double,
// clipping on and off, registry and visitor), bitwise equal on every rank, an empty shard, a
// communication thread, and a checkpoint round trip. SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "checkpoint_support.hpp"
#include "sharded_runner.hpp"
#include "train_runner.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

using namespace lockstep_test;

namespace {

using sharded_policy = reduce::sharded<64, 32>;
using bucketed_policy = reduce::bucketed<64, 32>;

/// The test network trained by the processes of `world` for the 20 steps of the schedule;
/// returns every step's parameters.
template <class T, class Opt, class Reduce, storage S>
std::vector<std::vector<T>> train_mpi(mpi_communicator& world, typename Opt::params_type p,
                                      double max_grad_norm,
                                      overlap_mode overlap = overlap_mode::automatic) {
    using net = mlp<T, mpi_communicator, S>;
    data_parallel<net, Opt, sync::synchronous, Reduce, mpi_communicator> dp(
        world, [](auto& ctx) { return net(ctx); }, p,
        {.overlap = overlap, .seed = 42, .max_grad_norm = max_grad_norm});
    std::vector<std::vector<T>> out;
    for (std::size_t b : batch_schedule()) {
        const step_result r = dp.step(
            b, [](net& n, const shard_range& range, auto& ctx) { return n.train(range, ctx); });
        CHECK_FALSE(r.skipped);
        auto v = dp.parameters();
        out.emplace_back(v.begin(), v.end());
    }
    return out;
}

/// Every step's parameters are the same bits on every rank (compared with rank 0's).
template <class T>
void check_same_on_every_rank(mpi_communicator& world, const std::vector<std::vector<T>>& mine) {
    for (std::size_t s = 0; s < mine.size(); ++s) {
        std::vector<T> root = mine[s];
        world.broadcast(std::span<T>(root), 0);
        INFO("step " << s);
        CHECK(same_bits(std::span<const T>(root), std::span<const T>(mine[s])));
    }
}

template <class T, template <class> class Case, storage S = storage::registry>
void check_case(double max_grad_norm) {
    mpi_communicator world(MPI_COMM_WORLD);
    using opt = typename Case<T>::type;
    const auto sharded =
        train_mpi<T, opt, sharded_policy, S>(world, Case<T>::params(), max_grad_norm);
    const auto ref = train_mpi<T, opt, bucketed_policy, S>(world, Case<T>::params(), max_grad_norm);
    check_same_on_every_rank(world, sharded);
    // The layout of the registry network (the visitor's has the same tensors in the same order).
    const std::vector<tensor_info> layout = [] {
        std::vector<tensor_info> l;
        std::size_t off = 0;
        for (std::size_t n : {40, 8, 8, 24, 3}) {
            l.push_back(tensor_info{"t", {n}, off, n});
            off += n;
        }
        return l;
    }();
    REQUIRE(sharded.back().size() == 83);
    REQUIRE(rel_error(ref.back(), ref.front()) > 1e-3);
    for (std::size_t s = 0; s < sharded.size(); ++s) {
        INFO("step " << s << ", max_grad_norm " << max_grad_norm);
        CHECK(max_tensor_rel_error(sharded[s], ref[s], layout) <= sharded_tolerance<T>);
    }
}

template <class T>
void check_all(double max_grad_norm) {
    SECTION("sgd") {
        check_case<T, sgd_case>(max_grad_norm);
    }
    SECTION("adam") {
        check_case<T, adam_case>(max_grad_norm);
    }
    SECTION("adamw") {
        check_case<T, adamw_case>(max_grad_norm);
    }
    SECTION("lars") {
        check_case<T, lars_case>(max_grad_norm);
    }
    SECTION("lamb") {
        check_case<T, lamb_case>(max_grad_norm);
    }
}

} // namespace

TEST_CASE("MPI: reduce::sharded trains like the unsharded bucketed trainer", "[train][mpi]") {
    SECTION("float") {
        check_all<float>(0);
    }
    SECTION("double") {
        check_all<double>(0);
    }
    SECTION("float, clipped") {
        check_all<float>(0.05);
    }
    SECTION("double, clipped") {
        check_all<double>(0.05);
    }
    SECTION("lamb, visitor network") {
        check_case<double, lamb_case, storage::visitor>(0.05);
    }
}

TEST_CASE("MPI: reduce::sharded on a communication thread equals inline bit for bit",
          "[train][mpi][overlap]") {
    mpi_communicator world(MPI_COMM_WORLD);
    const auto on = train_mpi<double, optim::lars<double>, sharded_policy, storage::registry>(
        world, lars_case<double>::params(), 0.05, overlap_mode::always);
    const auto off = train_mpi<double, optim::lars<double>, sharded_policy, storage::registry>(
        world, lars_case<double>::params(), 0.05, overlap_mode::never);
    for (std::size_t s = 0; s < on.size(); ++s)
        CHECK(same_bits(std::span<const double>(on[s]), std::span<const double>(off[s])));
}

namespace {

/// tiny_net with `inputs` weights and a bias on every rank, trained with reduce::sharded<4, 4>
/// and LAMB (its norms cross the shards) against reduce::per_tensor: the same bits on every
/// rank and within 1e-10 of the reference at every step.
void check_tiny_against_per_tensor(mpi_communicator& world, std::size_t inputs) {
    using net = tiny_net<double, mpi_communicator>;
    auto run = [&]<class Opt, class Reduce>(typename Opt::params_type op) {
        data_parallel<net, Opt, sync::synchronous, Reduce, mpi_communicator> dp(
            world, [&](auto& ctx) { return net(ctx, inputs); }, op, {.max_grad_norm = 1.0});
        if (Reduce::shards_optimizer_state && world.size() > static_cast<int>(inputs + 1) &&
            world.rank() == world.size() - 1)
            CHECK(dp.optimizer_state_bytes() == 0);
        std::vector<std::vector<double>> out;
        for (std::size_t b : batch_schedule()) {
            dp.step(b, [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
            auto v = dp.parameters();
            out.emplace_back(v.begin(), v.end());
        }
        return out;
    };
    const auto sharded =
        run.operator()<optim::lamb<double>, reduce::sharded<4, 4>>(lamb_case<double>::params());
    const auto ref =
        run.operator()<optim::lamb<double>, reduce::per_tensor>(lamb_case<double>::params());
    REQUIRE(sharded.back().size() == inputs + 1);
    check_same_on_every_rank(world, sharded);
    REQUIRE(rel_error(ref.back(), ref.front()) > 1e-3);
    // Every parameter trains, so every shard holds values the gather must carry.
    for (std::size_t k = 0; k <= inputs; ++k)
        CHECK(ref.back()[k] != ref.front()[k]);
    for (std::size_t s = 0; s < sharded.size(); ++s)
        CHECK(rel_error(sharded[s], ref[s]) <= 1e-10);
}

} // namespace

TEST_CASE("MPI: reduce::sharded with an empty shard (fewer parameters than ranks)",
          "[train][mpi]") {
    mpi_communicator world(MPI_COMM_WORLD);
    // 2 parameters over 3 ranks (rank 2's shard is empty), 3 parameters over 2 (uneven).
    check_tiny_against_per_tensor(world, world.size() >= 3 ? 1 : 2);
}

TEST_CASE("MPI: reduce::sharded with equal shards (gathered in place)", "[train][mpi]") {
    mpi_communicator world(MPI_COMM_WORLD);
    // 2 parameters per rank: the all_gather writes the flat buffer itself, no staging.
    check_tiny_against_per_tensor(world, 2 * static_cast<std::size_t>(world.size()) - 1);
}

TEST_CASE("MPI: a sharded checkpoint resumes bit for bit", "[train][mpi][checkpoint]") {
    mpi_communicator world(MPI_COMM_WORLD);
    using net = mlp<double, mpi_communicator, storage::registry>;
    using dp_type = data_parallel<net, optim::adam<double>, sync::synchronous, sharded_policy,
                                  mpi_communicator>;
    int id = ::getpid();
    MPI_Bcast(&id, 1, MPI_INT, 0, MPI_COMM_WORLD);
    const fs::path dir = fs::temp_directory_path() / ("lockstep_sharded_mpi_" + std::to_string(id));
    if (world.rank() == 0) {
        fs::remove_all(dir);
        fs::create_directories(dir);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const auto batches = batch_schedule();
    const train_params tp{.seed = 42, .max_grad_norm = 0.05};
    auto fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
    std::vector<std::byte> straight, resumed;
    {
        dp_type dp(
            world, [](auto& ctx) { return net(ctx); }, adam_case<double>::params(), tp);
        for (std::size_t s = 0; s < 10; ++s)
            dp.step(batches[s], fn);
        save_checkpoint(dp, dir / "ck");
        for (std::size_t s = 10; s < 20; ++s)
            dp.step(batches[s], fn);
        straight = fingerprint(dp);
    }
    {
        dp_type dp(
            world, [](auto& ctx) { return net(ctx); }, adam_case<double>::params(), tp);
        load_checkpoint(dp, dir / "ck");
        for (std::size_t s = 10; s < 20; ++s)
            dp.step(batches[s], fn);
        resumed = fingerprint(dp);
    }
    CHECK(straight == resumed);
    MPI_Barrier(MPI_COMM_WORLD);
    if (world.rank() == 0) {
        std::error_code ec;
        fs::remove_all(dir, ec);
    }
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv, {.requested = MPI_THREAD_MULTIPLE});
}

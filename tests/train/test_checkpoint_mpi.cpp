// Checkpoints of data_parallel over MPI (one replica per process): resuming in new trainers with
// another seed is bitwise equal to an uninterrupted run (synchronous, local SGD mid-period,
// parameter server), a background save (reduce::sharded) commits at one step on every rank and
// resumes bitwise, a checkpoint refused on one rank is refused on every rank, and two jobs saving
// to one path concurrently leave one job's checkpoint.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "mpi_shared_dir.hpp"

#include "checkpoint_support.hpp"
#include "mlp_fixture.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/async_checkpoint.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace lockstep_test;

namespace {

train_params params_for(std::uint64_t seed) {
    return {.lr =
                optim::linear_scaling{
                    .base_lr = 0.05, .base_batch = 8, .global_batch = 16, .warmup_steps = 8},
            .seed = seed};
}

std::size_t batch_of(std::int64_t step) {
    const std::size_t cycle[] = {37, 9, 12, 7, 20};
    return cycle[static_cast<std::size_t>(step) % 5];
}

template <class Sync>
using bn_for = std::conditional_t<is_local_sgd_v<Sync>, bn::running_only, bn::global>;

template <class Opt, class Sync, class Reduce, storage S>
using trainer_of = data_parallel<mlp<typename Opt::value_type, mpi_communicator, S, bn_for<Sync>>,
                                 Opt, Sync, Reduce, mpi_communicator>;

/// Trainer built with `seed`, optionally loaded, stepped to `steps`, optionally saved at
/// `save_at`; returns this rank's fingerprint.
template <class Opt, class Sync, class Reduce, storage S>
std::vector<std::byte> run(mpi_communicator& world, typename Opt::params_type op,
                           std::uint64_t seed, std::size_t steps, const fs::path& load,
                           const fs::path& save, std::size_t save_at) {
    using dp_type = trainer_of<Opt, Sync, Reduce, S>;
    using net = typename dp_type::network_type;
    dp_type dp(
        world, [](auto& ctx) { return net(ctx); }, op, params_for(seed));
    if (!load.empty())
        load_checkpoint(dp, load);
    while (static_cast<std::size_t>(dp.steps()) < steps) {
        dp.step(batch_of(dp.steps()),
                [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
        if (!save.empty() && static_cast<std::size_t>(dp.steps()) == save_at)
            save_checkpoint(dp, save);
    }
    return fingerprint(dp);
}

template <class Opt, class Sync, class Reduce, storage S>
void check_resume(typename Opt::params_type op, std::size_t save_at, std::size_t total) {
    mpi_communicator world(MPI_COMM_WORLD);
    mpi_shared_dir dir(world, "lockstep_ckpt_mpi_");
    const fs::path path = dir.path / "mpi.ckpt";
    const auto full = run<Opt, Sync, Reduce, S>(world, op, 42, total, {}, {}, 0);
    run<Opt, Sync, Reduce, S>(world, op, 42, save_at, {}, path, save_at);
    const auto resumed = run<Opt, Sync, Reduce, S>(world, op, 7, total, path, {}, 0);
    const auto other = run<Opt, Sync, Reduce, S>(world, op, 7, total, {}, {}, 0);
    CHECK(resumed == full);
    CHECK(other != full);
}

} // namespace

TEST_CASE("MPI: resuming from a checkpoint is bitwise equal to an uninterrupted run",
          "[train][checkpoint][mpi]") {
    SECTION("synchronous, bucketed, registry, SGD momentum") {
        check_resume<optim::sgd<float>, sync::synchronous, reduce::bucketed<64, 32>,
                     storage::registry>({.lr = 0.05, .momentum = 0.9}, 5, 11);
    }
    SECTION("local SGD<3>, resumed mid-period, visitor, Adam") {
        check_resume<optim::adam<float>, sync::local_sgd<3>, reduce::per_tensor, storage::visitor>(
            {.lr = 1e-2}, 5, 11);
    }
    SECTION("parameter_server<1>, registry, SGD momentum") {
        check_resume<optim::sgd<double>, sync::synchronous, reduce::parameter_server<1>,
                     storage::registry>({.lr = 0.05, .momentum = 0.9}, 4, 10);
    }
}

TEST_CASE("MPI: a background save commits at one step on every rank and resumes bitwise",
          "[train][checkpoint][mpi]") {
    using dp_type =
        trainer_of<optim::adam<float>, sync::synchronous, reduce::sharded<64>, storage::registry>;
    using net = dp_type::network_type;
    const optim::adam_params adam{.lr = 1e-2};
    mpi_communicator world(MPI_COMM_WORLD);
    mpi_shared_dir dir(world, "lockstep_ckpt_mpi_");
    const fs::path path = dir.path / "background.ckpt";
    const auto full =
        run<optim::adam<float>, sync::synchronous, reduce::sharded<64>, storage::registry>(
            world, adam, 42, 30, {}, {}, 0);
    double committed_at = -1; // the step that reported the commit (-1: none)
    {
        dp_type dp(
            world, [](auto& ctx) { return net(ctx); }, adam, params_for(42));
        const auto fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
        while (dp.steps() < 5)
            dp.step(batch_of(dp.steps()), fn);
        save_checkpoint_async(dp, path);
        while (dp.steps() < 30) {
            const step_result r = dp.step(batch_of(dp.steps()), fn);
            if (r.checkpoint == checkpoint_event::committed)
                committed_at = static_cast<double>(r.step);
            if (committed_at < 0)
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        dp.finish();
        CHECK(fingerprint(dp) == full);
    }
    // Every rank saw the commit, at the same step, before the end.
    std::vector<double> each(static_cast<std::size_t>(world.size()));
    world.all_gather(std::span<const double>(&committed_at, 1), std::span<double>(each));
    CHECK(committed_at >= 5);
    CHECK(std::all_of(each.begin(), each.end(), [&](double s) { return s == committed_at; }));
    const auto resumed =
        run<optim::adam<float>, sync::synchronous, reduce::sharded<64>, storage::registry>(
            world, adam, 7, 30, path, {}, 0);
    CHECK(resumed == full);
}

TEST_CASE("MPI: a checkpoint refused on one rank is refused on every rank, nothing loaded",
          "[train][checkpoint][mpi]") {
    using opt = optim::sgd<float>;
    using dp_type = trainer_of<opt, sync::synchronous, reduce::per_tensor, storage::registry>;
    using net = dp_type::network_type;
    mpi_communicator world(MPI_COMM_WORLD);
    mpi_shared_dir dir(world, "lockstep_ckpt_mpi_");
    const fs::path path = dir.path / "bad.ckpt";
    run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        world, {.lr = 0.05, .momentum = 0.9}, 42, 3, {}, path, 3);
    const int last = world.size() - 1;
    // The last rank's shard loses a section: only that rank sees it.
    if (world.rank() == 0)
        rewrite_shard(path, last, [](auto&, std::vector<raw_section>& s) {
            std::erase_if(s, [](const raw_section& x) { return x.name == "optimizer.momentum"; });
        });
    MPI_Barrier(MPI_COMM_WORLD);
    dp_type dp(
        world, [](auto& ctx) { return net(ctx); }, {.lr = 0.05, .momentum = 0.9}, params_for(3));
    const auto before = fingerprint(dp);
    std::string message;
    try {
        load_checkpoint(dp, path);
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::checkpoint);
        message = e.what();
    }
    INFO(message);
    CHECK(message.find("replica " + std::to_string(last) +
                       ": section 'optimizer.momentum' (f32 {83}) is missing") !=
          std::string::npos);
    CHECK(fingerprint(dp) == before);
}

TEST_CASE("MPI: two jobs (split communicators) saving to one path leave one job's checkpoint",
          "[train][checkpoint][mpi]") {
    using opt = optim::sgd<float>;
    using dp_type = trainer_of<opt, sync::synchronous, reduce::per_tensor, storage::registry>;
    using net = dp_type::network_type;
    mpi_communicator world(MPI_COMM_WORLD);
    REQUIRE(world.size() % 2 == 0);
    mpi_shared_dir dir(world, "lockstep_ckpt_mpi_");
    const fs::path path = dir.path / "shared.ckpt";
    // Even and odd ranks are two independent jobs; rank w is rank w / 2 of job w % 2.
    const int color = world.rank() % 2;
    MPI_Comm job_comm = MPI_COMM_NULL;
    REQUIRE(MPI_Comm_split(MPI_COMM_WORLD, color, world.rank(), &job_comm) == MPI_SUCCESS);
    const optim::sgd_params op{.lr = 0.05, .momentum = 0.9};
    auto step = [](dp_type& dp) {
        dp.step(batch_of(dp.steps()),
                [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
    };
    {
        mpi_communicator job(job_comm);
        dp_type dp(
            job, [](auto& ctx) { return net(ctx); }, op,
            params_for(std::uint64_t{11} + static_cast<std::uint64_t>(color)));
        int failures = 0, matches = 0, differ = 0;
        constexpr int rounds = 12;
        for (int round = 0; round < rounds; ++round) {
            step(dp);
            const auto mine = fingerprint(dp);
            std::vector<std::byte> all(mine.size() * static_cast<std::size_t>(world.size()));
            MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(),
                          static_cast<int>(mine.size()), MPI_BYTE, MPI_COMM_WORLD);
            MPI_Barrier(MPI_COMM_WORLD); // both jobs save at once
            try {
                save_checkpoint(dp, path);
            } catch (const lockstep::error&) {
                ++failures;
            }
            MPI_Barrier(MPI_COMM_WORLD);
            // Loaded by this job's replica k: replica k of job 0 or of job 1 (world rank 2k + j).
            dp_type fresh(
                job, [](auto& ctx) { return net(ctx); }, op, params_for(3));
            try {
                load_checkpoint(fresh, path);
            } catch (const lockstep::error&) {
            }
            const auto got = fingerprint(fresh);
            const int k = job.rank();
            bool any = false;
            for (int j = 0; j < 2; ++j) {
                const auto* p = all.data() + static_cast<std::size_t>(2 * k + j) * mine.size();
                any = any || std::equal(got.begin(), got.end(), p, p + mine.size());
            }
            matches += any ? 1 : 0;
            differ += std::equal(mine.begin(), mine.end(),
                                 all.data() + static_cast<std::size_t>(2 * job.rank() + 1 - color) *
                                                  mine.size())
                          ? 0
                          : 1;
            MPI_Barrier(MPI_COMM_WORLD); // every load done before the next saves
        }
        CHECK(failures == 0);
        CHECK(matches == rounds);
        CHECK(differ == rounds); // the two jobs' states differ: the loads tell them apart
    }
    MPI_Comm_free(&job_comm);
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

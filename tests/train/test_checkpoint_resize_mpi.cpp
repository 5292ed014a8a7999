// Checkpoints across replica counts over MPI (one replica per process, run with 2 and 3 ranks):
// a checkpoint saved by thread replicas of another count loads into the MPI job and the other way
// round; reduce::reproducible continues to the bits of an uninterrupted run, reduce::sharded
// holds its regathered optimizer shard bitwise and continues within 1e-12 of an uninterrupted
// run. SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "mpi_shared_dir.hpp"

#include "resize_runner.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/optim/adam.hpp"

#include <mpi.h>

#include <string>
#include <vector>

using namespace lockstep_test;

namespace {

/// 0/1 on every rank: whether every rank's `ok` holds (so that each rank reports the same).
bool all_ranks(bool ok) {
    int v = ok ? 1 : 0, all = 0;
    MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return all == 1;
}

} // namespace

TEST_CASE("MPI: reduce::reproducible resumed at another replica count keeps the bits",
          "[train][checkpoint][mpi][reproducible]") {
    mpi_communicator world(MPI_COMM_WORLD);
    const int p = world.size();
    const std::vector<std::size_t> batches = repro_schedule(12);
    constexpr std::size_t save_at = 5;
    auto full = repro_threads_resumed(1, batches, 42)[0];
    full.losses.erase(full.losses.begin(), full.losses.begin() + save_at);
    SECTION("saved by p + 1 thread replicas, resumed by the p MPI ranks") {
        mpi_shared_dir dir(world, "lockstep_resize_mpi_");
        const fs::path path = dir.path / "repro.ckpt";
        if (world.rank() == 0)
            repro_threads_resumed(p + 1, batches, 42, {}, path, save_at);
        MPI_Barrier(MPI_COMM_WORLD);
        const auto mine = repro_replica(world, batches, 7, path, {}, 0);
        INFO("rank " << world.rank() << " of " << p);
        const std::string difference = repro_difference(mine, full);
        INFO(difference);
        CHECK(difference.empty());
    }
    SECTION("saved by the p MPI ranks, resumed by 1 and p + 1 thread replicas") {
        mpi_shared_dir dir(world, "lockstep_resize_mpi_");
        const fs::path path = dir.path / "repro.ckpt";
        repro_replica(world, batches, 42, {}, path, save_at);
        MPI_Barrier(MPI_COMM_WORLD);
        bool ok = true;
        if (world.rank() == 0)
            for (int m : {1, p + 1})
                for (const auto& rec : repro_threads_resumed(m, batches, 7, path)) {
                    INFO(m << " thread replicas");
                    const std::string difference = repro_difference(rec, full);
                    INFO(difference);
                    CHECK(difference.empty());
                    ok = ok && difference.empty();
                }
        CHECK(all_ranks(ok));
    }
}

TEST_CASE("MPI: reduce::sharded regathers its optimizer state at another replica count",
          "[train][checkpoint][mpi][sharded]") {
    using opt = optim::adam<double>;
    using reduce_type = reduce::sharded<64, 32>;
    const optim::adam_params op{.lr = 1e-2};
    mpi_communicator world(MPI_COMM_WORLD);
    const int p = world.size();
    const auto r = static_cast<std::size_t>(world.rank());
    SECTION("saved by p + 1 thread replicas, loaded by the p MPI ranks") {
        mpi_shared_dir dir(world, "lockstep_resize_mpi_");
        const fs::path path = dir.path / "sharded.ckpt";
        // Every rank runs the saving threads (deterministic), rank 0's save to the file.
        const auto saved = run<opt, reduce_type, bn::global>(p + 1, op, 42, 5, {},
                                                             world.rank() == 0 ? path : fs::path{});
        MPI_Barrier(MPI_COMM_WORLD);
        const auto loaded = train_replica<opt, reduce_type, bn::global>(world, op, 7, 5, path);
        const auto own = detail::shard_layout(saved[0].params.size(), p)[r];
        INFO("rank " << r << " of " << p);
        CHECK(same_bits(loaded.params, saved[0].params));
        REQUIRE(loaded.slots.size() == saved[0].slots.size());
        for (std::size_t k = 0; k < loaded.slots.size(); ++k) {
            const std::vector<double> all = logical_slot(saved, k, true);
            const std::vector<double> want(all.begin() + static_cast<std::ptrdiff_t>(own.offset),
                                           all.begin() +
                                               static_cast<std::ptrdiff_t>(own.offset + own.count));
            CHECK(same_bits(loaded.slots[k], want));
        }
        CHECK(loaded.optimizer_steps == saved[0].optimizer_steps);
        const auto resumed = train_replica<opt, reduce_type, bn::global>(world, op, 7, 11, path);
        const auto full = run<opt, reduce_type, bn::global>(p, op, 42, 11);
        CHECK(relative_distance(resumed.params, full[r].params) <= 1e-12);
        CHECK(relative_distance(run<opt, reduce_type, bn::global>(p, op, 7, 11)[r].params,
                                full[r].params) > 1e-3);
    }
    SECTION("saved by the p MPI ranks, loaded by p + 1 and 1 thread replicas") {
        mpi_shared_dir dir(world, "lockstep_resize_mpi_");
        const fs::path path = dir.path / "sharded.ckpt";
        const auto mine = train_replica<opt, reduce_type, bn::global>(world, op, 42, 5, {}, path);
        // The logical state of the MPI run: every rank's shard, gathered in rank order.
        std::vector<std::vector<double>> logical;
        for (const auto& slot : mine.slots) {
            const int count = static_cast<int>(slot.size());
            std::vector<int> counts(static_cast<std::size_t>(p)), offsets(counts.size());
            MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
            int total = 0;
            for (std::size_t q = 0; q < counts.size(); ++q) {
                offsets[q] = total;
                total += counts[q];
            }
            logical.emplace_back(static_cast<std::size_t>(total));
            MPI_Allgatherv(slot.data(), count, MPI_DOUBLE, logical.back().data(), counts.data(),
                           offsets.data(), MPI_DOUBLE, MPI_COMM_WORLD);
        }
        bool ok = true;
        if (world.rank() == 0)
            for (int m : {p + 1, 1}) {
                INFO(m << " thread replicas");
                const auto loaded = run<opt, reduce_type, bn::global>(m, op, 7, 5, path);
                for (std::size_t k = 0; k < logical.size(); ++k) {
                    CHECK(same_bits(logical_slot(loaded, k, true), logical[k]));
                    ok = ok && same_bits(logical_slot(loaded, k, true), logical[k]);
                }
                for (const auto& l : loaded) {
                    CHECK(same_bits(l.params, mine.params));
                    ok = ok && same_bits(l.params, mine.params);
                }
                const auto resumed = run<opt, reduce_type, bn::global>(m, op, 7, 11, path);
                const auto full = run<opt, reduce_type, bn::global>(m, op, 42, 11);
                CHECK(relative_distance(resumed[0].params, full[0].params) <= 1e-12);
                ok = ok && relative_distance(resumed[0].params, full[0].params) <= 1e-12;
            }
        CHECK(all_ranks(ok));
    }
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

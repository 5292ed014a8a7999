// Pinned bits over MPI (one replica per process, run with 2 and 3 processes): reduce::reproducible
// with its two MPI exchanges (gathered, and blocks summed in place), bucketed and sharded; the
// hashes of pinned_bits.hpp recorded from commit 71fda83, as test_pinned_bits.cpp (whose header
// says what they depend on and how to re-pin: LOCKSTEP_PRINT_STEP_BITS=1, here printed by rank 0).
// reduce::reproducible's hash is the thread group's at every count; at 71fda83 bucketed and
// sharded over MPI also held the thread group's bits (both sum in rank order), pinned here
// separately all the same.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "optimizer_cases.hpp"
#include "pinned_bits.hpp"
#include "repro_runner.hpp"

#include "lockstep/comm/mpi_communicator.hpp"

#include <mpi.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

using namespace lockstep;
using namespace lockstep_test;

namespace {

const std::map<std::string, std::uint64_t> pinned = {
    // test_pinned_bits.cpp's "reproducible<8> bn::ghost<8> adam combined R1".
    {"reproducible<8> bn::ghost<8> adam", 0x4e3404b3fa434370ull},
    // PINNED-BEGIN
    {"mpi bucketed<256,64> sgd R2", 0x1e74f31ce7c53d7cull},
    {"mpi bucketed<256,64> sgd R3", 0xcd1063ec562d02e6ull},
    {"mpi sharded<256,64> uneven adam R2", 0xa81add2492225b0bull},
    {"mpi sharded<256,64> uneven adam R3", 0xb50545a60c9f12ddull},
    {"reproducible<8> bn::ghost<8> adam blocks in place mpi R2", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam blocks in place mpi R3", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam gathered mpi R2", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam gathered mpi R3", 0x4e3404b3fa434370ull},
    // PINNED-END
};

using sgd_t = sgd_case<float>;
using adam_t = adam_case<float>;

/// Every process's bits of one run over MPI_COMM_WORLD (rank order).
template <class Opt, class Reduce, class BN = bn::global>
std::vector<replica_bits> mpi_run(typename Opt::params_type op) {
    mpi_communicator world(MPI_COMM_WORLD);
    const replica_bits mine = hashed_run<float, Opt, sync::synchronous, Reduce, BN>(
        world, {.batches = pinned_schedule()}, op);
    const std::uint64_t send[2] = {mine.common, mine.state};
    std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(world.size()));
    MPI_Allgather(send, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, MPI_COMM_WORLD);
    std::vector<replica_bits> out(static_cast<std::size_t>(world.size()));
    for (std::size_t r = 0; r < out.size(); ++r) {
        out[r].common = all[2 * r];
        out[r].state = all[2 * r + 1];
    }
    out[static_cast<std::size_t>(world.rank())].collectives = mine.collectives;
    return out;
}

int world_rank() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

/// The pinned check (printed by rank 0 only) and every process's agreement with rank 0.
template <class Reduce>
void check_run(const std::string& name, const std::vector<replica_bits>& r) {
    const std::string key = name + " R" + std::to_string(r.size());
    const std::uint64_t h = combine_bits<Reduce>(r);
    if (world_rank() == 0 || !print_bits_mode()) {
        check_pinned(pinned, key, h);
    }
    for (std::size_t k = 1; k < r.size(); ++k) {
        INFO("rank " << k);
        CHECK(r[k].common == r[0].common);
    }
}

/// The collectives of every step on this process (see test_pinned_bits.cpp): gathered 1; blocks
/// in place max_calls + 2.
void check_steps(const replica_bits& mine, std::size_t replicas, bool in_place) {
    const auto batches = pinned_schedule();
    REQUIRE(mine.collectives.size() == batches.size());
    for (std::size_t s = 0; s < batches.size(); ++s) {
        const std::size_t chunks = (batches[s] + repro_chunk - 1) / repro_chunk;
        const std::size_t max_calls = (chunks + replicas - 1) / replicas;
        const std::size_t issued = mine.collectives[s] - (s == 0 ? 0 : mine.collectives[s - 1]);
        INFO("step " << s);
        CHECK(issued == (in_place ? max_calls + 2 : 1));
    }
}

} // namespace

TEST_CASE("pinned bits over MPI: reproducible, gathered and blocks in place",
          "[train][mpi][bits][reproducible]") {
    // The thread group's constant (test_pinned_bits.cpp): the same bits at every count and
    // exchange.
    const std::string name = "reproducible<8> bn::ghost<8> adam";
    const auto gathered = mpi_run<adam_t::type, repro_reduce, repro_bn>(adam_t::params());
    check_steps(gathered[static_cast<std::size_t>(world_rank())], gathered.size(), false);
    check_run<repro_reduce>(name + " gathered mpi", gathered);
    const auto blocks = mpi_run<adam_t::type, repro_blocks, repro_bn>(adam_t::params());
    check_steps(blocks[static_cast<std::size_t>(world_rank())], blocks.size(), true);
    check_run<repro_blocks>(name + " blocks in place mpi", blocks);
    CHECK(combine_bits<repro_reduce>(gathered) == pinned.at("reproducible<8> bn::ghost<8> adam"));
    CHECK(combine_bits<repro_blocks>(blocks) == pinned.at("reproducible<8> bn::ghost<8> adam"));
}

TEST_CASE("pinned bits over MPI: bucketed and sharded", "[train][mpi][bits]") {
    check_run<reduce::bucketed<256, 64>>(
        "mpi bucketed<256,64> sgd",
        mpi_run<sgd_t::type, reduce::bucketed<256, 64>>(sgd_t::params()));
    check_run<reduce::sharded<256, 64>>(
        "mpi sharded<256,64> uneven adam",
        mpi_run<adam_t::type, reduce::sharded<256, 64>>(adam_t::params()));
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

// train_params::report_stragglers_every over MPI (one replica per process): the last rank sleeps
// in every step and every rank's report names it with its delay within 20 %.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "straggler_cases.hpp"

#include "lockstep/comm/mpi_communicator.hpp"

using namespace lockstep_test;

TEST_CASE("MPI: the rank that sleeps in every step is named with its delay",
          "[train][mpi][straggler]") {
    mpi_communicator world(MPI_COMM_WORLD);
    const int slow = world.size() - 1;
    const auto seen = run_straggler(world, slow, 4, 2);
    REQUIRE(seen.size() == 4);
    CHECK(!seen[0]); // the first step is in no window
    REQUIRE(seen[1]);
    CHECK(seen[1]->first_step == 1);
    CHECK(seen[1]->last_step == 1);
    REQUIRE(seen[3]);
    const straggler_report& r = *seen[3];
    CHECK(r.first_step == 2);
    CHECK(r.last_step == 3);
    CHECK(r.slowest == slow);
    CHECK(r.lag_seconds ==
          Approx(std::chrono::duration<double>(straggler_delay).count()).epsilon(0.2));
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

// tests/train/test_mismatch_mpi.cpp: the mistakes of mismatch_cases.hpp over MPI (one replica
// per process): the codes and causes test_mismatch.cpp checks on the thread group.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "mismatch_cases.hpp"

#include "lockstep/comm/mpi_communicator.hpp"

using namespace lockstep_test::mismatch;

TEST_CASE("MPI: a mistake that splits the replicas names its cause, with the thread group's code",
          "[train][mpi]") {
    for (const mistake m : all_mistakes) {
        CAPTURE(static_cast<int>(m));
        lockstep::mpi_communicator world(MPI_COMM_WORLD);
        const outcome o = run(world, m);
        INFO(o.message);
        CHECK(o.threw);
        CHECK(o.code == expected_code(m));
        for (const std::string& part : expected_parts(m, world.size()))
            CHECK(o.message.find(part) != std::string::npos);
    }
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

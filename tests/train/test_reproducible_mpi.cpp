// reduce::reproducible<8> with bn::ghost<8> over MPI (one replica per process): every process
// holds the bits of 1 and of 3 thread replicas run in the same process, for SGD, AdamW and LAMB
// in float and double, with the exchange that gathers every chunk (the test network is small)
// and with the one by blocks (reduce::reproducible<8, 0>); both name an overflowing sum and the
// replica of a NaN. SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "optimizer_cases.hpp"
#include "repro_runner.hpp"

#include "lockstep/comm/mpi_communicator.hpp"

using namespace lockstep_test;

namespace {

template <class T, template <class> class Case>
void check_mpi() {
    using Opt = typename Case<T>::type;
    const auto p = Case<T>::params();
    mpi_communicator world(MPI_COMM_WORLD);
    const auto batches = repro_schedule();
    const repro_record<T> mine = repro_train<T, Opt>(world, p, batches);
    const repro_record<T> blocks =
        repro_train<T, Opt, mpi_communicator, repro_blocks>(world, p, batches);
    const auto one = repro_threads<T, Opt>(1, p, batches);
    const auto three = repro_threads<T, Opt>(3, p, batches);
    INFO("rank " << world.rank() << " of " << world.size());
    CHECK(repro_difference(mine, one[0]) == "");
    CHECK(repro_difference(mine, three[2]) == "");
    CHECK(repro_difference(blocks, one[0]) == "");
}

} // namespace

TEMPLATE_TEST_CASE("MPI replicas under reduce::reproducible hold the bits of thread replicas",
                   "[train][reproducible][mpi]", float, double) {
    using T = TestType;
    SECTION("sgd") {
        check_mpi<T, sgd_case>();
    }
    SECTION("adamw") {
        check_mpi<T, adamw_case>();
    }
    SECTION("lamb") {
        check_mpi<T, lamb_case>();
    }
}

// Over MPI the blocks exchange sums each block where the values lie and reports what it saw: an
// overflowing sum and a NaN's replica are named as on threads; the gathered exchange (the test
// network is small) counts them in the gradient.
TEMPLATE_TEST_CASE("MPI replicas under reduce::reproducible name an overflowing sum and the "
                   "replica of a NaN",
                   "[train][reproducible][mpi]", repro_reduce, repro_blocks) {
    mpi_communicator world(MPI_COMM_WORLD);
    INFO("rank " << world.rank() << " of " << world.size());
    CHECK_THAT(extreme_step_message<TestType>(world, true, 99),
               Catch::Contains("the reduced gradient has 1 non-finite element(s) (the sum over "
                               "replicas overflowed), the first in 'w' (element 0)"));
    // Chunk 2 of 4 lies on rank 1 of 2 and of 3.
    const std::string nan = extreme_step_message<TestType>(world, false, 2);
    CHECK_THAT(nan, Catch::Contains("1 non-finite gradient element(s) on replica 1, the first in "
                                    "'w' (element 2)"));
    CHECK_THAT(nan, !Catch::Contains("overflowed"));
    CHECK(extreme_step_message<TestType>(world, false, 99) == "");
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

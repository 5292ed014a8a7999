// mpi_communicator (verification on) against a replica that swaps, skips or adds a collective:
// an error on every rank naming the sequence number and both calls, and no wrong value. Its own
// Catch2 main; CTest runs it with 3 ranks. SPDX-License-Identifier: Apache-2.0

#include "support/contains.hpp"
#include "support/mpi_session.hpp"

#include "call_identity_cases.hpp"
#include "lockstep/comm/mpi_communicator.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <span>
#include <string>
#include <vector>

using lockstep::mpi_communicator;
using lockstep::reduce_op;
using lockstep::testing::call_fault;

using lockstep_test::contains;

namespace {

// Runs every fault of `faults` on this rank and checks the error that names both calls.
template <class Faults>
void check_faults(mpi_communicator& comm, const Faults& faults) {
    for (auto f : faults) {
        CAPTURE(static_cast<int>(f));
        const auto first = static_cast<std::uint64_t>(comm.sequence() + 1);
        lockstep::testing::fault_outcome o;
        try {
            o = lockstep::testing::run_call_fault(comm, f);
        } catch (const std::exception& e) {
            comm.abort(e); // anything but a lockstep::error would leave the peers waiting
        }
        const auto want = lockstep::testing::expected_fault(f, first);
        CAPTURE(o.what);
        CHECK(o.threw);
        CHECK(o.replica == comm.rank());
        CHECK(contains(o.what, want.odd));
        CHECK(contains(o.what, want.normal));
        CHECK(contains(o.what, want.odd_tag));
        CHECK(contains(o.what, want.normal_tag));
        if (want.sites)
            CHECK(lockstep::testing::named_sites(o.what).size() == 2);
        CHECK(o.buffers_ok);
        // The communicator stays usable and every rank is at the same collective again.
        CHECK_FALSE(comm.broken());
        std::vector<int> one{1};
        comm.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
        CHECK(one[0] == comm.size());
    }
}

} // namespace

TEST_CASE("a swapped, skipped or extra collective fails on every rank, naming both calls",
          "[comm][mpi][failure]") {
    for (const bool sites : {false, true}) {
        CAPTURE(sites);
        mpi_communicator comm(MPI_COMM_WORLD, {.check_call_sites = sites});
        REQUIRE(comm.size() >= 2);
        check_faults(comm, lockstep::testing::default_faults);
    }
}

TEST_CASE("with call sites checked, same-shape untagged calls swapped or skipped fail on every "
          "rank, naming both sites",
          "[comm][mpi][failure]") {
    mpi_communicator comm(MPI_COMM_WORLD, {.check_call_sites = true});
    REQUIRE(comm.size() >= 2);
    check_faults(comm, lockstep::testing::site_faults);
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

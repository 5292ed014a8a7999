// Tests of lockstep::error and LOCKSTEP_REQUIRE. SPDX-License-Identifier: Apache-2.0
#include "lockstep/core/error.hpp"

#include <catch2/catch.hpp>

#include <stdexcept>

TEST_CASE("error names the replica, the operation and the values", "[core]") {
    try {
        const int n = 7;
        LOCKSTEP_REQUIRE(n == 3, lockstep::errc::count_mismatch, 2, "all_reduce #5", "got ", n,
                         " elements, expected ", 3);
        FAIL("LOCKSTEP_REQUIRE did not throw");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::count_mismatch);
        CHECK(e.replica() == 2);
        CHECK(e.operation() == "all_reduce #5");
        CHECK(e.details() == "got 7 elements, expected 3");
        CHECK(std::string(e.what()) ==
              "lockstep error [count_mismatch] replica 2: all_reduce #5: got 7 elements, "
              "expected 3");
    }
}

TEST_CASE("error without a replica leaves the replica out", "[core]") {
    const lockstep::error e(lockstep::errc::invalid_argument, -1, "shard", "global batch -1");
    CHECK(std::string(e.what()) == "lockstep error [invalid_argument] shard: global batch -1");
    CHECK_NOTHROW([] { LOCKSTEP_REQUIRE(true, lockstep::errc::internal, 0, "x", "never"); }());
}

TEST_CASE("exit_status asks a launcher to try again only for a lost peer", "[core]") {
    using lockstep::errc;
    auto status = [](errc c) { return lockstep::exit_status(lockstep::error(c, 1, "op", "x")); };
    CHECK(status(errc::timeout) == 75);
    CHECK(status(errc::communication) == 75);
    for (errc c : {errc::invalid_argument, errc::peer_failure, errc::non_finite, errc::checkpoint,
                   errc::mpi, errc::divergence, errc::internal})
        CHECK(status(c) == 1);
    CHECK(lockstep::exit_status(std::runtime_error("not lockstep's")) == 1);
}

// NCCL_LAUNCH_ORDER_IMPLICIT is in the environment before main (set during static
// initialisation by a program that includes nccl_communicator.hpp), before any communicator or
// thread exists, and a value the environment gave is kept. Needs no GPU (the executable still
// reports skipped where none exists). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

TEST_CASE("NCCL_LAUNCH_ORDER_IMPLICIT is set before main, and an environment value is kept",
          "[comm][nccl]") {
    // No communicator is created in this executable: only static initialisation can have set it.
    const char* value = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
    // CTest runs this test twice: without the variable (expect "1") and with it set to 0.
    const char* expected = std::getenv("LOCKSTEP_TEST_EXPECT_LAUNCH_ORDER");
    REQUIRE(value != nullptr);
    CHECK(std::string(value) == std::string(expected != nullptr ? expected : "1"));
}

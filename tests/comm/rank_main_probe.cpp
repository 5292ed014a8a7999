// tests/comm/rank_main_probe.cpp: a multi-rank Catch2 executable (rank_main) for the launcher's
// tests: a case that passes on every rank, and two whose assertion fails on rank 1 only.
// SPDX-License-Identifier: Apache-2.0
#include "support/rank_launcher.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace ranks = lockstep_test::ranks;

TEST_CASE("rank main probe: passes on every rank", "[pass]") {
    REQUIRE(ranks::is_rank_process());
    const std::vector<std::byte> id(128, std::byte{42});
    const auto got = ranks::share_from_rank0(ranks::rank() == 0 ? id : std::vector<std::byte>{});
    CHECK(got == id);
}

TEST_CASE("rank main probe: fails on rank 1 only", "[fail]") {
    REQUIRE(ranks::rank() != 1);
}

// Rank 1 fails before the share the others wait in: they get the launcher's "failed" (an
// exception) instead of waiting for rank 1.
TEST_CASE("rank main probe: fails on rank 1 while the others share", "[fail_share]") {
    REQUIRE(ranks::rank() != 1);
    const std::vector<std::byte> id(128, std::byte{7});
    (void)ranks::share_from_rank0(ranks::rank() == 0 ? id : std::vector<std::byte>{});
}

// The listener ends every rank after a failed case: a rank that got here would wait for rank 1
// in a collective, so it exits 5 instead, which the launcher tests see as a wrong exit code.
TEST_CASE("rank main probe: never reached after a failed case", "[fail][fail_share]") {
    std::fprintf(stderr, "rank %d: ran the case after a failed one\n", ranks::rank());
    std::_Exit(5);
}

int main(int argc, char** argv) {
    return ranks::rank_main(argc, argv, nullptr, 77);
}

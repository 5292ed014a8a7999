// file_coordinator across processes (the rank launcher, 3 ranks on the CPU): the survivors of a
// generation take one decision on who continues, the same on every rank; a member that never
// comes (SIGKILLed) or comes after the deadline is left out, and one left out cannot join the
// next generation; every survivor gets the first survivor's shared bytes, and waits for them at
// most its timeout; a directory holding an earlier run's decisions is refused.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/file_coordinator.hpp"

#include "support/rank_launcher.hpp"
#include "support/rank_shared_dir.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace ranks = lockstep_test::ranks;
using lockstep::errc;
using lockstep::file_coordinator;
using namespace std::chrono_literals;

using ranks::shared_dir;

const std::vector<int> all3{0, 1, 2};

std::vector<std::byte> bytes_of(const std::string& text) {
    std::vector<std::byte> out(text.size());
    std::memcpy(out.data(), text.data(), text.size());
    return out;
}

} // namespace

TEST_CASE("file_coordinator: when every member comes, all continue, in every generation",
          "[coordinator]") {
    REQUIRE(ranks::size() == 3);
    shared_dir dir("lockstep_coordinator");
    const file_coordinator c(dir.path());
    const int me = ranks::rank();
    CHECK(c(0, me, all3, 30s) == all3);
    CHECK(c(1, me, all3, 30s) == all3);
    // share: every survivor gets the first survivor's bytes, and only the first one makes them.
    int made = 0;
    const auto mine = [&] {
        ++made;
        return bytes_of("from member " + std::to_string(me));
    };
    CHECK(c.share(1, me, all3, 30s, mine) == bytes_of("from member 0"));
    CHECK(made == (me == 0 ? 1 : 0));
    REQUIRE(ranks::agree(true, "done with the directory"));
}

TEST_CASE("file_coordinator: a member that comes after the deadline is left out and cannot join "
          "the next generation",
          "[coordinator]") {
    shared_dir dir("lockstep_coordinator");
    const file_coordinator c(dir.path());
    const int me = ranks::rank();
    std::vector<int> got;
    if (me != 2) {
        const auto start = std::chrono::steady_clock::now();
        got = c(0, me, all3, 300ms);
        // Nobody published before the deadline: rank 2 had not come.
        CHECK(std::chrono::steady_clock::now() - start >= 300ms);
        CHECK(got == std::vector<int>{0, 1});
    }
    REQUIRE(ranks::agree(true, "ranks 0 and 1 have the decision"));
    if (me == 2) {
        got = c(0, me, all3, 30s); // late: it sees the decision without itself
        CHECK(got == std::vector<int>{0, 1});
        // Fenced: it is no member of generation 1.
        try {
            (void)c(1, me, got, 30s);
            FAIL("a member left out joined the next generation");
        } catch (const lockstep::error& e) {
            CHECK(e.code() == errc::invalid_argument);
        }
    } else {
        CHECK(c(1, me, got, 30s) == got);
    }
    REQUIRE(ranks::agree(true, "done with the directory"));
}

TEST_CASE("file_coordinator: a directory with an earlier run's decision is refused",
          "[coordinator]") {
    shared_dir dir("lockstep_coordinator");
    if (ranks::rank() == 0) {
        const std::filesystem::path own = std::filesystem::path(dir.path()) / "rank0";
        const file_coordinator c(own);
        CHECK(c(0, 0, std::vector<int>{0}, 1s) == std::vector<int>{0});
        try {
            const file_coordinator again(own);
            FAIL("a directory holding g0.decision was accepted");
        } catch (const lockstep::error& e) {
            CHECK(e.code() == errc::invalid_argument);
            CHECK(std::string(e.what()).find("g0.decision") != std::string::npos);
        }
        CHECK_THROWS_AS(c(0, 3, std::vector<int>{0, 1}, 1s), lockstep::error); // not a member
        CHECK_THROWS_AS(c(0, 0, std::vector<int>{0}, 0ms), lockstep::error);   // no deadline
        // share: a first survivor (member 0) that never shares is waited for until the timeout.
        const auto start = std::chrono::steady_clock::now();
        try {
            (void)c.share(7, 1, std::vector<int>{0, 1}, 200ms, [] { return bytes_of("x"); });
            FAIL("share returned without the first survivor's bytes");
        } catch (const lockstep::error& e) {
            CHECK(e.code() == errc::timeout);
            CHECK(std::string(e.what()).find("member 0") != std::string::npos);
        }
        CHECK(std::chrono::steady_clock::now() - start >= 200ms);
    }
}

// Declared last: afterwards the executable runs with one rank fewer.
TEST_CASE("file_coordinator: the survivors of a SIGKILLed member leave it out", "[coordinator]") {
    shared_dir dir("lockstep_coordinator");
    const file_coordinator c(dir.path());
    const int me = ranks::rank();
    REQUIRE(ranks::agree(true, "directory shared"));
    if (me == 2) {
        ranks::planned_exit();
        std::fflush(nullptr);
        std::raise(SIGKILL);
    }
    CHECK(c(0, me, all3, 500ms) == std::vector<int>{0, 1});
    CHECK(c.share(0, me, std::vector<int>{0, 1}, 30s,
                  [&] { return bytes_of(std::to_string(me)); }) == bytes_of("0"));
    CHECK(c(1, me, std::vector<int>{0, 1}, 30s) == std::vector<int>{0, 1});
    REQUIRE(ranks::agree(true, "done with the directory"));
}

int main(int argc, char** argv) {
    return ranks::rank_main(argc, argv, nullptr, 77);
}

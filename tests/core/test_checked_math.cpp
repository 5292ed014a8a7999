// Tests of the overflow-checked size arithmetic and the LOCKSTEP_TIMEOUT parser.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/checked_math.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

using lockstep::errc;

using lockstep_test::contains;

namespace {
template <class F>
std::string message_of(F f) {
    try {
        f();
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::invalid_argument);
        return e.what();
    }
    FAIL("no lockstep::error");
    return {};
}
} // namespace

TEST_CASE("checked_mul and checked_product detect overflow exactly", "[core]") {
    const std::size_t big = std::size_t(1) << 63;
    std::size_t out = 0;
    CHECK_FALSE(lockstep::mul_overflows(big, 1, &out));
    CHECK(out == big);
    CHECK(lockstep::mul_overflows(big, 2, &out));
    CHECK(lockstep::checked_mul(1u << 20, 1u << 20, 3, "op", "n") == std::size_t(1) << 40);
    const std::string m = message_of([&] { lockstep::checked_mul(big + 1, 2, 3, "op", "n"); });
    CHECK(contains(m, "replica 3: op: n: 9223372036854775809 * 2 overflows"));
    CHECK(lockstep::checked_product(std::vector<std::size_t>{3, 4, 5}, -1, "op", "t") == 60);
    CHECK(lockstep::checked_product(std::vector<std::size_t>{}, -1, "op", "t") == 1);
    // {2^63 + 1, 2} wraps to 2 without the check.
    const std::string p = message_of([&] {
        lockstep::checked_product(std::vector<std::size_t>{big + 1, 2}, -1, "op", "'w'");
    });
    CHECK(contains(p, "'w' of shape {9223372036854775809, 2}"));
    // 2^62 + 1 floats: 2^64 + 4 bytes wraps to 4 without the check.
    const std::string b = message_of(
        [&] { lockstep::checked_bytes((std::size_t(1) << 62) + 1, 4, -1, "buffer", "bytes"); });
    CHECK(contains(b, "overflows"));
    // Fits in size_t but no object can be that large.
    const std::string c = message_of(
        [&] { lockstep::checked_bytes(std::size_t(1) << 62, 2, -1, "buffer", "bytes"); });
    CHECK(contains(c, "PTRDIFF_MAX"));
    CHECK(lockstep::checked_add(2, 3, -1, "op", "x") == 5);
    message_of([&] { lockstep::checked_add(big, big, -1, "op", "x"); });
}

TEST_CASE("LOCKSTEP_TIMEOUT values: positive seconds, garbage refused", "[core]") {
    using std::chrono::milliseconds;
    CHECK(lockstep::parse_timeout_seconds("2") == milliseconds(2000));
    CHECK(lockstep::parse_timeout_seconds("0.25") == milliseconds(250));
    CHECK(lockstep::parse_timeout_seconds(" 30 ") == milliseconds(30000));
    CHECK(lockstep::parse_timeout_seconds("0.0001") == milliseconds(1)); // rounded up
    for (const char* bad : {"", "x", "0", "-1", "nan", "inf", "5 min", "1e10"}) {
        CAPTURE(bad);
        CHECK(contains(message_of([&] { lockstep::parse_timeout_seconds(bad); }),
                       "LOCKSTEP_TIMEOUT"));
    }
}

// Tests of core/detail/fnv1a.hpp against the published 64-bit FNV-1a test vectors (Fowler, Noll,
// Vo: "FNV-1a 64" of "", "a" and "foobar"), and of its three entry points against each other.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/core/detail/fnv1a.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>

using lockstep::detail::fnv1a;
using lockstep::detail::fnv1a_basis;
using lockstep::detail::fnv1a_bytes;
using lockstep::detail::fnv1a_u64;

TEST_CASE("fnv1a gives the published 64-bit FNV-1a values", "[core][fnv1a]") {
    static_assert(fnv1a("") == 0xcbf29ce484222325ull); // the offset basis
    static_assert(fnv1a("a") == 0xaf63dc4c8601ec8cull);
    CHECK(fnv1a("foobar") == 0x85944171f73967e8ull);
    CHECK(fnv1a_basis == 0xcbf29ce484222325ull);
}

TEST_CASE("fnv1a continues from a given state, byte for byte", "[core][fnv1a]") {
    const std::string s = "parameter\tfc1.weight\t{4, 3}\tfloat\xff";
    CHECK(fnv1a(s.substr(7), fnv1a(s.substr(0, 7))) == fnv1a(s));
    CHECK(fnv1a_bytes(s.data(), s.size()) == fnv1a(s));
    CHECK(fnv1a_bytes(s.data(), s.size(), 99) == fnv1a(s, 99));
}

TEST_CASE("fnv1a_u64 hashes the 8 bytes least significant first", "[core][fnv1a]") {
    const std::uint64_t v = 0x0807060504030201ull;
    CHECK(fnv1a_u64(v, fnv1a_basis) == fnv1a(std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8)));
    CHECK(fnv1a_u64(0, 5) == fnv1a(std::string(8, '\0'), 5));
}

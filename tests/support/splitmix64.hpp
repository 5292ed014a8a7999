// tests/support/splitmix64.hpp: splitmix64, the tests' deterministic stream of random words.
// Test support, not public API. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>

namespace lockstep_test {

/// splitmix64: next() walks a fixed stream from the seed s.
struct splitmix64 {
    std::uint64_t s;
    std::uint64_t next() {
        std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    /// A word below n (0 when n is 0).
    std::size_t below(std::size_t n) { return n == 0 ? 0 : next() % n; }
};

} // namespace lockstep_test

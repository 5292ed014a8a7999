// tests/kernels/sum_terms.hpp: what the order-independent sum tests (test_exact_sum,
// test_anchored_sum) share: random terms over an exponent range and a bitwise comparison.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace sum_terms {

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// `terms` rows of n values with random signs and exponents in [lo, hi] (and some exact zeros).
template <class T>
std::vector<std::vector<T>> random_terms(std::size_t terms, std::size_t n, int lo, int hi,
                                         std::uint32_t seed) {
    std::mt19937_64 gen(seed);
    std::uniform_real_distribution<double> mant(1.0, 2.0);
    std::uniform_int_distribution<int> ex(lo, hi);
    std::vector<std::vector<T>> out(terms, std::vector<T>(n));
    for (auto& row : out)
        for (T& v : row) {
            const double m = (gen() & 1 ? -1 : 1) * mant(gen);
            v = gen() % 17 == 0 ? T(0) : static_cast<T>(std::ldexp(m, ex(gen)));
        }
    return out;
}

} // namespace sum_terms

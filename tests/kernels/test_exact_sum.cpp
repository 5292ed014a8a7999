// Tests of the binned exact sums (kernels/exact_sum.hpp): order and grouping independence
// (shuffled additions, simulated replicas), extreme exponents, zeros, signs, non-finite values,
// against an exact 128-bit integer reference. SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/exact_sum.hpp"

#include "sum_terms.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

using namespace lockstep;
using kernels::binned;
using sum_terms::random_terms;
using sum_terms::same_bits;

namespace {

__extension__ using i128 = __int128;

/// n host accumulators (the layout the trainer uses: window j of element i at j * n + i).
struct host_acc {
    explicit host_acc(std::size_t count) : n(count), top(count), bins(binned::window * count) {
        for (std::size_t i = 0; i < n; ++i)
            kernels::binned_clear_fn{top.data(), bins.data(), n}(i);
    }
    template <class V>
    void add(const std::vector<V>& x) {
        for (std::size_t i = 0; i < n; ++i)
            kernels::binned_add_fn<V>{x.data(), top.data(), bins.data(), n}(i);
    }
    template <class Out>
    std::vector<Out> value(const std::vector<std::int64_t>& tops) const {
        std::vector<Out> out(n);
        for (std::size_t i = 0; i < n; ++i)
            kernels::binned_finalize_fn<Out>{tops.data(), bins.data(), n, 0, out.data()}(i);
        return out;
    }
    template <class Out>
    std::vector<Out> value() const {
        return value<Out>(top);
    }
    std::size_t n;
    std::vector<std::int64_t> top, bins;
};

/// The cross-replica reduction of kernels' view, on the host: MAX of tops, align, SUM of bins.
template <class Out>
std::vector<Out> reduce_replicas(std::vector<host_acc>& parts) {
    const std::size_t n = parts[0].n;
    std::vector<std::int64_t> global(n, binned::empty_top);
    for (const host_acc& p : parts)
        for (std::size_t i = 0; i < n; ++i)
            global[i] = std::max(global[i], p.top[i]);
    host_acc sum(n);
    for (host_acc& p : parts) {
        for (std::size_t i = 0; i < n; ++i)
            kernels::binned_align_fn{global.data(), p.top.data(), p.bins.data(), n}(i);
        for (std::size_t k = 0; k < sum.bins.size(); ++k)
            sum.bins[k] += p.bins[k];
    }
    return sum.value<Out>(global);
}

} // namespace

TEMPLATE_TEST_CASE("binned sums do not depend on the order or grouping of additions",
                   "[kernels][exact_sum]", float, double) {
    using T = TestType;
    const int span = std::is_same_v<T, float> ? 120 : 900;
    const std::size_t n = 64, terms = 200;
    const auto x = random_terms<T>(terms, n, -span, span, 7);
    host_acc in_order(n);
    for (const auto& row : x)
        in_order.add(row);
    const std::vector<T> ref = in_order.value<T>();

    std::vector<std::size_t> perm(terms);
    for (std::size_t i = 0; i < terms; ++i)
        perm[i] = i;
    std::mt19937 gen(11);
    for (int trial = 0; trial < 5; ++trial) {
        std::shuffle(perm.begin(), perm.end(), gen);
        host_acc shuffled(n);
        for (std::size_t k : perm)
            shuffled.add(x[k]);
        CHECK(same_bits(shuffled.value<T>(), ref));
        // The same terms over 1..8 simulated replicas, each taking a contiguous run.
        for (int replicas : {1, 2, 3, 5, 8}) {
            std::vector<host_acc> parts(static_cast<std::size_t>(replicas), host_acc(n));
            for (std::size_t k = 0; k < terms; ++k)
                parts[k * static_cast<std::size_t>(replicas) / terms].add(x[perm[k]]);
            INFO("replicas " << replicas);
            CHECK(same_bits(reduce_replicas<T>(parts), ref));
        }
    }
}

TEST_CASE("binned sums match an exact 128-bit reference", "[kernels][exact_sum]") {
    // float values with exponents in [-30, 30]: every value is an integer multiple of 2^-53 and
    // below 2^31, so sum * 2^53 is exact in __int128, and the 3 bins keep every bit.
    const std::size_t n = 32, terms = 1000;
    const auto x = random_terms<float>(terms, n, -30, 30, 3);
    host_acc acc(n);
    for (const auto& row : x)
        acc.add(row);
    const std::vector<double> got = acc.value<double>();
    const std::vector<float> got_f = acc.value<float>();
    for (std::size_t i = 0; i < n; ++i) {
        i128 exact = 0;
        for (const auto& row : x)
            exact += static_cast<i128>(std::ldexp(static_cast<double>(row[i]), 53));
        const double ref = std::ldexp(static_cast<double>(exact), -53);
        INFO("element " << i);
        CHECK(std::abs(got[i] - ref) <= std::abs(ref) * 0x1p-52);
        CHECK(got_f[i] == static_cast<float>(got[i]));
    }
}

TEST_CASE("binned sums: cancellation, extreme exponents, zeros and non-finite values",
          "[kernels][exact_sum]") {
    const double big = std::numeric_limits<double>::max() / 4;
    const double tiny = std::numeric_limits<double>::denorm_min();
    // element: 0 cancellation 1e20 + 1 - 1e20, 1 huge values, 2 subnormals, 3 zeros only,
    // 4 x + (-x), 5 a NaN, 6 an infinity, 7 -0 only
    const std::vector<std::vector<double>> rows = {
        {1e20, big, tiny, 0.0, 3.25, 1.0, 1.0, -0.0},
        {1.0, big, tiny, 0.0, -3.25, std::nan(""), std::numeric_limits<double>::infinity(), -0.0},
        {-1e20, -big, 3 * tiny, -0.0, 0.0, 2.0, -1.0, -0.0},
    };
    std::vector<std::vector<double>> orders[] = {rows, {rows[2], rows[0], rows[1]}};
    std::vector<double> first;
    for (const auto& order : orders) {
        host_acc acc(8);
        for (const auto& row : order)
            acc.add(row);
        const std::vector<double> v = acc.value<double>();
        CHECK(v[0] == 1.0); // a plain double sum gives 0
        CHECK(v[1] == big);
        CHECK(v[2] == 5 * tiny);
        CHECK(std::bit_cast<std::uint64_t>(v[3]) == 0);
        CHECK(v[4] == 0.0);
        CHECK(std::isnan(v[5]));
        CHECK(std::isnan(v[6]));
        CHECK(std::bit_cast<std::uint64_t>(v[7]) == 0);
        if (first.empty())
            first = v;
        else
            CHECK(same_bits(v, first));
    }
    // Overflow of the true sum gives an infinity.
    host_acc acc(1);
    acc.add(std::vector<double>{std::numeric_limits<double>::max()});
    acc.add(std::vector<double>{std::numeric_limits<double>::max()});
    CHECK(acc.value<double>()[0] == std::numeric_limits<double>::infinity());
    CHECK(acc.value<float>()[0] == std::numeric_limits<float>::infinity());
    // float inputs and a double loss share the representation.
    host_acc mixed(1);
    mixed.add(std::vector<float>{0.1f});
    mixed.add(std::vector<double>{-static_cast<double>(0.1f)});
    mixed.add(std::vector<float>{0x1p-60f});
    CHECK(mixed.value<float>()[0] == 0x1p-60f);
}

TEST_CASE("binned sums keep values far below the largest within 2^-80 of it",
          "[kernels][exact_sum]") {
    // 1 + 2^-130: the 2^-130 part falls below the 3-bin window of 1.0's top bin and is dropped
    // in every order (the documented bound), so both orders give exactly 1.
    host_acc a(1), b(1);
    a.add(std::vector<double>{1.0});
    a.add(std::vector<double>{0x1p-130});
    b.add(std::vector<double>{0x1p-130});
    b.add(std::vector<double>{1.0});
    CHECK(a.value<double>()[0] == 1.0);
    CHECK(same_bits(a.value<double>(), b.value<double>()));
    // 1 + 2^-60 is kept (within the window) and exact in the double-double conversion.
    host_acc c(1);
    c.add(std::vector<double>{0x1p-60});
    c.add(std::vector<double>{1.0});
    c.add(std::vector<double>{-1.0});
    CHECK(c.value<double>()[0] == 0x1p-60);
}

TEST_CASE("scale_by_power_of_two gives ldexp's bits over the whole exponent range",
          "[kernels][exact_sum]") {
    // The integers binned_value scales: the 32-bit halves of its bins (0 .. 2^32 - 1, and signed
    // upper halves down to -2^31), plus values up to 2^63 and zeros of both signs.
    const double xs[] = {0.0,           -0.0,         1.0,        -1.0,   3.0,     4294967295.0,
                         -2147483648.0, 2147483647.0, 0x1p53 - 1, 0x1p63, -0x1p63, 123456789.0};
    std::size_t differ = 0, checked = 0;
    for (const double x : xs)
        for (int e = -1200; e <= 1100; ++e) {
            const double want = std::ldexp(x, e);
            const double got = lockstep::kernels::detail::scale_by_power_of_two(x, e);
            differ += std::bit_cast<std::uint64_t>(want) != std::bit_cast<std::uint64_t>(got);
            ++checked;
        }
    CHECK(checked == std::size_t{12} * 2301);
    CHECK(differ == 0);
}

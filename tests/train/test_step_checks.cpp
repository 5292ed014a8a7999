// The gradient checks' reduction order (train/detail/check_order.hpp) on the host: counts, first
// indices and squared norms of gradient_checks<host_system> against an independent recursive
// reference of the stated order, bit for bit, over sizes around the tile and lane widths and with
// NaN/inf at tile edges. SPDX-License-Identifier: Apache-2.0
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/detail/step_checks.hpp"
#include "lockstep/train/step_state.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using namespace lockstep;

namespace {

/// The pairwise tree over v[lo, lo + n) as the definition reads: a node over n > 1 leaves splits
/// at the largest power of two below n.
double tree(const std::vector<double>& v, std::size_t lo, std::size_t n) {
    if (n == 0)
        return 0.0;
    if (n == 1)
        return v[lo];
    std::size_t half = 1;
    while (2 * half < n)
        half *= 2;
    return tree(v, lo, half) + tree(v, lo + half, n - half);
}

/// The sum of squares of x[begin, end) in the documented order: tiles of 2^14, lane i % 256 of a
/// tile adding its squares in order, the tree over the 256 lanes, the tree over the tiles.
template <class T>
double ordered_squares(const std::vector<T>& x, std::size_t begin, std::size_t end) {
    std::vector<double> tiles;
    for (std::size_t b = begin; b < end; b += 16384) {
        std::vector<double> lanes(256, 0.0);
        for (std::size_t i = b; i < end && i < b + 16384; ++i) {
            const double v = static_cast<double>(x[i]);
            const double sq = v * v;
            lanes[(i - b) % 256] += sq;
        }
        tiles.push_back(tree(lanes, 0, 256));
    }
    return tree(tiles, 0, tiles.size());
}

/// Data of mixed magnitudes, so that different summation orders round differently.
template <class T>
std::vector<T> gradient(std::size_t n, unsigned seed) {
    std::vector<T> g(n);
    for (std::size_t i = 0; i < n; ++i) {
        const double scale = std::ldexp(1.0, static_cast<int>((i * 7 + seed) % 23) - 11);
        g[i] = static_cast<T>(scale * std::sin(0.37 * static_cast<double>(i) + seed));
    }
    return g;
}

/// What gradient_checks wrote: the totals and outcome after finish_local and check_reduced over
/// [begin, end), and this replica's row.
struct check_result {
    step_totals totals;
    step_outcome outcome;
    replica_row row;
};

/// Runs the checks as the trainer does: the pieces (three, cut unevenly, checked last first),
/// finish_local, then check_reduced over [begin, end) (the whole buffer when it is all of it).
template <class T>
check_result run_checks(const std::vector<T>& x, std::size_t begin, std::size_t end) {
    const host_system sys(1);
    const std::size_t n = x.size();
    std::vector<detail::bucket> pieces(3);
    pieces[0] = {.offset = 0, .size = n / 5};
    pieces[1] = {.offset = n / 5, .size = n / 2 - n / 5};
    pieces[2] = {.offset = n / 2, .size = n - n / 2};
    detail::gradient_checks<host_system> checks(pieces, n, sys);
    check_result r{};
    for (std::size_t k = pieces.size(); k-- > 0;)
        checks.check_piece(sys, std::span<const T>(x), k, pieces[k]);
    checks.finish_local(sys, 0.5, 8.0, 0.1, &r.totals, &r.row);
    if (begin == 0 && end == n)
        checks.check_reduced(sys, std::span<const T>(x), true, &r.outcome);
    else
        checks.check_reduced(sys, std::span<const T>(x), begin, end, true, &r.outcome);
    return r;
}

std::uint64_t bits(double v) {
    return std::bit_cast<std::uint64_t>(v);
}

} // namespace

TEMPLATE_TEST_CASE("gradient checks sum squares in the documented order, bit for bit",
                   "[train][checks][host]", float, double) {
    using T = TestType;
    for (const std::size_t n :
         {std::size_t(1), std::size_t(255), std::size_t(256), std::size_t(257), std::size_t(16384),
          std::size_t(16385), std::size_t(3 * 16384 + 77), std::size_t(300001)}) {
        CAPTURE(n);
        const std::vector<T> x = gradient<T>(n, static_cast<unsigned>(n % 7));
        const check_result whole = run_checks(x, 0, n);
        CHECK(bits(whole.outcome.grad_norm2) == bits(ordered_squares(x, 0, n)));
        CHECK(whole.outcome.reduced_non_finite == 0.0);
        CHECK(whole.outcome.reduced_first == 0.0);
        CHECK(whole.totals.non_finite == 0.0);
        CHECK(whole.row.non_finite == 0.0);
        CHECK(whole.row.first_non_finite == 0.0);
        // a shard that starts inside a tile and a lane row
        const std::size_t b = n / 3 + 1 < n ? n / 3 + 1 : 0;
        const check_result part = run_checks(x, b, n);
        CHECK(bits(part.outcome.grad_norm2) == bits(ordered_squares(x, b, n)));
    }
}

TEST_CASE("the documented order is not the sequential sum (the bitwise test can fail)",
          "[train][checks][host]") {
    const std::vector<double> x = gradient<double>(300001, 3);
    double sequential = 0;
    for (double v : x)
        sequential += v * v;
    const double ordered = ordered_squares(x, 0, x.size());
    CHECK(bits(sequential) != bits(ordered));
    CHECK(std::abs(sequential - ordered) <= 1e-12 * sequential);
}

TEMPLATE_TEST_CASE("gradient checks count NaN/inf and find the first, wherever they lie",
                   "[train][checks][host]", float, double) {
    using T = TestType;
    const std::size_t n = 3 * 16384 + 77;
    const double inf = std::numeric_limits<double>::infinity();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    struct placement {
        std::vector<std::size_t> at;
        bool has_nan;
    };
    for (const placement& p :
         {placement{{0}, false}, placement{{16383, 16384}, true}, placement{{n - 1}, true},
          placement{{40000, 16400, 16385}, false}, placement{{255, 256, 2 * 16384}, true}}) {
        std::vector<T> x = gradient<T>(n, 1);
        std::size_t first = n;
        for (std::size_t k = 0; k < p.at.size(); ++k) {
            x[p.at[k]] = static_cast<T>(p.has_nan && k == 0 ? nan : (k % 2 ? -inf : inf));
            first = p.at[k] < first ? p.at[k] : first;
        }
        CAPTURE(p.at);
        const check_result r = run_checks(x, 0, n);
        const auto count = static_cast<double>(p.at.size());
        CHECK(r.totals.non_finite == count);
        CHECK(r.row.non_finite == count);
        CHECK(r.row.first_non_finite == static_cast<double>(first + 1));
        CHECK(r.outcome.reduced_non_finite == count);
        CHECK(r.outcome.reduced_first == static_cast<double>(first + 1));
        const double norm2 = r.outcome.grad_norm2;
        if (p.has_nan)
            CHECK(std::isnan(norm2));
        else
            CHECK(norm2 == inf);
        // a shard after the first bad element: its own first index, as a flat index
        const std::size_t b = first + 1;
        std::size_t shard_first = n, shard_count = 0;
        for (std::size_t i = b; i < n; ++i)
            if (!std::isfinite(static_cast<double>(x[i]))) {
                shard_first = shard_first == n ? i : shard_first;
                ++shard_count;
            }
        const check_result s = run_checks(x, b, n);
        CHECK(s.outcome.reduced_non_finite == static_cast<double>(shard_count));
        CHECK(s.outcome.reduced_first ==
              (shard_count == 0 ? 0.0 : static_cast<double>(shard_first + 1)));
    }
}

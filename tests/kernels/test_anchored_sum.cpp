// Tests of the anchored fixed-point sums (kernels/anchored_sum.hpp), driven through the functors
// the trainer uses: order and grouping independence (shuffled chunks, simulated replicas laid out
// as the trainer's exchange lays them out, and in the tail's layout), correct rounding against
// an exact 128-bit integer reference, the stated precision under cancellation, zeros, subnormals,
// overflow and non-finite values, the replica's own non-finite check, and the report of the sums
// that read the arrays where they lie (its counts against a direct count, on 1 and 2 threads).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/combine.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/detail/anchored_combine.hpp"
#include "lockstep/kernels/detail/anchored_host.hpp"

#include "sum_terms.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

using namespace lockstep;
using sum_terms::random_terms;
using sum_terms::same_bits;

namespace {

__extension__ using i128 = __int128;

/// The trainer's exchange on simulated replicas: parts[r] = the chunks of replica r (possibly
/// none), laid out as its all_to_all lays them out (value c of replica j of element i at
/// j n + c R n + i, zeros past a replica's last chunk), summed by anchored_sum_fn; and the same
/// values in the tail's layout (replica stride, then call stride), which must give the same bits.
template <class T>
std::vector<T> anchored_sum(const std::vector<std::vector<std::vector<T>>>& parts, std::size_t n) {
    const std::size_t replicas = parts.size();
    std::size_t calls = 1;
    for (const auto& p : parts)
        calls = std::max(calls, p.size());
    std::vector<T> base(calls * replicas * n, T(0));
    const std::size_t stride = calls * n;
    std::vector<T> wide(replicas * stride, T(0));
    for (std::size_t j = 0; j < replicas; ++j)
        for (std::size_t c = 0; c < parts[j].size(); ++c)
            for (std::size_t i = 0; i < n; ++i) {
                base[j * n + c * replicas * n + i] = parts[j][c].at(i);
                wide[j * stride + c * n + i] = parts[j][c][i];
            }
    std::vector<T> out(n), out_wide(n);
    for (std::size_t i = 0; i < n; ++i) {
        kernels::anchored_sum_fn<T>{{base.data(), replicas, calls, n, replicas * n}, out.data()}(i);
        kernels::anchored_sum_fn<T>{{wide.data(), replicas, calls, stride, n}, out_wide.data()}(i);
    }
    CHECK(same_bits(out, out_wide));
    return out;
}

/// All chunks on one replica.
template <class T>
std::vector<T> one_replica_sum(const std::vector<std::vector<T>>& chunks) {
    return anchored_sum<T>({chunks}, chunks.at(0).size());
}

/// The T nearest to e 2^s (ties to even), found independently of the code under test: the
/// candidates around a long double estimate compared exactly in 128-bit integers.
/// requires: e 2^s and its neighbours in T are integer multiples of 2^s below 2^126.
template <class T>
T round_exact(i128 e, int s) {
    constexpr int p = std::numeric_limits<T>::digits;
    const i128 mag = e < 0 ? -e : e;
    if (mag < (i128{1} << p))
        return static_cast<T>(std::ldexp(static_cast<long double>(e), s)); // exact
    const T guess = static_cast<T>(std::ldexp(static_cast<long double>(e), s));
    T best = guess;
    i128 best_d = -1;
    for (T c : {std::nextafter(guess, -std::numeric_limits<T>::infinity()), guess,
                std::nextafter(guess, std::numeric_limits<T>::infinity())}) {
        const auto ci = static_cast<i128>(std::ldexp(static_cast<long double>(c), -s));
        const i128 d = ci > e ? ci - e : e - ci;
        if (best_d < 0 || d < best_d)
            best = c, best_d = d;
        else if (d == best_d) {
            T even = c;
            std::uint64_t bits = 0;
            std::memcpy(&bits, &c, sizeof(T));
            if (bits & 1)
                even = best;
            best = even;
        }
    }
    return best;
}

} // namespace

TEMPLATE_TEST_CASE("anchored sums do not depend on the order or grouping of chunks",
                   "[kernels][anchored_sum]", float, double) {
    using T = TestType;
    const int span = std::is_same_v<T, float> ? 120 : 900;
    const std::size_t n = 64, terms = 40;
    const auto x = random_terms<T>(terms, n, -span, span, 7);
    const std::vector<T> ref = one_replica_sum(x);

    std::vector<std::size_t> perm(terms);
    for (std::size_t i = 0; i < terms; ++i)
        perm[i] = i;
    std::mt19937 gen(11);
    for (int trial = 0; trial < 4; ++trial) {
        std::shuffle(perm.begin(), perm.end(), gen);
        std::vector<std::vector<T>> shuffled;
        shuffled.reserve(terms);
        for (std::size_t k : perm)
            shuffled.push_back(x[k]);
        CHECK(same_bits(one_replica_sum(shuffled), ref));
        // The same chunks over 1..8 simulated replicas, each a contiguous run (some empty).
        for (int replicas : {1, 2, 3, 5, 8, 64}) {
            std::vector<std::vector<std::vector<T>>> parts(static_cast<std::size_t>(replicas));
            for (std::size_t k = 0; k < terms; ++k)
                parts[k * static_cast<std::size_t>(replicas) / terms].push_back(shuffled[k]);
            INFO("replicas " << replicas);
            CHECK(same_bits(anchored_sum<T>(parts, n), ref));
        }
    }
}

TEMPLATE_TEST_CASE("anchored sums are the exact sum rounded once to nearest even",
                   "[kernels][anchored_sum]", float, double) {
    // Exponents in [-r, r] with 2 r + p - 1 <= 83: every value is a multiple of 2^-(r + p - 1)
    // below 2^(r + 1), so the exact sum of 1000 values times 2^(r + p - 1) is an integer below
    // 2^(2 r + p + 10) <= 2^94, and the anchored sum keeps every bit (its unit is 2^-83 times
    // the largest value's leading bit).
    using T = TestType;
    constexpr int p = std::numeric_limits<T>::digits;
    constexpr int r = (83 - (p - 1)) / 2;
    const std::size_t n = 48, terms = 1000;
    const auto x = random_terms<T>(terms, n, -r, r, 3);
    const std::vector<T> got = one_replica_sum(x);
    for (std::size_t i = 0; i < n; ++i) {
        i128 exact = 0;
        for (const auto& row : x)
            exact += static_cast<i128>(std::ldexp(static_cast<long double>(row[i]), r + p - 1));
        INFO("element " << i);
        CHECK(got[i] == round_exact<T>(exact, -(r + p - 1)));
    }
    // Ties: 1 + 2^-p (float) lies halfway between 1 and its successor: to even (1).
    const T half_ulp = std::ldexp(T(1), -p);
    CHECK(one_replica_sum<T>({{T(1)}, {half_ulp}})[0] == T(1));
    const T up = std::nextafter(T(1), T(2));
    CHECK(one_replica_sum<T>({{up}, {half_ulp}})[0] == std::nextafter(up, T(2)));
    CHECK(one_replica_sum<T>({{-up}, {-half_ulp}})[0] == -std::nextafter(up, T(2)));
}

TEST_CASE("float sums agree with the 128-bit sum and the exact sum", "[kernels][anchored_sum]") {
    // The host's vector blocks answer when every term lies within 29 - ceil(log2 k) binades of
    // the anchor and the result is normal; anchored_sum_fn answers the rest. Spans of 20 to 40
    // binades put terms on both sides of that line, and counts around 256 on both sides of the
    // tiles' term limit.
    const std::size_t n = 64;
    std::uint32_t seed = 100;
    for (int span : {20, 31, 32, 40})
        for (std::size_t count : {2, 7, 256, 257}) {
            const auto x = random_terms<float>(count, n, -span / 2, span - span / 2, ++seed);
            const std::vector<float> got = one_replica_sum(x);
            std::vector<float> wide(n);
            for (std::size_t i = 0; i < n; ++i) {
                int a = 0;
                for (const auto& row : x)
                    a = std::max(a,
                                 static_cast<int>(kernels::detail::anchored_split(row[i]).field));
                kernels::detail::anchored_int sum = 0;
                for (const auto& row : x)
                    kernels::detail::anchored_add(sum, row[i], a);
                wide[i] = kernels::detail::anchored_value<float>(sum, a);
            }
            INFO("span " << span << ", " << count << " terms");
            CHECK(same_bits(got, wide));
            if (span <= 31) // every bit kept: the exact sum, rounded once
                for (std::size_t i = 0; i < n; ++i) {
                    i128 exact = 0;
                    for (const auto& row : x)
                        exact += static_cast<i128>(
                            std::ldexp(static_cast<long double>(row[i]), span + 23));
                    CHECK(got[i] == round_exact<float>(exact, -(span + 23)));
                }
        }
    // Results at the edge of float's range: subnormal (anchored_sum_fn), the smallest normal
    // and an overflow (the vector blocks): max + 2^103 is a tie between max (odd) and 2^128, so it
    // rounds to infinity; max + 2^102 rounds back to max.
    const float d = std::numeric_limits<float>::denorm_min();
    const float tiny = std::numeric_limits<float>::min();
    CHECK(one_replica_sum<float>({{tiny}, {-d}})[0] == tiny - d);
    CHECK(one_replica_sum<float>({{tiny + d}, {-d}})[0] == tiny);
    CHECK(
        one_replica_sum<float>({{std::numeric_limits<float>::max()}, {std::ldexp(1.0f, 103)}})[0] ==
        std::numeric_limits<float>::infinity());
    CHECK(
        one_replica_sum<float>({{std::numeric_limits<float>::max()}, {std::ldexp(1.0f, 102)}})[0] ==
        std::numeric_limits<float>::max());
}

TEST_CASE("the host's float tiles give anchored_sum_fn's bits", "[kernels][anchored_sum]") {
    // Elements with terms inside and beyond 31 binades of their anchor, subnormal and normal
    // results, overflows, NaNs and infinities, over 3 replicas x 2 calls, 4 x 2 and 1 x 5, and
    // over the two layouts of 2 terms (2 replicas x 1 call, 1 replica x 2 calls: float
    // additions), each with a partial tile.
    using lim = std::numeric_limits<float>;
    for (const auto& [replicas, calls] :
         {std::pair<std::size_t, std::size_t>{3, 2}, {4, 2}, {1, 5}, {2, 1}, {1, 2}}) {
        const std::size_t terms_n = replicas * calls, n = 3 * kernels::detail::anchored_tile + 17;
        INFO(replicas << " replicas x " << calls << " calls");
        std::vector<float> base(terms_n * n);
        std::mt19937 gen(5);
        const auto x = random_terms<float>(terms_n, n, -40, 40, 9);
        for (std::size_t r = 0; r < x.size(); ++r)
            for (std::size_t i = 0; i < n; ++i)
                base[r * n + i] = x[r][i];
        const float specials[] = {lim::quiet_NaN(), lim::infinity(),   -lim::infinity(),
                                  lim::max(),       lim::denorm_min(), -lim::min()};
        for (std::size_t k = 0; k < 60; ++k)
            base[gen() % base.size()] = specials[k % 6];
        for (std::size_t i = 0; i < 20; ++i) // elements of subnormals only
            for (std::size_t r = 0; r < terms_n; ++r)
                base[r * n + 5 * i] = std::ldexp(float(r % 3) - 1.0f, -140);
        if (terms_n > 2) {
            // Just above and below a tie by less than a double resolves: 1 + 2^-24 + 2^-60
            // rounds up to 1 + 2^-23, 1 + 2^-24 - 2^-60 down to 1 (a double sum would make both
            // the tie, 1).
            for (std::size_t r = 0; r < terms_n; ++r) {
                const float tie[8] = {1.0f, std::ldexp(1.0f, -24), std::ldexp(1.0f, -60)};
                base[r * n + 1] = tie[r];
                base[r * n + 2] = r == 2 ? -tie[r] : tie[r];
                // Zeros of both signs only; zeros beside the smallest normal and a term 6
                // binades above (within reach); zeros beside a subnormal and 1 (beyond).
                base[r * n + 3] = r % 2 == 0 ? -0.0f : 0.0f;
                base[r * n + 4] = r == 0 ? lim::min() : r == 1 ? 0x1p-120f : -0.0f;
                base[r * n + 6] = r == 0 ? lim::denorm_min() : r == 1 ? 1.0f : 0.0f;
            }
        } else {
            // Ties to even both ways, zeros of both signs, an overflow, inf - inf, and a term
            // 100 binades below the other.
            const float pairs[][2] = {{1.0f + 0x1p-23f, 0x1p-24f},
                                      {1.0f, 0x1p-24f},
                                      {-0.0f, -0.0f},
                                      {lim::max(), lim::max()},
                                      {lim::infinity(), -lim::infinity()},
                                      {1.0f, 0x1p-100f},
                                      {-0.0f, 0.0f}};
            for (std::size_t k = 0; k < std::size(pairs); ++k)
                for (std::size_t r = 0; r < 2; ++r)
                    base[r * n + 1 + k] = pairs[k][r];
        }
        const std::size_t call_stride = replicas * n;
        const kernels::anchored_terms<float> terms{base.data(), replicas, calls, n, call_stride};
        std::vector<float> want(n);
        for (std::size_t i = 0; i < n; ++i)
            kernels::anchored_sum_fn<float>{terms, want.data()}(i);
        {
            std::vector<float> got(n, -1.0f);
            const std::size_t w = kernels::detail::anchored_tile;
            for (std::size_t t = 0; t < (n + w - 1) / w; ++t) {
                std::vector<const float*> p;
                for (std::size_t j = 0; j < replicas; ++j)
                    for (std::size_t c = 0; c < calls; ++c)
                        p.push_back(base.data() + j * n + c * call_stride + t * w);
                kernels::detail::anchored_tile_sums(p.data(), p.size(), std::min(n - t * w, w),
                                                    got.data() + t * w);
            }
            CHECK(same_bits(got, want));
            if (terms_n > 2) {
                CHECK(got[1] == 1.0f + std::ldexp(1.0f, -23));
                CHECK(got[2] == 1.0f);
            } else {
                CHECK(got[1] == 1.0f + 0x1p-22f);
                CHECK(got[2] == 1.0f);
                CHECK(std::bit_cast<std::uint32_t>(got[3]) == 0u);
                CHECK(got[4] == lim::infinity());
                CHECK(std::bit_cast<std::uint32_t>(got[5]) == 0x7fc00000u);
                CHECK(got[6] == 1.0f);
                CHECK(std::bit_cast<std::uint32_t>(got[7]) == 0u);
            }
        }
        // The tile loops answer exactly where they are sure (their sums are anchored_sum_fn's
        // bits), say so for the whole tile, and leave the tie elements to anchored_sum_fn.
        const std::size_t w = kernels::detail::anchored_tile;
        for (std::size_t b = 0; b < n; b += w) {
            const std::size_t m = std::min(w, n - b);
            std::vector<const float*> p;
            for (std::size_t r = 0; r < replicas; ++r)
                for (std::size_t c = 0; c < calls; ++c)
                    p.push_back(base.data() + r * n + c * call_stride + b);
            std::vector<float> out(m);
            std::vector<std::int32_t> ok(m, 7);
            const bool all =
                kernels::detail::anchored_blocks(p.data(), p.size(), m, out.data(), ok.data());
            CHECK(all == std::all_of(ok.begin(), ok.end(), [](std::int32_t o) { return o == -1; }));
            for (std::size_t i = 0; i < m; ++i) {
                CHECK((ok[i] == 0 || ok[i] == -1));
                if (ok[i] != 0)
                    CHECK(std::bit_cast<std::uint32_t>(out[i]) ==
                          std::bit_cast<std::uint32_t>(want[b + i]));
            }
            if (b == 0 && terms_n > 2)
                CHECK((ok[1] == 0 && ok[2] == 0));
        }
    }
}

TEMPLATE_TEST_CASE("anchored sums keep 83 bits below the largest value under cancellation",
                   "[kernels][anchored_sum]", float, double) {
    using T = TestType;
    // 1 - 1 + 2^-80: the stated error bound (N 2^-83 max|x|) keeps 2^-80 exactly.
    CHECK(one_replica_sum<T>({{T(1)}, {T(-1)}, {std::ldexp(T(1), -80)}})[0] ==
          std::ldexp(T(1), -80));
    CHECK(one_replica_sum<T>({{T(-1)}, {std::ldexp(T(-3), -83)}, {T(1)}})[0] ==
          std::ldexp(T(-3), -83));
    // Below the unit 2^-83 max|x|, values are truncated toward zero: the error stays below
    // N 2^-83 max|x|.
    const T tiny = std::ldexp(T(1.5), -90);
    const T got = one_replica_sum<T>({{T(1)}, {T(-1)}, {tiny}, {tiny}})[0];
    CHECK(std::abs(static_cast<double>(got) - 2 * static_cast<double>(tiny)) <
          4 * std::ldexp(1.0, -83));
    // The same terms over two replicas: the same bits.
    CHECK(
        same_bits(anchored_sum<T>({{{T(1)}, {tiny}}, {{T(-1)}, {tiny}}}, 1), std::vector<T>{got}));
}

TEMPLATE_TEST_CASE("anchored sums of zeros, subnormals, overflowing and non-finite values",
                   "[kernels][anchored_sum]", float, double) {
    using T = TestType;
    using lim = std::numeric_limits<T>;
    // No value or only zeros: +0.
    const std::vector<T> zero = anchored_sum<T>({{}, {{T(-0.0)}}}, 1);
    CHECK(zero[0] == T(0));
    CHECK(!std::signbit(zero[0]));
    // Subnormals are exact.
    const T d = lim::denorm_min();
    CHECK(one_replica_sum<T>({{d}, {d}, {T(3) * d}, {-d}})[0] == T(4) * d);
    CHECK(one_replica_sum<T>({{lim::min()}, {-d}})[0] == lim::min() - d);
    // A sum beyond T's range is an infinity of its sign.
    CHECK(one_replica_sum<T>({{lim::max()}, {lim::max()}})[0] == lim::infinity());
    CHECK(one_replica_sum<T>({{-lim::max()}, {-lim::max()}})[0] == -lim::infinity());
    CHECK(one_replica_sum<T>({{lim::max()}, {-lim::max()}, {lim::max()}})[0] == lim::max());
    // A NaN or an infinity anywhere: a quiet NaN, on every grouping.
    CHECK(std::isnan(one_replica_sum<T>({{T(1)}, {lim::infinity()}, {T(2)}})[0]));
    CHECK(std::isnan(anchored_sum<T>({{{T(1)}}, {{lim::quiet_NaN()}}}, 1)[0]));
    CHECK(std::isnan(anchored_sum<T>({{{lim::infinity()}}, {{-lim::infinity()}}}, 1)[0]));
}

TEMPLATE_TEST_CASE("the own check marks exactly the replica's non-finite chunk values",
                   "[kernels][anchored_sum]", float, double) {
    using T = TestType;
    using lim = std::numeric_limits<T>;
    // Element 0: finite; 1: an infinity in a kept chunk; 2: an own sum beyond T's range (not
    // marked: finite values); 3: a NaN in the last chunk; 4: large but finite; 5: a NaN in the
    // second kept chunk.
    const std::vector<std::vector<T>> chunks = {
        {T(1), lim::infinity(), lim::max(), T(2), lim::max(), T(1)},
        {T(3), T(4), lim::max(), T(5), T(6), lim::quiet_NaN()},
        {T(2), T(1), lim::max(), lim::quiet_NaN(), -lim::max() / 2, T(7)}};
    // Kept as the trainer keeps them: every chunk but the last in a store, the last in place.
    std::vector<T> store = chunks[0];
    store.insert(store.end(), chunks[1].begin(), chunks[1].end());
    std::vector<T> out = chunks[2];
    for (std::size_t i = 0; i < 6; ++i)
        kernels::anchored_own_check_fn<T>{{store.data(), out.data(), 3, 6}, out.data()}(i);
    CHECK(out[0] == T(2));
    CHECK(std::isnan(out[1]));
    CHECK(out[2] == lim::max());
    CHECK(std::isnan(out[3]));
    CHECK(out[4] == -lim::max() / 2);
    CHECK(std::isnan(out[5]));
    // One chunk: nothing is kept, nothing changes.
    std::vector<T> alone = chunks[2];
    for (std::size_t i = 0; i < 6; ++i)
        kernels::anchored_own_check_fn<T>{{nullptr, alone.data(), 1, 6}, alone.data()}(i);
    CHECK(std::equal(alone.begin(), alone.begin() + 3, chunks[2].begin()));
    CHECK(std::isnan(alone[3]));
}

TEST_CASE("the host's keep tiles copy the chunks", "[kernels][anchored_sum]") {
    // 2 chunks of n values over keep tiles 0, 1 and a partial tile 2, with an infinity and a
    // NaN. Streaming to 64-byte aligned destinations, to destinations off by one float or 8 (a
    // scalar head, then streamed), and not streaming; without `clear` the sources stay as they
    // were.
    using lim = std::numeric_limits<float>;
    const std::size_t w = kernels::detail::anchored_keep_tile, n = 2 * w + 9;
    const auto x = random_terms<float>(2, n, -20, 20, 4);
    std::vector<float> c0 = x[0], c1 = x[1];
    c0[w + 3] = lim::infinity();
    c1[n - 1] = lim::quiet_NaN();
    const std::vector<float> c0_was = c0;
    for (const auto& [offset, stream] :
         {std::pair<std::size_t, bool>{0, true}, {1, true}, {8, true}, {0, false}}) {
        CAPTURE(offset, stream);
        std::vector<float> space(2 * n + 32);
        void* at = space.data();
        std::size_t room = space.size() * sizeof(float);
        float* store = static_cast<float*>(std::align(64, sizeof(float), at, room)) + offset;
        for (std::size_t t = 0; t < 3; ++t) {
            kernels::detail::anchored_keep_tiles_fn{c0.data(), store, nullptr, 0, n, stream}(t);
            kernels::detail::anchored_keep_tiles_fn{c1.data(), store + n, nullptr, 0, n, stream}(t);
        }
        CHECK(same_bits(std::vector<float>(store, store + n), c0));
        CHECK(same_bits(c0, c0_was));
        CHECK(same_bits(std::vector<float>(store + n, store + 2 * n), c1));
    }
}

TEST_CASE("the host's keep-and-zero tiles keep any range of a chunk and leave zeros",
          "[kernels][anchored_sum]") {
    // A chunk of n values over keep tiles 0, 1 and a partial tile 2, kept in ranges that cut
    // tiles anywhere (as tensors are marked ready, out of order): an infinity in tile 1 and a
    // NaN in the last element. Streaming to a 64-byte aligned store, to ones off by one float or
    // 8 (a scalar head, then streamed), and not streaming. The store holds the chunk's bits and
    // the source holds zeros.
    using lim = std::numeric_limits<float>;
    const std::size_t w = kernels::detail::anchored_keep_tile, n = 2 * w + 9;
    std::vector<float> chunk = random_terms<float>(1, n, -20, 20, 7)[0];
    chunk[w + 3] = lim::infinity();
    chunk[n - 1] = lim::quiet_NaN();
    const std::pair<std::size_t, std::size_t> ranges[] = {
        {w + 1, n}, {3, 17}, {0, 3}, {17, w - 5}, {w - 5, w + 1}};
    for (const auto& [offset, stream] :
         {std::pair<std::size_t, bool>{0, true}, {1, true}, {8, true}, {0, false}}) {
        CAPTURE(offset, stream);
        std::vector<float> space(n + 32, -1.0f), src = chunk;
        void* at = space.data();
        std::size_t room = space.size() * sizeof(float);
        float* store = static_cast<float*>(std::align(64, sizeof(float), at, room)) + offset;
        std::size_t tasks = 0;
        for (const auto& [first, end] : ranges) {
            const kernels::detail::anchored_keep_tiles_fn f{src.data(), store, src.data(),
                                                            first,      end,   stream};
            const std::size_t k = (end - 1) / w - first / w + 1; // the overload's tasks
            for (std::size_t t = 0; t < k; ++t)
                f(t);
            tasks += k;
        }
        CHECK(tasks == 7);
        CHECK(same_bits(std::vector<float>(store, store + n), chunk));
        CHECK(std::all_of(src.begin(), src.end(),
                          [](float v) { return std::bit_cast<std::uint32_t>(v) == 0u; }));
    }
}

TEMPLATE_TEST_CASE("anchored_combine_fn sums arrays where they lie with anchored_sum_fn's bits",
                   "[kernels][anchored_sum]", float, double) {
    // 1, 2, 3, 8, 17 and 300 arrays (300: past the tiles' 256 terms, element by element), the
    // elements [first, first + m) with a partial tile, on both loops; specials scattered in.
    using T = TestType;
    using lim = std::numeric_limits<T>;
    const std::size_t first = 37, m = 2 * kernels::detail::anchored_tile + 11, n = first + m + 5;
    for (const std::size_t arrays : {1u, 2u, 3u, 8u, 17u, 300u}) {
        CAPTURE(arrays);
        auto x = random_terms<T>(arrays, n, -30, 30, static_cast<std::uint32_t>(arrays));
        const T specials[] = {lim::quiet_NaN(), lim::infinity(), lim::max(), lim::denorm_min(),
                              T(0)};
        for (std::size_t k = 0; k < 25; ++k)
            x[(k * 7) % arrays][first + (k * 131) % m] = specials[k % 5];
        std::vector<const T*> sources;
        sources.reserve(arrays);
        for (const auto& a : x)
            sources.push_back(a.data());
        std::vector<T> column(arrays), want(m);
        for (std::size_t i = 0; i < m; ++i) {
            for (std::size_t j = 0; j < arrays; ++j)
                column[j] = x[j][first + i];
            kernels::anchored_sum_fn<T>{{column.data(), 1, arrays, 0, 1}, want.data() + i}(0);
        }
        {
            std::vector<T> got(m, T(-1));
            kernels::detail::anchored_combine_fn<T>{}(sources.data(), arrays, first, m, got.data());
            CHECK(same_bits(got, want));
        }
    }
}

TEMPLATE_TEST_CASE("anchored_combine_fn reports the non-finite sums and each group's non-finite "
                   "values",
                   "[kernels][anchored_sum]", float, double) {
    // Groups of arrays (a replica's chunks) summed by the all_combine pass over 40000 elements
    // (10 tiles of the pass, on 1 and 2 threads), the flat indices offset by 1000 (a block that
    // does not start at 0). Specials: a NaN and infinities in chosen groups, and at two elements
    // finite values whose sum overflows. Reference: a direct count over the arrays.
    using T = TestType;
    using lim = std::numeric_limits<T>;
    const std::size_t n = 40000, base = 1000;
    for (const std::size_t groups : {1u, 2u, 3u}) {
        for (const std::size_t size : {1u, 4u}) {
            const std::size_t arrays = groups * size;
            CAPTURE(groups, size);
            auto x = random_terms<T>(arrays, n, -20, 20, static_cast<std::uint32_t>(arrays + 7));
            // Non-finite values: group 0 at 5 elements (one of them twice), the last group at 2,
            // one element shared; 2 overflowing elements (every array lim::max()).
            const std::size_t bad0[] = {17, 4100, 4101, 22000, 39999};
            for (const std::size_t i : bad0)
                x[size - 1][i] = lim::quiet_NaN();
            x[0][4100] = -lim::infinity();
            const std::size_t bad_last[] = {4101, 30000};
            for (const std::size_t i : bad_last)
                x[arrays - 1][i] = lim::infinity();
            for (const std::size_t i : {std::size_t{9000}, std::size_t{9001}})
                for (std::size_t j = 0; j < arrays; ++j)
                    x[j][i] = arrays > 1 ? lim::max() : lim::infinity();
            std::vector<const T*> sources;
            sources.reserve(arrays);
            for (const auto& a : x)
                sources.push_back(a.data());
            // The direct counts.
            std::vector<double> want(kernels::detail::anchored_combine_report::words_for(groups));
            for (std::size_t i = 0; i < n; ++i) {
                bool sum_bad = false;
                for (std::size_t j = 0; j < groups; ++j) {
                    bool bad = false;
                    for (std::size_t c = 0; c < size; ++c)
                        bad = bad || !std::isfinite(x[j * size + c][i]);
                    sum_bad = sum_bad || bad;
                    if (bad) {
                        ++want[1 + 2 * j];
                        if (want[2 + 2 * j] == 0)
                            want[2 + 2 * j] = static_cast<double>(base + i + 1);
                    }
                }
                if (sum_bad || (arrays > 1 && (i == 9000 || i == 9001)))
                    want[0] = 1;
            }
            REQUIRE(want[0] == 1);
            REQUIRE(want[1] >= 5);
            for (const int threads : {1, 2}) {
                CAPTURE(threads);
                std::vector<double> words(want.size(), 0.0);
                std::vector<T> got(n, T(-1)), plain(n, T(-2));
                const kernels::detail::anchored_combine_fn<T> reporting{
                    {words.data(), groups, size, base}};
                T* const to[1] = {got.data()};
                T* const to_plain[1] = {plain.data()};
                const host_system sys(threads);
                combine_in_place(sys, std::span<const T* const>(sources.data(), arrays),
                                 std::span<T* const>(to), 0, n, reporting);
                combine_in_place(sys, std::span<const T* const>(sources.data(), arrays),
                                 std::span<T* const>(to_plain), 0, n,
                                 kernels::detail::anchored_combine_fn<T>{});
                CHECK(same_bits(got, plain)); // the report changes no sum
                CHECK(words == want);
            }
            // Without a non-finite sum, the words stay zero.
            for (const std::size_t i : {std::size_t{9000}, std::size_t{9001}})
                for (std::size_t j = 0; j < arrays; ++j)
                    x[j][i] = T(1);
            for (const std::size_t i : bad0)
                x[size - 1][i] = T(0);
            x[0][4100] = T(0);
            for (const std::size_t i : bad_last)
                x[arrays - 1][i] = T(0);
            std::vector<double> words(want.size(), 0.0);
            std::vector<T> got(n);
            T* const to[1] = {got.data()};
            combine_in_place(
                host_system(2), std::span<const T* const>(sources.data(), arrays),
                std::span<T* const>(to), 0, n,
                kernels::detail::anchored_combine_fn<T>{{words.data(), groups, size, base}});
            CHECK(words == std::vector<double>(want.size(), 0.0));
        }
    }
}

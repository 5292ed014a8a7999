// Tests of the batch-norm kernels: moments (Welford + Chan) against a double two-pass reference,
// stability, host fast path against the generic Thrust path. SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/system/host_system.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

using namespace lockstep;
using kernels::channel_geometry;
using kernels::moments;

namespace {

template <class T>
std::vector<T> values(std::size_t n, unsigned seed, double mean, double stddev) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> z(mean, stddev);
    std::vector<T> v(n);
    for (auto& e : v)
        e = static_cast<T>(z(gen));
    return v;
}

/// Two-pass double-precision (mean, M2) of channel c, read through its own index arithmetic.
template <class T>
moments<double> reference(const std::vector<T>& x, const channel_geometry& g, std::size_t c) {
    moments<double> m;
    m.count = static_cast<double>(g.outer * g.inner);
    double sum = 0;
    for (std::size_t o = 0; o < g.outer; ++o)
        for (std::size_t i = 0; i < g.inner; ++i)
            sum += x[(o * g.channels + c) * g.inner + i];
    m.mean = m.count > 0 ? sum / m.count : 0;
    for (std::size_t o = 0; o < g.outer; ++o)
        for (std::size_t i = 0; i < g.inner; ++i) {
            const double e = x[(o * g.channels + c) * g.inner + i] - m.mean;
            m.m2 += e * e;
        }
    return m;
}

const std::vector<channel_geometry> geometries{
    {6, 5, 63},   // NCHW, 7x9 planes: full chunks and tail lanes
    {3, 2, 200},  // NCHW, larger planes
    {2, 3, 5},    // NCHW, planes shorter than the lanes
    {300, 19, 1}, // NHWC / N x C rows, one row partition
    {2048, 7, 1}, // rows split into 8 partitions
    {600, 70, 1}, // rows: full channel blocks and a remainder block, 2 partitions
    {1, 4, 1},    // one value per channel
    {0, 3, 16},   // empty batch
};

} // namespace

TEMPLATE_TEST_CASE("channel_moments matches a two-pass double reference", "[kernels][bn]", float,
                   double) {
    using T = TestType;
    const host_system sys;
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
    for (const auto& g : geometries) {
        CAPTURE(g.outer, g.channels, g.inner);
        const auto x = values<T>(g.size(), 3, 5.0, 2.0);
        std::vector<moments<T>> fast(g.channels), generic(g.channels);
        std::vector<moments<T>> ws(kernels::moments_workspace_size(g));
        kernels::channel_moments(sys, std::span<const T>(x), g, std::span(fast), std::span(ws));
        kernels::channel_moments_generic(sys, std::span<const T>(x), g, std::span(generic),
                                         std::span(ws));
        for (std::size_t c = 0; c < g.channels; ++c) {
            const auto r = reference(x, g, c);
            for (const auto& m : {fast[c], generic[c]}) {
                CHECK(m.count == r.count);
                CHECK(std::abs(m.mean - r.mean) <= tol * (std::abs(r.mean) + 1));
                CHECK(std::abs(m.m2 - r.m2) <= tol * (r.m2 + 1e-30));
            }
        }
    }
}

TEST_CASE("Welford + Chan keep the variance of large-mean float data", "[kernels][bn]") {
    // mean 1e4, std 1 in float: the variance must be within 1e-3 of the double variance of the
    // very same float values. A float sum / sum-of-squares formula fails this (checked below, so
    // the test is known to tell a stable method from an unstable one).
    const host_system sys;
    for (const channel_geometry g :
         {channel_geometry{64, 3, 1024}, channel_geometry{65536, 3, 1}}) {
        const auto x = values<float>(g.size(), 17, 1e4, 1.0);
        std::vector<moments<float>> fast(g.channels), generic(g.channels);
        std::vector<moments<float>> ws(kernels::moments_workspace_size(g));
        kernels::channel_moments(sys, std::span<const float>(x), g, std::span(fast), std::span(ws));
        kernels::channel_moments_generic(sys, std::span<const float>(x), g, std::span(generic),
                                         std::span(ws));
        for (std::size_t c = 0; c < g.channels; ++c) {
            const auto r = reference(x, g, c);
            const double var = r.m2 / r.count;
            CHECK(std::abs(fast[c].m2 / fast[c].count - var) <= 1e-3 * var);
            CHECK(std::abs(generic[c].m2 / generic[c].count - var) <= 1e-3 * var);
            float s = 0, sq = 0;
            for (std::size_t k = 0; k < g.per_channel(); ++k) {
                const float v = x[g.offset(c, k)];
                s += v;
                sq += v * v;
            }
            const float n = static_cast<float>(g.per_channel());
            const double naive = (sq - s * s / n) / n;
            CHECK(std::abs(naive - var) > 1e-3 * var);
        }
    }
}

TEST_CASE("chan_merge is exact against empty sets and equals the union", "[kernels][bn]") {
    const kernels::chan_merge merge;
    const moments<double> a{3, 2.5, 4.25}, empty{};
    const auto l = merge(empty, a), r = merge(a, empty);
    CHECK((l.count == a.count && l.mean == a.mean && l.m2 == a.m2));
    CHECK((r.count == a.count && r.mean == a.mean && r.m2 == a.m2));
    // {1, 2, 6} and {10, 12}: the union has mean 31/5 and M2 = sum (x - 6.2)^2 = 92.8
    moments<double> x, y;
    for (double v : {1.0, 2.0, 6.0})
        kernels::welford_update(x, v);
    for (double v : {10.0, 12.0})
        kernels::welford_update(y, v);
    const auto u = merge(x, y);
    CHECK(u.count == 5);
    CHECK(u.mean == Approx(6.2).epsilon(1e-15));
    CHECK(u.m2 == Approx(92.8).epsilon(1e-14));
}

TEST_CASE("shifted_moments folds parts into the moments of their union", "[kernels][bn]") {
    // Parts of one channel as the GPU rows kernels see them: an empty first part (its mean, the
    // shift, is 0), sizes from 1 to 5000, means from 50 to 50 + 15 * 40 (a batch sorted by
    // sample), deviation 2. Reference: the two-pass double moments of the concatenated values.
    const std::vector<std::size_t> sizes{0,   1,  7,    5000, 333, 64, 1200, 2,
                                         999, 40, 3000, 17,   450, 1,  80,   2500};
    std::vector<double> all;
    std::vector<moments<double>> parts;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
        const auto v = values<double>(sizes[k], 40 + static_cast<unsigned>(k),
                                      50.0 + 40.0 * static_cast<double>(k), 2.0);
        moments<double> m{static_cast<double>(v.size()), 0, 0};
        for (double e : v)
            m.mean += e / m.count;
        for (double e : v)
            m.m2 += (e - m.mean) * (e - m.mean);
        parts.push_back(m);
        all.insert(all.end(), v.begin(), v.end());
    }
    moments<double> want{static_cast<double>(all.size()), 0, 0};
    for (double e : all)
        want.mean += e / want.count;
    for (double e : all)
        want.m2 += (e - want.mean) * (e - want.mean);
    const auto check = [&](const moments<double>& got) {
        CHECK(got.count == want.count);
        CHECK(std::abs(got.mean - want.mean) <= 1e-13 * want.mean);
        CHECK(std::abs(got.m2 - want.m2) <= 1e-12 * want.m2);
    };
    // One fold about the first part's mean, and four lanes of four parts each combined pairwise
    // (as channel_fold combines them) about the same shift.
    kernels::shifted_moments one{parts[0].mean};
    for (const auto& m : parts)
        one.add(m.count, m.mean, m.m2);
    check(one.result());
    std::vector<kernels::shifted_moments> lanes(4, kernels::shifted_moments{parts[0].mean});
    for (std::size_t k = 0; k < parts.size(); ++k)
        lanes[k / 4].add(parts[k].count, parts[k].mean, parts[k].m2);
    check(((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])).result());
    // About the mean of a middle part, and Chan's merge of the same parts agrees.
    kernels::shifted_moments mid{parts[8].mean};
    moments<double> chan;
    for (const auto& m : parts) {
        mid.add(m.count, m.mean, m.m2);
        chan = kernels::chan_merge{}(chan, m);
    }
    check(mid.result());
    check(chan);
    // Nothing added: all zero, whatever the shift.
    const moments<double> none = kernels::shifted_moments{3.5}.result();
    CHECK((none.count == 0 && none.mean == 0 && none.m2 == 0));
}

namespace {

/// Two-pass double moments of v.
moments<double> two_pass(const std::vector<double>& v) {
    moments<double> m{static_cast<double>(v.size()), 0, 0};
    for (double e : v)
        m.mean += e / m.count;
    for (double e : v)
        m.m2 += (e - m.mean) * (e - m.mean);
    return m;
}

/// lane[j] fed to batched_lanes<float, 4> in batches of B (the last one short), each lane's
/// moments and their merge checked against two-pass double moments: the mean to 64 float
/// roundings of its magnitude and M2 to 128 of itself (on these data sets the lanes err by up
/// to 21 and 36 roundings, a float Welford pass over the same values by up to 15 and 13).
template <int B>
void check_batched_lanes(std::vector<std::vector<double>> lane) {
    for (auto& l : lane) // the values as float holds them, so the reference sees the same data
        for (double& e : l)
            e = static_cast<double>(static_cast<float>(e));
    constexpr double eps = 0x1p-24;
    kernels::batched_lanes<float, 4> b;
    const std::size_t n = lane[0].size();
    for (std::size_t u0 = 0; u0 < n; u0 += B) {
        const int count = static_cast<int>(std::min<std::size_t>(B, n - u0));
        b.template add<B>(count, [&](int u, float(&v)[4]) {
            for (int j = 0; j < 4; ++j)
                v[j] = static_cast<float>(lane[static_cast<std::size_t>(j)][u0 + std::size_t(u)]);
        });
    }
    CHECK(b.count == static_cast<float>(n));
    const auto check = [&](double mean, double m2, const moments<double>& want) {
        CHECK(std::abs(mean - want.mean) <= 64 * eps * (std::abs(want.mean) + 1));
        CHECK(std::abs(m2 - want.m2) <= 128 * eps * want.m2);
    };
    std::vector<double> all;
    for (std::size_t j = 0; j < 4; ++j) {
        check(b.mean[j], b.m2[j], two_pass(lane[j]));
        all.insert(all.end(), lane[j].begin(), lane[j].end());
    }
    const moments<float> merged = b.result();
    CHECK(merged.count == static_cast<float>(4 * n));
    check(merged.mean, merged.m2, two_pass(all));
}

} // namespace

TEST_CASE("batched_lanes merges batches into the moments of all their values", "[kernels][bn]") {
    // Four lanes of float data as a CUDA planes thread sees them, in batches of 4 and 16 with a
    // short last batch: mean 50 and deviation 2 (the mean far from 0); values sorted by sample
    // (means 50 to 610, deviation 2, so each batch's mean drifts from the running one); and a
    // first value 10^4 deviations from the rest (the first batch's shift).
    for (const std::size_t n :
         {std::size_t{1}, std::size_t{7}, std::size_t{16}, std::size_t{33}, std::size_t{400}}) {
        CAPTURE(n);
        std::vector<std::vector<double>> flat, sorted, outlier;
        for (unsigned j = 0; j < 4; ++j) {
            flat.push_back(values<double>(n, 60 + j, 50.0, 2.0));
            std::vector<double> s = values<double>(n, 70 + j, 0.0, 2.0);
            for (std::size_t k = 0; k < n; ++k) {
                const std::size_t sample = k * 15 / n; // 15 samples of n / 15 values
                s[k] += 50.0 + 40.0 * static_cast<double>(sample);
            }
            sorted.push_back(s);
            auto o = values<double>(n, 80 + j, 0.0, 1.0);
            o[0] = 1e4;
            outlier.push_back(o);
        }
        for (const auto* set : {&flat, &sorted, &outlier}) {
            check_batched_lanes<4>(*set);
            check_batched_lanes<16>(*set);
        }
    }
}

TEMPLATE_TEST_CASE("host fast path and generic path agree on normalize, backward sums and dx",
                   "[kernels][bn]", float, double) {
    using T = TestType;
    const host_system sys;
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
    for (const auto& g : geometries) {
        CAPTURE(g.outer, g.channels, g.inner);
        const auto x = values<T>(g.size(), 5, 1.0, 3.0);
        const auto dy = values<T>(g.size(), 6, 0.0, 1.0);
        const auto mean = values<T>(g.channels, 7, 1.0, 0.5);
        const auto scale = values<T>(g.channels, 8, 1.0, 0.5);
        const auto beta = values<T>(g.channels, 9, 0.0, 1.0);
        std::vector<T> y1(g.size()), y2(g.size());
        kernels::normalize(sys, std::span<const T>(x), std::span<T>(y1), g,
                           std::span<const T>(mean), std::span<const T>(scale),
                           std::span<const T>(beta));
        kernels::normalize_generic(sys, std::span<const T>(x), std::span<T>(y2), g,
                                   std::span<const T>(mean), std::span<const T>(scale),
                                   std::span<const T>(beta));
        for (std::size_t i = 0; i < g.size(); ++i) {
            const std::size_t c = (i / g.inner) % g.channels;
            const double want = (double(x[i]) - mean[c]) * scale[c] + beta[c];
            CHECK(std::abs(y1[i] - want) <= tol * (std::abs(want) + 1));
            CHECK(y1[i] == y2[i]); // elementwise: same functor, same bits
        }

        std::vector<T> s1(2 * g.channels), s2(2 * g.channels);
        std::vector<T> ws(kernels::backward_workspace_size(g));
        kernels::backward_sums(sys, std::span<const T>(dy), std::span<const T>(x), g,
                               std::span<const T>(mean), std::span<T>(s1), std::span<T>(ws));
        kernels::backward_sums_generic(sys, std::span<const T>(dy), std::span<const T>(x), g,
                                       std::span<const T>(mean), std::span<T>(s2),
                                       std::span<T>(ws));
        for (std::size_t c = 0; c < g.channels; ++c) {
            double sdy = 0, sdyx = 0, scale_dy = 0, scale_dyx = 0;
            for (std::size_t k = 0; k < g.per_channel(); ++k) {
                const std::size_t i = g.offset(c, k);
                sdy += dy[i];
                sdyx += double(dy[i]) * (double(x[i]) - mean[c]);
                scale_dy += std::abs(double(dy[i]));
                scale_dyx += std::abs(double(dy[i]) * (double(x[i]) - mean[c]));
            }
            // summation error is bounded relative to the sum of magnitudes
            CHECK(std::abs(s1[c] - sdy) <= tol * (scale_dy + 1e-30));
            CHECK(std::abs(s2[c] - sdy) <= tol * (scale_dy + 1e-30));
            CHECK(std::abs(s1[g.channels + c] - sdyx) <= tol * (scale_dyx + 1e-30));
            CHECK(std::abs(s2[g.channels + c] - sdyx) <= tol * (scale_dyx + 1e-30));
        }

        const auto k = values<T>(g.channels, 10, 1.0, 0.5);
        const auto a = values<T>(g.channels, 11, 0.0, 0.1);
        const auto b = values<T>(g.channels, 12, 0.0, 0.1);
        const kernels::backward_coefficients<T> co{mean.data(), k.data(), a.data(), b.data()};
        std::vector<T> dx1(g.size()), dx2(g.size());
        kernels::input_gradient(sys, std::span<const T>(dy), std::span<const T>(x),
                                std::span<T>(dx1), g, co);
        kernels::input_gradient_generic(sys, std::span<const T>(dy), std::span<const T>(x),
                                        std::span<T>(dx2), g, co);
        for (std::size_t i = 0; i < g.size(); ++i) {
            const std::size_t c = (i / g.inner) % g.channels;
            const double want = k[c] * (double(dy[i]) - a[c] - (double(x[i]) - mean[c]) * b[c]);
            CHECK(std::abs(dx1[i] - want) <= tol * (std::abs(want) + 1));
            CHECK(dx1[i] == dx2[i]);
        }
    }
}

TEST_CASE("kernels reject spans that do not match the geometry", "[kernels][bn]") {
    const host_system sys;
    const channel_geometry g{2, 3, 4};
    std::vector<float> x(g.size() - 1);
    std::vector<moments<float>> out(3), ws(kernels::moments_workspace_size(g));
    CHECK_THROWS_AS(
        kernels::channel_moments(sys, std::span<const float>(x), g, std::span(out), std::span(ws)),
        error);
    CHECK_THROWS_AS(kernels::channel_moments_generic(sys, std::span<const float>(x), g,
                                                     std::span(out), std::span(ws)),
                    error);
}

TEST_CASE("kernels refuse a geometry whose size overflows, not its wrapped size", "[kernels][bn]") {
    // 2^63 x 2 x 1 wraps to 0: empty spans matched the wrapped size, and the host loops then
    // walked 2^63 rows of them.
    const host_system sys;
    const channel_geometry g{std::size_t(1) << 63, 2, 1};
    REQUIRE(g.size() == 0);
    std::vector<float> none, coef(2, 1.0f);
    const auto refused = [](auto&& call, const char* op) {
        try {
            call();
            FAIL("no error");
        } catch (const error& e) {
            INFO(e.what());
            CHECK(e.code() == errc::invalid_argument);
            CHECK(std::string(e.what()).find(op) != std::string::npos);
            CHECK(std::string(e.what()).find("overflows") != std::string::npos);
        }
    };
    const std::span<const float> c(coef);
    refused(
        [&] {
            kernels::normalize(sys, std::span<const float>(none), std::span<float>(none), g, c, c,
                               c);
        },
        "kernels::normalize");
    const kernels::backward_coefficients<float> co{coef.data(), coef.data(), coef.data(),
                                                   coef.data()};
    refused(
        [&] {
            kernels::input_gradient(sys, std::span<const float>(none), std::span<const float>(none),
                                    std::span<float>(none), g, co);
        },
        "kernels::input_gradient");
}

TEST_CASE("packed_moments splits the count into two halves exact in float", "[kernels][bn]") {
    // one channel of more than 2^24 values: a float count would round, the halves do not
    const channel_geometry g{3, 2, (std::size_t(1) << 24) + 5};
    const std::uint64_t n = g.per_channel(); // 3 * 2^24 + 15
    float hi = 0, lo = 0;
    kernels::packed_moments::split_count(n, hi, lo);
    CHECK(hi == 3.0f);
    CHECK(lo == 15.0f);
    const float block[3] = {1.0f, hi, lo};
    CHECK(kernels::packed_moments::count(block) == static_cast<double>(n));
    CHECK(static_cast<double>(static_cast<float>(n)) != static_cast<double>(n));
    double dhi = 0, dlo = 0;
    kernels::packed_moments::split_count((std::uint64_t(1) << 47) + 7, dhi, dlo);
    CHECK(dhi == double(std::uint64_t(1) << 23));
    CHECK(dlo == 7.0);
    CHECK(kernels::packed_moments::size(4) == 11);
    CHECK(kernels::packed_moments::mean(2) == 7);
    CHECK(kernels::packed_moments::m2(2) == 8);
}

TEMPLATE_TEST_CASE("pack_local_moments packs status, the exact count and the moments",
                   "[kernels][bn]", float, double) {
    using T = TestType;
    const host_system sys;
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
    for (const auto& g : geometries) {
        CAPTURE(g.outer, g.channels, g.inner);
        const auto x = values<T>(g.size(), 21, 5.0, 2.0);
        const std::size_t size = kernels::packed_moments::size(g.channels);
        std::vector<T> fast(size, T(-1)), generic(size, T(-1));
        std::vector<std::byte> ws(kernels::bn_workspace_bytes<T>(g));
        kernels::pack_local_moments(sys, std::span<const T>(x), g, T(2), std::span<T>(fast),
                                    std::span(ws));
        kernels::pack_local_moments_generic(sys, std::span<const T>(x), g, T(2),
                                            std::span<T>(generic), std::span(ws));
        for (const auto* b : {fast.data(), generic.data()}) {
            CHECK(b[kernels::packed_moments::status] == T(2));
            CHECK(kernels::packed_moments::count(b) == static_cast<double>(g.per_channel()));
            for (std::size_t c = 0; c < g.channels; ++c) {
                const auto r = reference(x, g, c);
                CHECK(std::abs(b[kernels::packed_moments::mean(c)] - r.mean) <=
                      tol * (std::abs(r.mean) + 1));
                CHECK(std::abs(b[kernels::packed_moments::m2(c)] - r.m2) <= tol * (r.m2 + 1e-30));
            }
        }
    }
    // no channels: the header alone (the count is still per_channel() = 12)
    const channel_geometry none{4, 0, 3};
    std::vector<T> block(kernels::packed_moments::size(0), T(-1));
    std::vector<std::byte> ws(kernels::bn_workspace_bytes<T>(none));
    kernels::pack_local_moments(sys, std::span<const T>(), none, T(0), std::span<T>(block),
                                std::span(ws));
    CHECK(block == std::vector<T>{T(0), T(0), T(12)});
}

TEST_CASE("pack_local_moments is exact in count beyond 2^24 values per channel", "[kernels][bn]") {
    // one channel of 2^24 + 3 floats: the count in the header is exact, the moments accurate
    const host_system sys;
    const channel_geometry g{1, 1, (std::size_t(1) << 24) + 3};
    std::vector<float> x(g.size());
    for (std::size_t i = 0; i < x.size(); ++i)
        x[i] = static_cast<float>(i % 7); // mean 3 - 3 / n (the tail repeats 0, 1, 2), var ~ 4
    const auto r = reference(x, g, 0);
    std::vector<float> block(kernels::packed_moments::size(1));
    std::vector<std::byte> ws(kernels::bn_workspace_bytes<float>(g));
    kernels::pack_local_moments(sys, std::span<const float>(x), g, 0.0f, std::span(block),
                                std::span(ws));
    CHECK(kernels::packed_moments::count(block.data()) == static_cast<double>(g.per_channel()));
    CHECK(block[kernels::packed_moments::count_hi] == 1.0f);
    CHECK(block[kernels::packed_moments::count_lo] == 3.0f);
    CHECK(std::abs(block[kernels::packed_moments::mean(0)] - r.mean) <= 1e-4 * r.mean);
    CHECK(std::abs(block[kernels::packed_moments::m2(0)] - r.m2) <= 1e-3 * r.m2);
}

TEMPLATE_TEST_CASE("pack_backward_sums and input_gradient_fused match a double reference",
                   "[kernels][bn]", float, double) {
    using T = TestType;
    const host_system sys;
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
    for (const auto& g : geometries) {
        CAPTURE(g.outer, g.channels, g.inner);
        const std::size_t C = g.channels;
        const auto x = values<T>(g.size(), 31, 1.0, 3.0);
        const auto dy = values<T>(g.size(), 32, 0.0, 1.0);
        const auto mean = values<T>(C, 33, 1.0, 0.5);
        std::vector<T> s1(kernels::packed_sums::size(C)), s2(s1.size());
        std::vector<std::byte> ws(kernels::bn_workspace_bytes<T>(g));
        kernels::pack_backward_sums(sys, std::span<const T>(dy), std::span<const T>(x), g,
                                    std::span<const T>(mean), T(3), std::span<T>(s1),
                                    std::span(ws));
        kernels::pack_backward_sums_generic(sys, std::span<const T>(dy), std::span<const T>(x), g,
                                            std::span<const T>(mean), T(3), std::span<T>(s2),
                                            std::span(ws));
        CHECK(s1[kernels::packed_sums::status(C)] == T(3));
        CHECK(s2[kernels::packed_sums::status(C)] == T(3));
        for (std::size_t c = 0; c < C; ++c) {
            double sdy = 0, sdyx = 0, mag_dy = 0, mag_dyx = 0;
            for (std::size_t k = 0; k < g.per_channel(); ++k) {
                const std::size_t i = g.offset(c, k);
                sdy += dy[i];
                sdyx += double(dy[i]) * (double(x[i]) - mean[c]);
                mag_dy += std::abs(double(dy[i]));
                mag_dyx += std::abs(double(dy[i]) * (double(x[i]) - mean[c]));
            }
            for (const auto& s : {s1, s2}) {
                CHECK(std::abs(s[c] - sdy) <= tol * (mag_dy + 1e-30));
                CHECK(std::abs(s[C + c] - sdyx) <= tol * (mag_dyx + 1e-30));
            }
        }

        // totals: as if summed over replicas with 3x the local count
        std::vector<T> totals(2 * C);
        for (std::size_t j = 0; j < 2 * C; ++j)
            totals[j] = T(3) * s1[j];
        const auto gamma = values<T>(C, 34, 1.0, 0.3);
        const auto invstd = values<T>(C, 35, 2.0, 0.2);
        const auto dg0 = values<T>(C, 36, 0.0, 1.0);
        const auto db0 = values<T>(C, 37, 0.0, 1.0);
        for (const double count : {3.0 * static_cast<double>(g.per_channel()), 0.0}) {
            CAPTURE(count);
            std::vector<T> dx1(g.size()), dx2(g.size());
            std::vector<T> dg1 = dg0, db1 = db0, dg2 = dg0, db2 = db0;
            kernels::input_gradient_fused(sys, std::span<const T>(dy), std::span<const T>(x),
                                          std::span<T>(dx1), g, std::span<const T>(totals),
                                          std::span<const T>(s1), &count, std::span<const T>(gamma),
                                          std::span<const T>(mean), std::span<const T>(invstd),
                                          std::span<T>(dg1), std::span<T>(db1));
            kernels::input_gradient_fused_generic(
                sys, std::span<const T>(dy), std::span<const T>(x), std::span<T>(dx2), g,
                std::span<const T>(totals), std::span<const T>(s1), &count,
                std::span<const T>(gamma), std::span<const T>(mean), std::span<const T>(invstd),
                std::span<T>(dg2), std::span<T>(db2));
            for (std::size_t i = 0; i < g.size(); ++i) {
                const std::size_t c = g.channel_of(i);
                const double inv = invstd[c];
                const double a = count > 0 ? totals[c] / count : 0.0;
                const double b = count > 0 ? inv * inv * totals[C + c] / count : 0.0;
                const double want =
                    gamma[c] * inv * (double(dy[i]) - a - (double(x[i]) - mean[c]) * b);
                CHECK(std::abs(dx1[i] - want) <= 10 * tol * (std::abs(want) + 1));
                CHECK(dx1[i] == dx2[i]); // same coefficients, same functor: same bits
            }
            for (std::size_t c = 0; c < C; ++c) {
                const double want_g = dg0[c] + double(s1[C + c]) * invstd[c];
                const double want_b = double(db0[c]) + s1[c];
                CHECK(std::abs(dg1[c] - want_g) <= tol * (std::abs(want_g) + 1));
                CHECK(std::abs(db1[c] - want_b) <= tol * (std::abs(want_b) + 1));
                CHECK(dg1[c] == dg2[c]);
                CHECK(db1[c] == db2[c]);
            }
        }
        // Without parameter gradients (empty spans): the same dx, bit for bit, as with them
        // (checked against the reference above for this count).
        const double count = 3.0 * static_cast<double>(g.per_channel());
        std::vector<T> dx(g.size()), dx_with(g.size());
        std::vector<T> dg = dg0, db = db0;
        kernels::input_gradient_fused(sys, std::span<const T>(dy), std::span<const T>(x),
                                      std::span<T>(dx_with), g, std::span<const T>(totals),
                                      std::span<const T>(s1), &count, std::span<const T>(gamma),
                                      std::span<const T>(mean), std::span<const T>(invstd),
                                      std::span<T>(dg), std::span<T>(db));
        kernels::input_gradient_fused(
            sys, std::span<const T>(dy), std::span<const T>(x), std::span<T>(dx), g,
            std::span<const T>(totals), std::span<const T>(s1), &count, std::span<const T>(gamma),
            std::span<const T>(mean), std::span<const T>(invstd), std::span<T>(), std::span<T>());
        CHECK(dx == dx_with);
    }
}

TEST_CASE("fused entry points reject spans that do not match the geometry", "[kernels][bn]") {
    const host_system sys;
    const channel_geometry g{2, 3, 4};
    std::vector<float> x(g.size()), block(kernels::packed_moments::size(3) - 1);
    std::vector<std::byte> ws(kernels::bn_workspace_bytes<float>(g));
    CHECK_THROWS_AS(kernels::pack_local_moments(sys, std::span<const float>(x), g, 0.0f,
                                                std::span(block), std::span(ws)),
                    error);
    std::vector<float> sums(kernels::packed_sums::size(3)), mean(3);
    std::vector<std::byte> small(ws.size() - 1);
    CHECK_THROWS_AS(kernels::pack_backward_sums(
                        sys, std::span<const float>(x), std::span<const float>(x), g,
                        std::span<const float>(mean), 0.0f, std::span(sums), std::span(small)),
                    error);
}

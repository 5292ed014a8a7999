// Tests of the Philox-4x32-10 generator, its uniform/dropout helpers and rng_stream.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/philox.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/rng.hpp"
#include "lockstep/train/shard.hpp"

#include <catch2/catch.hpp>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include <cmath>
#include <cstdint>
#include <vector>

using namespace lockstep;
using kernels::philox_block;
using kernels::philox_key;

namespace {
// The known-answer vectors of Random123 (tests/kat_vectors, lines "philox4x32 10"): counter,
// key, expected output.
struct kat {
    philox_block ctr;
    philox_key key;
    philox_block out;
};
const kat philox_kats[] = {
    {{{0, 0, 0, 0}}, {{0, 0}}, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
    {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
     {{0xffffffff, 0xffffffff}},
     {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
    {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
     {{0xa4093822, 0x299f31d0}},
     {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
};

// Fills out[i] = uniform_float(seed, stream, sample, i) through the host system's Thrust policy:
// the same functor path a CUDA kernel takes.
struct fill_uniform {
    float* out;
    std::uint64_t seed;
    std::uint32_t stream;
    std::uint64_t sample;
    LOCKSTEP_HOST_DEVICE void operator()(std::uint64_t i) const {
        out[i] = kernels::uniform_float(seed, stream, sample, i);
    }
};

} // namespace

TEST_CASE("philox4x32_10 matches Random123's known-answer vectors", "[kernels][philox]") {
    for (const kat& k : philox_kats) {
        const philox_block r = kernels::philox4x32_10(k.ctr, k.key);
        for (int j = 0; j < 4; ++j)
            CHECK(r.v[j] == k.out.v[j]);
    }
}

TEST_CASE("philox counter layout: seed is the key, sample index is 64 bit", "[kernels][philox]") {
    // key = seed split {lo, hi}; counter = {block, stream, sample lo, sample hi}.
    const philox_block r = kernels::philox4x32_10(
        kernels::philox_counter(0x85a308d3u, 0x0370734413198a2eull, 0x243f6a88u),
        kernels::philox_seed_key(0x299f31d0a4093822ull));
    // Same words as the third known-answer vector, so the same output.
    CHECK(r.v[0] == 0xd16cfe09u);
    CHECK(r.v[3] == 0x24126ea1u);
    CHECK(kernels::philox_bits(0x299f31d0a4093822ull, 0x85a308d3u, 0x0370734413198a2eull,
                               4ull * 0x243f6a88u + 2) == 0x5001e420u);
    // Samples 2^32 apart must not collide (the high word is used).
    CHECK(kernels::philox_bits(7, 0, 1, 0) != kernels::philox_bits(7, 0, 1 + (1ull << 32), 0));
}

TEST_CASE("uniform conversions stay in [0, 1) and hit the ends", "[kernels][philox]") {
    CHECK(kernels::uniform_float(0u) == 0.0f);
    CHECK(kernels::uniform_float(0xffffffffu) < 1.0f);
    CHECK(kernels::uniform_float(0xffffffffu) == 1.0f - 1.0f / 16777216.0f);
    CHECK(kernels::uniform_double(0u, 0u) == 0.0);
    CHECK(kernels::uniform_double(0xffffffffu, 0xffffffffu) < 1.0);
    CHECK(kernels::uniform_double(0x80000000u, 0u) == 0.5);
}

TEST_CASE("uniforms have the mean and variance of U(0,1)", "[kernels][philox]") {
    // N = 2^20 uniforms through the Thrust host policy. Bounds are 6 standard errors:
    // sd(mean) = sqrt(1/12 / N) = 2.82e-4; sd of the sample variance ~ sqrt(1/180 / N) = 7.3e-5.
    const std::size_t n = 1u << 20;
    host_system sys;
    buffer<float> u(n, sys);
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::uint64_t>(0),
                     thrust::counting_iterator<std::uint64_t>(n),
                     fill_uniform{u.data(), 12345, 3, 77});
    double s = 0, s2 = 0;
    for (float x : u) {
        REQUIRE(x >= 0.0f);
        REQUIRE(x < 1.0f);
        s += x;
        s2 += static_cast<double>(x) * x;
    }
    const double mean = s / n, var = s2 / n - mean * mean;
    CHECK(std::abs(mean - 0.5) < 6 * 2.82e-4);
    CHECK(std::abs(var - 1.0 / 12.0) < 6 * 7.3e-5);
    // 16 equal bins: chi-square with 15 degrees of freedom; 50 is far beyond its 0.9999 quantile
    // (~44), so a pass does not depend on luck and a skewed generator fails.
    std::vector<double> bins(16, 0.0);
    for (float x : u)
        bins[static_cast<int>(x * 16)] += 1;
    double chi2 = 0;
    for (double b : bins)
        chi2 += (b - n / 16.0) * (b - n / 16.0) / (n / 16.0);
    CHECK(chi2 < 50.0);

    // Doubles across many samples (the sample index varies, the element is fixed).
    double d = 0, d2 = 0;
    const int m = 1 << 18; // sd(mean) = sqrt(1/12/m) = 5.6e-4
    for (int i = 0; i < m; ++i) {
        const double x = kernels::uniform_double(99, 0, i, 5);
        REQUIRE(x >= 0.0);
        REQUIRE(x < 1.0);
        d += x;
        d2 += x * x;
    }
    CHECK(std::abs(d / m - 0.5) < 6 * 5.6e-4);
    CHECK(std::abs(d2 / m - (d / m) * (d / m) - 1.0 / 12.0) < 6 * 1.5e-4);
}

TEST_CASE("dropout keeps 1 - p of the elements", "[kernels][philox]") {
    const int n = 1 << 18;
    for (float p : {0.0f, 0.1f, 0.5f, 0.9f, 1.0f}) {
        int kept = 0;
        for (int i = 0; i < n; ++i)
            kept += kernels::dropout_keep(2024, 1, i / 64, i % 64, p);
        // Binomial(n, 1 - p): 6 standard deviations (0 for p = 0 and p = 1: exact).
        const double sd = std::sqrt(n * p * (1.0 - p));
        CHECK(std::abs(kept - n * (1.0 - p)) <= 6 * sd);
    }
}

TEST_CASE("a sample's dropout mask does not depend on the replica count or rank",
          "[kernels][philox]") {
    const std::uint64_t seed = 0xfeedbeefcafeull, global_batch = 37, elements = 50;
    const std::uint64_t first_sample = 1000; // the batch's first global sample index
    const float p = 0.3f;
    // Reference: replica 0 of 1 holds the whole batch.
    std::vector<int> one(global_batch * elements);
    for (std::uint64_t i = 0; i < global_batch; ++i)
        for (std::uint64_t e = 0; e < elements; ++e)
            one[i * elements + e] = kernels::dropout_keep(seed, 0, first_sample + i, e, p);
    for (int replicas : {2, 3, 4}) {
        std::vector<int> merged(one.size(), -1);
        for (int r = 0; r < replicas; ++r) {
            // The trainer's split and sample index: position i of the step's global batch.
            shard_range sr = shard(global_batch, r, replicas);
            sr.sample_offset = first_sample;
            rng_stream rng{seed, 0};
            for (std::size_t i = sr.begin; i < sr.end; ++i)
                for (std::uint64_t e = 0; e < elements; ++e)
                    merged[i * elements + e] = rng.keep(sr.sample_index(i), e, p);
        }
        CHECK(merged == one);
    }
    // Replica 2 of 4 explicitly: its samples are global 19..27 (shard sizes 10, 9, 9, 9).
    const shard_range r2 = shard(global_batch, 2, 4);
    CHECK(r2.begin == 19);
    CHECK(r2.end == 28);
    // ... and masks differ between samples and between streams (no repetition).
    int same_sample = 0, same_stream = 0;
    for (std::uint64_t e = 0; e < elements; ++e) {
        same_sample += one[e] == one[elements + e];
        same_stream +=
            one[e] == static_cast<int>(kernels::dropout_keep(seed, 1, first_sample, e, p));
    }
    CHECK(same_sample < static_cast<int>(elements));
    CHECK(same_stream < static_cast<int>(elements));
}

TEST_CASE("rng_stream normals have mean 0 and variance 1", "[train][rng]") {
    const rng_stream rng{42, 0};
    const rng_stream other = rng.substream(1);
    CHECK(other.seed == 42);
    CHECK(other.stream == 1);
    CHECK(rng.bits(0, 0) != other.bits(0, 0));
    const int n = 1 << 17; // sd(mean) = 1/sqrt(n) = 2.8e-3, sd(var) = sqrt(2/n) = 3.9e-3
    double s = 0, s2 = 0;
    for (int i = 0; i < n; ++i) {
        const double z = rng.normal(i / 8, i % 8);
        REQUIRE(std::isfinite(z));
        s += z;
        s2 += z * z;
    }
    CHECK(std::abs(s / n) < 6 * 2.8e-3);
    CHECK(std::abs(s2 / n - (s / n) * (s / n) - 1.0) < 6 * 3.9e-3);
}

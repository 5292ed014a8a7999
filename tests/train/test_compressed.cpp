// reduce::compressed<half | bfloat16>: the 16-bit wire types round to nearest even, and training
// with compressed gradients stays within the rounding's bound of uncompressed training.
// SPDX-License-Identifier: Apache-2.0
#include "train_runner.hpp"

#include "lockstep/core/float16.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/sgd.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

using namespace lockstep_test;

namespace {
// Independent decoder: the IEEE binary16 value of bits, computed with ldexp in double.
double half_reference(std::uint16_t b) {
    const int sign = b >> 15, e = (b >> 10) & 31, m = b & 1023;
    double v;
    if (e == 31)
        v = m ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
    else if (e == 0)
        v = std::ldexp(double(m), -24);
    else
        v = std::ldexp(1.0 + m / 1024.0, e - 15);
    return sign ? -v : v;
}
} // namespace

TEST_CASE("half decodes every bit pattern exactly and rounds to nearest, ties to even",
          "[train][float16]") {
    for (std::uint32_t b = 0; b < 65536; ++b) {
        const auto bits = static_cast<std::uint16_t>(b);
        const double ref = half_reference(bits);
        const float got = float(lockstep::half::from_bits(bits));
        if (std::isnan(ref)) {
            REQUIRE(std::isnan(got));
            REQUIRE(std::isnan(float(lockstep::half(got)))); // NaN stays NaN
            continue;
        }
        REQUIRE(double(got) == ref);
        REQUIRE(lockstep::half(got).bits == bits); // every value round-trips
        // Between this value and the next one away from zero (finite ones only).
        if ((b & 0x7fff) >= 0x7bff)
            continue;
        const double next = half_reference(static_cast<std::uint16_t>(b + 1));
        const float mid = float((ref + next) / 2); // exact: 12 significant bits
        REQUIRE(double(mid) == (ref + next) / 2);
        const std::uint16_t even = (b & 1) ? static_cast<std::uint16_t>(b + 1) : bits;
        REQUIRE(lockstep::half(mid).bits == even);
        REQUIRE(lockstep::half(std::nextafter(mid, float(next))).bits == b + 1);
        REQUIRE(lockstep::half(std::nextafter(mid, float(ref))).bits == bits);
    }
    CHECK(lockstep::half(65504.0f).bits == 0x7bff);
    CHECK(lockstep::half(65519.99f).bits == 0x7bff);
    CHECK(lockstep::half(65520.0f).bits ==
          0x7c00); // the tie above the largest half rounds to infinity
    CHECK(lockstep::half(1e6f).bits == 0x7c00);
    CHECK(lockstep::half(-1e6f).bits == 0xfc00);
    CHECK(lockstep::half(std::ldexp(1.0f, -25)).bits ==
          0); // tie between 0 and the smallest subnormal
    CHECK(lockstep::half(std::nextafter(std::ldexp(1.0f, -25), 1.0f)).bits == 1);
    CHECK(lockstep::half(-std::ldexp(1.0f, -26)).bits == 0x8000);
    CHECK(lockstep::half(1.0f / 3).bits == 0x3555);
}

TEST_CASE("lockstep::bfloat16 keeps float's top 16 bits, rounded to nearest, ties to even",
          "[train][float16]") {
    for (std::uint32_t b = 0; b < 65536; ++b) {
        const auto bits = static_cast<std::uint16_t>(b);
        const float v = float(lockstep::bfloat16::from_bits(bits));
        std::uint32_t u;
        std::memcpy(&u, &v, 4);
        REQUIRE(u == b << 16);
        if (std::isnan(v)) {
            REQUIRE(std::isnan(float(lockstep::bfloat16(v))));
            continue;
        }
        REQUIRE(lockstep::bfloat16(v).bits == bits);
        if ((b & 0x7fff) >= 0x7f7f)
            continue;
        const float mid = lockstep::detail::bits_float((b << 16) | 0x8000u); // halfway to the next
        const std::uint16_t even = (b & 1) ? static_cast<std::uint16_t>(b + 1) : bits;
        REQUIRE(lockstep::bfloat16(mid).bits == even);
        REQUIRE(lockstep::bfloat16(lockstep::detail::bits_float((b << 16) | 0x8001u)).bits ==
                b + 1);
        REQUIRE(lockstep::bfloat16(lockstep::detail::bits_float((b << 16) | 0x7fffu)).bits == bits);
    }
    CHECK(lockstep::bfloat16(1.0f / 3).bits == 0x3eab);
    CHECK(lockstep::bfloat16(std::numeric_limits<float>::max()).bits ==
          0x7f80); // rounds to infinity
}

namespace {
// One rounding of every replica's gradient contribution: a relative gradient error of at most
// u = Wire::unit_roundoff per element (relative to the sum of |contributions|). Over 20 steps of
// a stable optimizer the weights' error is a sum of 20 such perturbations of the updates, each
// bounded by lr * u * |g| (SGD) or about lr * u (Adam: the ratio m / sqrt(v) inherits the
// relative error), so the normwise weight error stays below 20 * u relative to the weights
// (|w| >> 20 lr |g| here). The bound is 20 u: 0.0098 for half, 0.078 for bfloat16.
template <class Wire, class Opt>
void check_compressed(typename Opt::params_type p) {
    using T = typename Opt::value_type;
    const double tol = 20 * Wire::unit_roundoff;
    const auto ref = train_run<T, Opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        {.replicas = 1}, p);
    for (int replicas : {2, 4}) {
        INFO("replicas " << replicas);
        const auto run =
            train_run<T, Opt, sync::synchronous, reduce::compressed<Wire>, storage::registry>(
                {.replicas = replicas}, p);
        // Every replica sums the same rounded contributions in rank order: identical bits.
        CHECK(first_divergence(run) == "");
        double worst = 0;
        for (std::size_t s = 0; s < run.params[0].size(); ++s)
            worst = std::max(worst,
                             max_tensor_rel_error(run.params[0][s], ref.params[0][s], ref.layout));
        INFO("max relative weight error " << worst << ", bound " << tol);
        CHECK(worst <= tol);
        // Compression is not free: the result differs from the exact one.
        CHECK(worst > 0);
    }
}
} // namespace

TEST_CASE("compressed gradients train like exact ones within 20 unit roundoffs",
          "[train][thread][compressed]") {
    SECTION("half, sgd") {
        check_compressed<lockstep::half, optim::sgd<float>>({.lr = 0.1, .momentum = 0.9});
    }
    SECTION("bfloat16, sgd") {
        check_compressed<lockstep::bfloat16, optim::sgd<float>>({.lr = 0.1, .momentum = 0.9});
    }
    SECTION("half, adam") {
        check_compressed<lockstep::half, optim::adam<float>>({.lr = 1e-2});
    }
    SECTION("bfloat16, adam (double parameters)") {
        check_compressed<lockstep::bfloat16, optim::adam<double>>({.lr = 1e-2});
    }
}

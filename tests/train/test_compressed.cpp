// reduce::compressed<half | bfloat16>: the 16-bit wire types round to nearest even (scalar and
// array conversions, bit for bit), compressed_all_reduce sums within its bound with identical
// bits everywhere, and training with compressed gradients stays within the bound of
// uncompressed training. SPDX-License-Identifier: Apache-2.0
#include "train_runner.hpp"

#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/float16_arrays.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/detail/compressed_all_reduce.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

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
using lockstep::detail::bits_float;
using lockstep::detail::float_bits;

// The inputs of the forward array tests: every sign x exponent with mantissas at and around
// the rounding points of both wire types (ties, ties +- 1 ulp, the extremes), signed zeros,
// infinities, NaNs with assorted payloads (quiet and signalling), then 2^20 random bit
// patterns (every class, uniformly over the bits).
std::vector<float> forward_inputs() {
    std::vector<float> x;
    const std::uint32_t mantissas[] = {0,        1,        2,        0x0fff,   0x1000,   0x1001,
                                       0x1fff,   0x2000,   0x3000,   0x7fff,   0x8000,   0x8001,
                                       0xffff,   0x10000,  0x18000,  0x3fffff, 0x400000, 0x400001,
                                       0x7fe000, 0x7fefff, 0x7ff000, 0x7ff001, 0x7fffff};
    for (std::uint32_t sign : {0u, 1u})
        for (std::uint32_t e = 0; e < 256; ++e)
            for (std::uint32_t m : mantissas)
                x.push_back(bits_float(sign << 31 | e << 23 | m));
    std::mt19937_64 rng(20240611);
    for (int i = 0; i < (1 << 20); ++i)
        x.push_back(bits_float(static_cast<std::uint32_t>(rng())));
    return x;
}

template <class Wire>
void check_array_conversions() {
    namespace d = lockstep::detail;
    // Back: all 65536 bit patterns, from an odd byte offset so no load is aligned, and the
    // lengths 1..17 (every tail of the 8- and 16-lane loops).
    std::vector<unsigned char> bytes(2 * 65536 + 1);
    for (std::uint32_t b = 0; b < 65536; ++b) {
        const auto v = static_cast<std::uint16_t>(b);
        std::memcpy(bytes.data() + 1 + std::size_t{2} * b, &v, 2);
    }
    std::vector<float> fast(65536), portable(65536);
    d::from_wire_n<Wire>(bytes.data() + 1, 65536, fast.data());
    d::from_wire_n_portable<Wire>(bytes.data() + 1, 65536, portable.data());
    std::size_t bad = 0;
    for (std::uint32_t b = 0; b < 65536; ++b) {
        const std::uint32_t want =
            float_bits(float(Wire::from_bits(static_cast<std::uint16_t>(b))));
        if (float_bits(fast[b]) != want || float_bits(portable[b]) != want) {
            if (++bad <= 5)
                FAIL_CHECK("bits " << b << ": scalar " << want << ", array " << float_bits(fast[b])
                                   << ", portable " << float_bits(portable[b]));
        }
    }
    CHECK(bad == 0);
    for (std::size_t len = 1; len <= 17; ++len) {
        std::vector<float> got(len);
        d::from_wire_n<Wire>(bytes.data() + 1 + std::size_t{2} * 0x7bf0, len, got.data());
        for (std::size_t i = 0; i < len; ++i)
            CHECK(float_bits(got[i]) ==
                  float_bits(float(Wire::from_bits(static_cast<std::uint16_t>(0x7bf0 + i)))));
    }
    // Forward: against Wire(float) for every input, through the dispatched and the portable
    // path, into an odd byte offset.
    const std::vector<float> x = forward_inputs();
    std::vector<unsigned char> out(2 * x.size() + 1), out_portable(2 * x.size() + 1);
    d::to_wire_n<Wire>(x.data(), x.size(), out.data() + 1);
    d::to_wire_n_portable<Wire>(x.data(), x.size(), out_portable.data() + 1);
    bad = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
        std::uint16_t a, p;
        std::memcpy(&a, out.data() + 1 + 2 * i, 2);
        std::memcpy(&p, out_portable.data() + 1 + 2 * i, 2);
        const std::uint16_t want = Wire(x[i]).bits;
        if (a != want || p != want) {
            if (++bad <= 5)
                FAIL_CHECK("float bits " << float_bits(x[i]) << ": scalar " << want << ", array "
                                         << a << ", portable " << p);
        }
    }
    CHECK(bad == 0);
    for (std::size_t len = 1; len <= 17; ++len) {
        std::vector<std::uint16_t> got(len);
        d::to_wire_n<Wire>(x.data() + 3, len, got.data());
        for (std::size_t i = 0; i < len; ++i)
            CHECK(got[i] == Wire(x[3 + i]).bits);
    }
}
} // namespace

TEST_CASE("array conversions equal the scalar ones bit for bit, with and without F16C",
          "[train][float16]") {
#if LOCKSTEP_F16_X86
    INFO("F16C/AVX2 path in use: " << lockstep::detail::cpu_has_f16c());
#endif
    SECTION("half") {
        check_array_conversions<lockstep::half>();
    }
    SECTION("bfloat16") {
        check_array_conversions<lockstep::bfloat16>();
    }
}

namespace {
// Replica r's value at element i: different on every replica, spread over many binades, with
// exact zeros, cancellation (sums near zero) and values in half's subnormal range.
double wire_input(int r, std::size_t i) {
    const double base = std::sin(0.731 * double(i) + 1.9 * r) * std::ldexp(1.0, int(i % 23) - 12);
    if (i % 97 == 5)
        return 0.0;
    if (i % 89 == 7)
        return r % 2 ? 1.5e-6 : -1.25e-6; // cancels across replicas; half-subnormal
    return base * (1 + 0.1 * r);
}

// What compressed_all_reduce must produce, emulated with the scalar conversions: every
// contribution rounded to Wire (through float), summed in float in rank order, the sum rounded
// to Wire.
template <class Wire>
float emulate(int replicas, std::size_t i) {
    float acc = float(Wire(static_cast<float>(wire_input(0, i))));
    for (int r = 1; r < replicas; ++r)
        acc += float(Wire(static_cast<float>(wire_input(r, i))));
    return float(Wire(acc));
}

template <class Wire, class T>
void check_compressed_all_reduce(int replicas, std::size_t n, std::size_t chunk) {
    using lockstep::thread_communicator;
    std::vector<std::vector<T>> got(static_cast<std::size_t>(replicas));
    std::vector<std::size_t> calls(static_cast<std::size_t>(replicas));
    lockstep::thread_group(replicas).run([&](thread_communicator& comm) {
        std::vector<T> g(n);
        for (std::size_t i = 0; i < n; ++i)
            g[i] = static_cast<T>(wire_input(comm.rank(), i));
        lockstep::detail::compressed_workspace<T, lockstep::host_system> ws(comm.system(),
                                                                            comm.size(), n, chunk);
        calls[static_cast<std::size_t>(comm.rank())] =
            lockstep::detail::compressed_all_reduce<Wire>(comm, std::span<T>(g), ws);
        got[static_cast<std::size_t>(comm.rank())] = std::move(g);
    });
    const std::size_t chunks = (n + chunk - 1) / chunk;
    // The bound of compressed_all_reduce.hpp: u sum|g| + u |sum g| + (replicas - 1) 2^-24 sum|g|,
    // plus 2^-24 sum|g| for the rounding of double to float, plus 2^-25 per rounding (replicas
    // + 1 of them) where half is subnormal.
    const double u = Wire::unit_roundoff, f = std::ldexp(1.0, -24);
    const double floor =
        std::is_same_v<Wire, lockstep::half> ? (replicas + 1) * std::ldexp(1.0, -25) : 0.0;
    double worst = 0; // the largest error as a fraction of the bound
    std::size_t inexact = 0;
    for (std::size_t i = 0; i < n; ++i) {
        double ref = 0, mag = 0;
        for (int r = 0; r < replicas; ++r) {
            const double v = static_cast<T>(wire_input(r, i)); // as the replica holds it
            ref += v;
            mag += std::abs(v);
        }
        const double bound = u * mag + u * std::abs(ref) + replicas * f * mag + floor;
        const double err = std::abs(double(got[0][i]) - ref);
        worst = std::max(worst, bound > 0 ? err / bound : err);
        inexact += err > 0;
        // Bit for bit the emulated algorithm (for float; double's contributions pass float).
        const float want = emulate<Wire>(replicas, i);
        if (float_bits(static_cast<float>(got[0][i])) != float_bits(want)) {
            FAIL_CHECK("element " << i << ": " << got[0][i] << ", emulated " << want);
            break;
        }
    }
    INFO("replicas " << replicas << ", n " << n << ", chunk " << chunk);
    CHECK(worst <= 1.0);
    if (n > 1000)
        CHECK(inexact > 0); // compression is not free
    for (int r = 1; r < replicas; ++r)
        CHECK(std::memcmp(got[static_cast<std::size_t>(r)].data(), got[0].data(), n * sizeof(T)) ==
              0);
    for (std::size_t c : calls)
        CHECK(c == 2 * chunks);
}
} // namespace

TEST_CASE("compressed_all_reduce sums within its bound, identical on every replica",
          "[train][thread][compressed]") {
    const int replicas = GENERATE(1, 2, 3, 4, 6);
    // Sizes below the replica count, odd, uneven over the shards, and several chunks with a
    // short last one.
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{5},
                                std::size_t{127}, std::size_t{4099}, std::size_t{100003}}) {
        check_compressed_all_reduce<lockstep::half, float>(replicas, n, 1 << 18);
        check_compressed_all_reduce<lockstep::bfloat16, float>(replicas, n, 1 << 18);
    }
    check_compressed_all_reduce<lockstep::half, float>(replicas, 100003, 4096);
    check_compressed_all_reduce<lockstep::bfloat16, double>(replicas, 100003, 30001);
    check_compressed_all_reduce<lockstep::half, double>(replicas, 4099, 1000);
}

TEST_CASE("compressed_all_reduce without F16C/AVX2 gives the same bits",
          "[train][thread][compressed]") {
    // Every array conversion and the shard sum take their portable loops meanwhile.
    struct portable_only {
        portable_only() { lockstep::detail::f16_portable_only() = true; }
        ~portable_only() { lockstep::detail::f16_portable_only() = false; }
    } guard;
    const int replicas = GENERATE(1, 3);
    for (const std::size_t n : {std::size_t{5}, std::size_t{4099}, std::size_t{100003}}) {
        check_compressed_all_reduce<lockstep::half, float>(replicas, n, 1 << 16);
        check_compressed_all_reduce<lockstep::bfloat16, float>(replicas, n, 4096);
        check_compressed_all_reduce<lockstep::half, double>(replicas, n, 30001);
    }
}

namespace {
// The reduced gradient's error per element is at most u sum_r |g_r| + u |sum_r g_r| + (replicas
// - 1) 2^-24 sum_r |g_r| (each replica's contribution rounded once, the float sum once; u =
// Wire::unit_roundoff), i.e. below 2u + 2^-22 relative to sum_r |g_r| for 4 replicas. The
// replicas hold different shards of every batch, so their gradients differ. Over 20 steps of a
// stable optimizer the weights' error is a sum of 20 such perturbations of the updates, each
// bounded by lr * (2u + 2^-22) * |g| (SGD) or about lr * (2u + 2^-22) (Adam: the ratio
// m / sqrt(v) inherits the relative error), so the normwise weight error stays below
// 20 * (2u + 2^-22) relative to the weights (|w| >> 20 lr |g| here): 0.0195 for half, 0.156
// for bfloat16.
template <class Wire, class Opt>
void check_compressed(typename Opt::params_type p) {
    using T = typename Opt::value_type;
    const double tol = 20 * (2 * Wire::unit_roundoff + std::ldexp(1.0, -22));
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

TEST_CASE("compressed gradients train like exact ones within 20 steps' error bounds",
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

// The order-independent sums (kernels/anchored_sum.hpp, kernels/exact_sum.hpp) and
// core/leading_zeros.hpp on cuda_system give the same bits as on host_system, where the host
// tests check them against exact references: the same functors, values over every range that
// selects a different path (the one-int64 float sum, the 128-bit sum, subnormals, cancellation,
// overflow, NaN). SPDX-License-Identifier: Apache-2.0
#include "lockstep/core/leading_zeros.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/exact_sum.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"
#include "lockstep/system/host_system.hpp"

#include "cuda_test_support.hpp"
#include "support/splitmix64.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

namespace {

using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::host_system;
namespace kernels = lockstep::kernels;

using words = lockstep_test::splitmix64;

/// A value of T with a random sign and mantissa whose binary exponent is base + [0, spread).
template <class T>
T spread_value(words& w, int base, int spread) {
    const double m = 1.0 + static_cast<double>(w.next() >> 11) * 0x1p-53;
    const int e = base + static_cast<int>(w.next() % static_cast<std::uint64_t>(spread));
    const T v = static_cast<T>(std::ldexp(m, e));
    return (w.next() & 1) != 0 ? -v : v;
}

/// terms values per element for n elements, laid out as anchored_terms reads them (element i's
/// term t at t * n + i). The element's kind (i % 8) picks the range its values come from.
template <class T>
std::vector<T> test_values(std::size_t n, std::size_t terms, std::uint64_t seed) {
    using L = std::numeric_limits<T>;
    words w{seed};
    std::vector<T> v(n * terms);
    for (std::size_t i = 0; i < n; ++i)
        for (std::size_t t = 0; t < terms; ++t) {
            T x = 0;
            switch (i % 8) {
            case 0:
                x = spread_value<T>(w, -8, 8);
                break; // within 16 binades
            case 1:
                x = spread_value<T>(w, -70, 70);
                break; // wider: the 128-bit sum
            case 2:
                x = spread_value<T>(w, L::min_exponent - 30, 40);
                break; // subnormals
            case 3:    // cancellation: +x, -x pairs and one small value
                x = t == 0 ? spread_value<T>(w, -40, 4) : (t % 2 == 1 ? T(1.5) : T(-1.5));
                break;
            case 4:
                x = spread_value<T>(w, L::max_exponent - 3, 3);
                break; // overflow to infinity
            case 5:
                x = t == terms / 2 ? L::quiet_NaN() : spread_value<T>(w, 0, 4);
                break;
            case 6:
                x = t % 3 == 0 ? T(0) : spread_value<T>(w, -100, 200);
                break; // zeros
            default:
                x = spread_value<T>(w, -20, 50);
                break;
            }
            v[t * n + i] = x;
        }
    return v;
}

/// Bits of a float or double, for comparisons that also hold for NaN.
template <class T>
auto bits_of(T x) {
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    return std::bit_cast<U>(x);
}

/// Runs `make(values, out)` (a functor of n tasks reading `values` and writing n results) on
/// sys and returns the results on the host.
template <class Out, class In, class System, class Make>
std::vector<Out> run_on(const System& sys, const std::vector<In>& values, std::size_t n,
                        Make make) {
    buffer<In, System> in(values.size(), sys);
    buffer<Out, System> out(n, sys);
    lockstep::copy(std::span<const In>(values), host_system{1}, in.span(), sys);
    kernels::for_each_index(sys, n, make(in.data(), out.data()));
    std::vector<Out> result(n);
    lockstep::copy(std::span<const Out>(out.span()), sys, std::span<Out>(result), host_system{1});
    return result;
}

/// The number of elements whose bits differ between a and b; the first is reported.
template <class T>
std::size_t bit_differences(const std::vector<T>& a, const std::vector<T>& b) {
    std::size_t count = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
        if (bits_of(a[i]) != bits_of(b[i])) {
            if (count == 0)
                UNSCOPED_INFO("element " << i << " (kind " << i % 8 << "): host " << a[i]
                                         << ", device " << b[i]);
            ++count;
        }
    return count;
}

/// bit_differences between make's results on the host and on sys.
template <class Out, class In, class Make>
std::size_t host_device_differences(const cuda_system& sys, const std::vector<In>& values,
                                    std::size_t n, Make make) {
    return bit_differences(run_on<Out>(host_system{1}, values, n, make),
                           run_on<Out>(sys, values, n, make));
}

/// Element i (of n): clear, add its terms (term t at t * n + i) in order, round once.
template <class T>
struct binned_sum_fn {
    const T* v;
    std::size_t n;
    std::size_t terms;
    std::int64_t* top;
    std::int64_t* bins;
    double* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        kernels::binned_clear_fn{top, bins, n}(i);
        for (std::size_t t = 0; t < terms; ++t)
            kernels::detail::binned_add(top[i], bins + i, n, v[t * n + i]);
        kernels::binned_finalize_fn<double>{top, bins, n, 0, out}(i);
    }
};

/// The reducer's own check in place: out[i] starts as the last chunk's value (the reducer marks
/// the chunk it keeps), then anchored_own_check_fn marks it.
template <class T>
struct own_check_in_place_fn {
    kernels::anchored_chunks<T> chunks;
    T* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        out[i] = chunks.last[i];
        kernels::anchored_own_check_fn<T>{chunks, out}(i);
    }
};

/// leading zeros of words[i] into out[i].
struct leading_zeros_fn {
    const std::uint64_t* words;
    int* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        out[i] = lockstep::countl_zero64(words[i]);
    }
};

} // namespace

TEST_CASE("countl_zero64 in a kernel equals std::countl_zero on the host", "[kernels][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    std::vector<std::uint64_t> in;
    for (int b = 0; b < 64; ++b)
        in.push_back((std::uint64_t{1} << b) | (std::uint64_t{1} << (b / 2)));
    in.push_back(0);
    in.push_back(~std::uint64_t{0});
    const lockstep::cuda_stream stream(0);
    const cuda_system sys = stream.system();
    const auto got = run_on<int>(sys, in, in.size(), [](const std::uint64_t* w, int* out) {
        return leading_zeros_fn{w, out};
    });
    for (std::size_t i = 0; i < in.size(); ++i) {
        INFO("word " << in[i]);
        CHECK(got[i] == std::countl_zero(in[i]));
    }
}

TEMPLATE_TEST_CASE("anchored sums on cuda_system equal the host's bit for bit",
                   "[kernels][cuda][gpu]", float, double) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    const lockstep::cuda_stream stream(0);
    const cuda_system sys = stream.system();
    constexpr std::size_t n = 4096;
    // replicas x calls terms per element: one chunk per replica, several, and past the short
    // sum's 256-term limit.
    const std::size_t shapes[][2] = {{4, 1}, {3, 5}, {2, 150}};
    for (const auto& shape : shapes) {
        const std::size_t replicas = shape[0];
        const std::size_t calls = shape[1];
        const std::size_t terms = replicas * calls;
        const auto values = test_values<T>(n, terms, 0x5eed + terms);
        const auto make = [&](const T* v, T* out) {
            // anchored_terms: value c of replica j at j * (calls n) + c * n + i.
            return kernels::anchored_sum_fn<T>{{v, replicas, calls, calls * n, n}, out};
        };
        INFO(replicas << " replicas x " << calls << " calls");
        CHECK(host_device_differences<T>(sys, values, n, make) == 0);
        // The own check: one replica's chunks (the last one apart, as the reducer keeps it).
        const auto check = [&](const T* v, T* out) {
            return own_check_in_place_fn<T>{{v, v + (calls - 1) * n, calls, n}, out};
        };
        CHECK(host_device_differences<T>(sys, values, n, check) == 0);
    }
}

TEMPLATE_TEST_CASE("binned sums on cuda_system equal the host's bit for bit",
                   "[kernels][cuda][gpu]", float, double) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    const lockstep::cuda_stream stream(0);
    const cuda_system sys = stream.system();
    constexpr std::size_t n = 4096;
    constexpr std::size_t terms = 12;
    const auto values = test_values<T>(n, terms, 0xb1d);
    const auto on = [&](const auto& s) {
        using S = std::decay_t<decltype(s)>;
        buffer<std::int64_t, S> top(n, s);
        buffer<std::int64_t, S> bins(n * kernels::binned::window, s);
        return run_on<double>(s, values, n, [&](const T* v, double* out) {
            return binned_sum_fn<T>{v, n, terms, top.data(), bins.data(), out};
        });
    };
    CHECK(bit_differences(on(host_system{1}), on(sys)) == 0);
}

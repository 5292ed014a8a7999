// Tests of the execution_system concept and of per-system kernel operations found by
// argument-dependent lookup: a system defined outside lockstep runs the kernels' generic path.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/system.hpp"

#include <catch2/catch.hpp>
#include <thrust/system/cpp/execution_policy.h>

#include <cmath>
#include <cstddef>
#include <new>
#include <span>
#include <vector>

namespace user_systems {

// A third system, written against the concept only: host memory, Thrust's serial CPP system.
class serial_system {
public:
    static constexpr bool is_host = true;
    static constexpr std::size_t alignment = 32;
    auto policy() const { return thrust::cpp::par; }
    void synchronize() const noexcept {}
    void* allocate(std::size_t bytes) const {
        return bytes == 0 ? nullptr : ::operator new (bytes, std::align_val_t{alignment});
    }
    void deallocate(void* p, std::size_t) const noexcept {
        if (p != nullptr)
            ::operator delete (p, std::align_val_t{alignment});
    }
    friend bool operator==(const serial_system&, const serial_system&) = default;
};

// A system with its own bn_normalize, declared in its namespace: the kernel finds it by ADL.
// It counts its calls and then runs the generic path.
class counted_system : public serial_system {
public:
    explicit counted_system(int* calls = nullptr) : calls_(calls) {}
    int* calls() const noexcept { return calls_; }
    friend bool operator==(const counted_system&, const counted_system&) = default;

private:
    int* calls_;
};

template <class T, class Acc>
void bn_normalize(const counted_system& sys, std::span<const T> x, std::span<T> y,
                  lockstep::kernels::channel_geometry g, std::span<const Acc> mean,
                  std::span<const Acc> scale, std::span<const Acc> beta) {
    ++*sys.calls();
    lockstep::kernels::bn_normalize(sys, x, y, g, mean, scale, beta);
}

// Types that miss one part of the concept.
struct no_synchronize {
    static constexpr bool is_host = true;
    static constexpr std::size_t alignment = 64;
    auto policy() const { return thrust::cpp::par; }
    void* allocate(std::size_t) const { return nullptr; }
    void deallocate(void*, std::size_t) const noexcept {}
    friend bool operator==(const no_synchronize&, const no_synchronize&) = default;
};
struct no_allocate {
    static constexpr bool is_host = true;
    static constexpr std::size_t alignment = 64;
    auto policy() const { return thrust::cpp::par; }
    void synchronize() const noexcept {}
    void deallocate(void*, std::size_t) const noexcept {}
    friend bool operator==(const no_allocate&, const no_allocate&) = default;
};
struct throwing_deallocate {
    static constexpr bool is_host = true;
    static constexpr std::size_t alignment = 64;
    auto policy() const { return thrust::cpp::par; }
    void synchronize() const noexcept {}
    void* allocate(std::size_t) const { return nullptr; }
    void deallocate(void*, std::size_t) const {}
    friend bool operator==(const throwing_deallocate&, const throwing_deallocate&) = default;
};
struct runtime_is_host {
    static inline bool is_host = true; // not a constant expression
    static constexpr std::size_t alignment = 64;
    auto policy() const { return thrust::cpp::par; }
    void synchronize() const noexcept {}
    void* allocate(std::size_t) const { return nullptr; }
    void deallocate(void*, std::size_t) const noexcept {}
    friend bool operator==(const runtime_is_host&, const runtime_is_host&) = default;
};
struct odd_alignment {
    static constexpr bool is_host = true;
    static constexpr std::size_t alignment = 48;
    auto policy() const { return thrust::cpp::par; }
    void synchronize() const noexcept {}
    void* allocate(std::size_t) const { return nullptr; }
    void deallocate(void*, std::size_t) const noexcept {}
    friend bool operator==(const odd_alignment&, const odd_alignment&) = default;
};
struct not_comparable {
    static constexpr bool is_host = true;
    static constexpr std::size_t alignment = 64;
    auto policy() const { return thrust::cpp::par; }
    void synchronize() const noexcept {}
    void* allocate(std::size_t) const { return nullptr; }
    void deallocate(void*, std::size_t) const noexcept {}
};

} // namespace user_systems

using lockstep::execution_system;
using lockstep::host_system;
using lockstep::kernels::channel_geometry;
using user_systems::counted_system;
using user_systems::serial_system;

static_assert(execution_system<host_system>);
static_assert(execution_system<serial_system>);
static_assert(execution_system<counted_system>);
static_assert(!execution_system<user_systems::no_synchronize>);
static_assert(!execution_system<user_systems::no_allocate>);
static_assert(!execution_system<user_systems::throwing_deallocate>);
static_assert(!execution_system<user_systems::runtime_is_host>);
static_assert(!execution_system<user_systems::odd_alignment>);
static_assert(!execution_system<user_systems::not_comparable>);
static_assert(!execution_system<int>);

namespace {

std::vector<float> values(std::size_t n, unsigned seed) {
    std::vector<float> v(n);
    unsigned s = seed * 2654435761u + 1;
    for (auto& x : v) {
        s = s * 1664525u + 1013904223u;
        x = static_cast<float>((s >> 8) % 20001) / 1000.0f - 10.0f;
    }
    return v;
}

// y = (x - mean[c]) * scale[c] + beta[c] in double, by the definition of the layout.
double naive_normalize(const std::vector<float>& x, std::size_t i, const channel_geometry& g,
                       const std::vector<float>& mean, const std::vector<float>& scale,
                       const std::vector<float>& beta) {
    const std::size_t c = (i / g.inner) % g.channels;
    return (double(x[i]) - mean[c]) * scale[c] + beta[c];
}

const channel_geometry geometries[] = {{4, 3, 50}, {257, 5, 1}, {1, 1, 1}, {2, 7, 33}};

} // namespace

TEST_CASE("a user-defined system runs the generic normalize path", "[system][host]") {
    const serial_system sys;
    for (const auto& g : geometries) {
        CAPTURE(g.outer, g.channels, g.inner);
        const auto xv = values(g.size(), 1);
        const auto mean = values(g.channels, 2), scale = values(g.channels, 3),
                   beta = values(g.channels, 4);
        // The data lives in the user system's memory (its allocate), as a kernel requires.
        lockstep::buffer<float, serial_system> x(g.size(), sys), y(g.size(), sys);
        std::copy(xv.begin(), xv.end(), x.begin());
        lockstep::kernels::normalize(sys, std::span<const float>(x.span()), y.span(), g,
                                     std::span<const float>(mean), std::span<const float>(scale),
                                     std::span<const float>(beta));
        // The generic path on the host system: the same functor per value, so the same bits.
        std::vector<float> y_host(g.size());
        lockstep::kernels::normalize_generic(
            host_system{}, std::span<const float>(xv), std::span<float>(y_host), g,
            std::span<const float>(mean), std::span<const float>(scale),
            std::span<const float>(beta));
        for (std::size_t i = 0; i < g.size(); ++i) {
            const double want = naive_normalize(xv, i, g, mean, scale, beta);
            CHECK(std::abs(y[i] - want) <= 1e-5 * (std::abs(want) + 1));
            CHECK(y[i] == y_host[i]);
        }
    }
}

TEST_CASE("a user-defined system checks the kernel's preconditions", "[system][host]") {
    const serial_system sys;
    const channel_geometry g{2, 3, 4};
    std::vector<float> x(g.size() - 1), y(g.size()), p(3);
    CHECK_THROWS_AS(lockstep::kernels::normalize(sys, std::span<const float>(x),
                                                 std::span<float>(y), g, std::span<const float>(p),
                                                 std::span<const float>(p),
                                                 std::span<const float>(p)),
                    lockstep::error);
}

TEST_CASE("a user-defined system's packed moments match the host's generic path bit for bit",
          "[system][host]") {
    const serial_system sys;
    for (const auto& g : geometries) {
        CAPTURE(g.outer, g.channels, g.inner);
        const auto x = values(g.size(), 5);
        const std::size_t ws_bytes = lockstep::kernels::bn_workspace_bytes<float>(g);
        const std::size_t words = lockstep::kernels::packed_moments::size(g.channels);
        std::vector<std::byte> ws1(ws_bytes), ws2(ws_bytes);
        std::vector<float> mine(words), host(words);
        lockstep::kernels::pack_local_moments(sys, std::span<const float>(x), g, 0.0f,
                                              std::span<float>(mine), std::span<std::byte>(ws1));
        lockstep::kernels::pack_local_moments_generic(host_system{}, std::span<const float>(x), g,
                                                      0.0f, std::span<float>(host),
                                                      std::span<std::byte>(ws2));
        for (std::size_t k = 0; k < words; ++k)
            CHECK(mine[k] == host[k]);
    }
}

TEST_CASE("a system's own operation is found by argument-dependent lookup", "[system][host]") {
    int calls = 0;
    const counted_system sys(&calls);
    const channel_geometry g{3, 2, 5};
    const auto x = values(g.size(), 6);
    const auto p = values(g.channels, 7);
    std::vector<float> y(g.size()), y_generic(g.size());
    lockstep::kernels::normalize(sys, std::span<const float>(x), std::span<float>(y), g,
                                 std::span<const float>(p), std::span<const float>(p),
                                 std::span<const float>(p));
    CHECK(calls == 1);
    // The *_generic entry point always runs the generic path, never the system's own.
    lockstep::kernels::normalize_generic(sys, std::span<const float>(x),
                                         std::span<float>(y_generic), g, std::span<const float>(p),
                                         std::span<const float>(p), std::span<const float>(p));
    CHECK(calls == 1);
    CHECK(y == y_generic);
    // Operations the system does not declare run the generic path.
    std::vector<float> s(2 * g.channels), ws(lockstep::kernels::backward_workspace_size(g));
    lockstep::kernels::backward_sums(sys, std::span<const float>(x), std::span<const float>(x), g,
                                     std::span<const float>(p), std::span<float>(s),
                                     std::span<float>(ws));
    CHECK(calls == 1);
    std::vector<float> s_generic(s.size()), ws_generic(ws.size());
    lockstep::kernels::backward_sums_generic(
        sys, std::span<const float>(x), std::span<const float>(x), g, std::span<const float>(p),
        std::span<float>(s_generic), std::span<float>(ws_generic));
    CHECK(s == s_generic);
    // ... and they are the sums (dy = x here): a double loop, within float rounding of 15 terms.
    std::vector<double> want(2 * g.channels), size(2 * g.channels);
    for (std::size_t i = 0; i < g.size(); ++i) {
        const std::size_t c = g.channel_of(i);
        const double term = double(x[i]) * (double(x[i]) - p[c]);
        want[c] += x[i];
        size[c] += std::abs(double(x[i]));
        want[g.channels + c] += term;
        size[g.channels + c] += std::abs(term);
    }
    for (std::size_t k = 0; k < want.size(); ++k)
        CHECK(std::abs(s[k] - want[k]) <= 1e-6 * size[k]);
}

namespace adl_probe {

// Converts to host_system and has a lockstep type as template argument, so namespace lockstep
// is one of its associated namespaces and lockstep::host (host_system's own) is not.
template <class Tag>
struct converts_to_host {
    operator const lockstep::host_system&() const { return system; }
    lockstep::host_system system{1};
};

// True when an unqualified bn_normalize(a...) finds a viable overload: no bn_normalize is
// declared in this namespace, so only argument-dependent lookup can find one.
template <class System>
concept finds_host_normalize = requires(const System& s, std::span<const float> x,
                                        std::span<float> y, channel_geometry g) {
    bn_normalize(s, x, y, g, x, x, x);
};

} // namespace adl_probe

TEST_CASE("host_system's own operations are found only through host_system", "[system][host]") {
    // Found on host_system itself (its base puts namespace lockstep::host in the lookup).
    STATIC_REQUIRE(adl_probe::finds_host_normalize<host_system>);
    // Not through any other lockstep type: were the host overloads declared in namespace
    // lockstep, the lockstep::half argument would bring them in and the conversion would make
    // them viable.
    STATIC_REQUIRE_FALSE(
        adl_probe::finds_host_normalize<adl_probe::converts_to_host<lockstep::half>>);
    // The user-defined conversion works with the overload named directly.
    const adl_probe::converts_to_host<lockstep::half> h;
    const channel_geometry g{2, 3, 4};
    const auto x = values(g.size(), 3);
    const auto p = values(g.channels, 4);
    std::vector<float> y(g.size()), y_generic(g.size());
    lockstep::host::bn_normalize(h, std::span<const float>(x), std::span<float>(y), g,
                                 std::span<const float>(p), std::span<const float>(p),
                                 std::span<const float>(p));
    lockstep::kernels::normalize_generic(host_system{1}, std::span<const float>(x),
                                         std::span<float>(y_generic), g, std::span<const float>(p),
                                         std::span<const float>(p), std::span<const float>(p));
    CHECK(y == y_generic);
}

// Tests of cuda_system and cross-system copies; host_system lives in the same nvcc translation
// unit on purpose. GPU cases skip with a message where no device exists.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp" // first: the header compiles on its own
#include "lockstep/system/host_system.hpp"

#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include <thrust/functional.h>
#include <thrust/reduce.h>
#include <thrust/transform.h>

namespace {

using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::host_system;

static_assert(!cuda_system::is_host, "device memory must not be host-dereferenceable");
static_assert(host_system::is_host);
static_assert(std::is_trivially_copyable_v<cuda_system>,
              "cuda_system is a cheap handle passed by value into replicas");

/// y = a * x + y, the same functor on both systems.
struct axpy {
    float a;
    LOCKSTEP_HOST_DEVICE float operator()(float x, float y) const { return a * x + y; }
};

/// float -> double on either system.
struct widen {
    LOCKSTEP_HOST_DEVICE double operator()(float v) const { return static_cast<double>(v); }
};

/// Values that differ element by element (and are not all representable sums).
std::vector<float> ramp(std::size_t n, float scale) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i)
        v[i] = scale * static_cast<float>((i * 7919u) % 1009u) / 1009.0f - 0.25f * scale;
    return v;
}

buffer<float, host_system> to_host_buffer(const std::vector<float>& v) {
    buffer<float, host_system> b(v.size());
    for (std::size_t i = 0; i < v.size(); ++i)
        b[i] = v[i];
    return b;
}

} // namespace

TEST_CASE("cuda_device_count reports the devices or 0", "[system][cuda]") {
    const int n = lockstep::cuda_device_count();
    CHECK(n >= 0);
    int raw = 0;
    if (cudaGetDeviceCount(&raw) == cudaSuccess) {
        CHECK(n == raw);
        CHECK(cudaGetLastError() == cudaSuccess); // nothing left for an unrelated later check
    } else {
        CHECK(n == 0); // no driver or no device: every runtime call keeps failing
    }
}

TEST_CASE("copy between systems checks sizes before touching a device", "[system][cuda]") {
    // Zero-size device buffers allocate nothing, so this runs with or without a GPU and proves
    // that lockstep::copy finds the host<->cuda overloads.
    buffer<float, host_system> h(3);
    buffer<float, cuda_system> d(0, cuda_system(0));
    try {
        lockstep::copy(h, d);
        FAIL("copy of 3 elements into 0 did not throw");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::shape_mismatch);
    }
    try {
        lockstep::copy(d, h);
        FAIL("copy of 0 elements into 3 did not throw");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::shape_mismatch);
    }
    buffer<float, cuda_system> d0(0, cuda_system(0));
    lockstep::copy(d, d0); // zero bytes: nothing to do, no device needed
}

TEST_CASE("CUDA failures become lockstep::error with code cuda", "[system][cuda]") {
    // An ordinal past the last device (or any device on a machine without one) fails in the
    // CUDA runtime; the checked wrapper must turn that into an exception, not a silent null.
    const cuda_system bad(lockstep::cuda_device_count() + 7);
    try {
        (void)bad.allocate(64);
        FAIL("allocation on a missing device did not throw");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::cuda);
        CHECK(std::string(e.what()).find("cuda") != std::string::npos);
    }
    (void)cudaGetLastError();
}

TEST_CASE("host <-> device round trip through buffers", "[system][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    lockstep::cuda_stream stream(0);
    const cuda_system sys = stream.system();
    for (std::size_t n : {std::size_t{1}, std::size_t{1009}, std::size_t{1} << 20}) {
        const auto values = ramp(n, 3.0f);
        const auto h = to_host_buffer(values);
        buffer<float, cuda_system> d(n, sys);
        lockstep::copy(h, d);
        buffer<float, host_system> back(n);
        lockstep::copy(d, back);
        for (std::size_t i = 0; i < n; ++i)
            REQUIRE(back[i] == values[i]);
    }
}

TEST_CASE("Thrust on the system's stream matches the host", "[system][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    lockstep::cuda_stream stream(0);
    const cuda_system sys = stream.system();
    const host_system host(2);
    const std::size_t n = 100003;
    const auto xs = ramp(n, 2.0f), ys = ramp(n, -1.5f);

    auto hx = to_host_buffer(xs), hy = to_host_buffer(ys);
    buffer<float, cuda_system> dx(n, sys), dy(n, sys);
    lockstep::copy(hx, dx);
    lockstep::copy(hy, dy);

    // Reduction in double: the device result vs a naive double loop.
    buffer<double, cuda_system> dd(n, sys);
    thrust::transform(sys.policy(), dx.data(), dx.data() + n, dd.data(), widen{});
    const double device_sum =
        thrust::reduce(sys.policy(), dd.data(), dd.data() + n, 0.0, thrust::plus<double>());
    double reference = 0.0;
    for (float v : xs)
        reference += v;
    CHECK(std::abs(device_sum - reference) <= 1e-12 * n * 3.0); // n * eps-ish bound, |x| <= 3

    // The same functor through both systems' policies: equal up to FMA contraction on the GPU.
    const axpy f{0.75f};
    thrust::transform(sys.policy(), dx.data(), dx.data() + n, dy.data(), dy.data(), f);
    thrust::transform(host.policy(), hx.data(), hx.data() + n, hy.data(), hy.data(), f);
    buffer<float, host_system> from_device(n);
    lockstep::copy(dy, from_device); // synchronises the stream
    for (std::size_t i = 0; i < n; ++i) {
        const double exact = 0.75 * static_cast<double>(xs[i]) + static_cast<double>(ys[i]);
        REQUIRE(std::abs(from_device[i] - hy[i]) <= 2e-7 * (std::abs(exact) + 1.0));
    }
}

TEST_CASE("device -> device copies across streams and devices", "[system][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const int devices = lockstep::cuda_device_count();
    lockstep::cuda_stream s0(0), s1(0), s_last(devices - 1);
    const std::size_t n = 4099;
    const auto values = ramp(n, 5.0f);
    const auto h = to_host_buffer(values);

    buffer<float, cuda_system> a(n, s0.system()), b(n, s1.system()), c(n, s_last.system());
    lockstep::copy(h, a);
    lockstep::copy(a, b); // same device, different streams
    lockstep::copy(b, c); // last device (peer copy when there are two or more)
    buffer<float, host_system> back(n);
    lockstep::copy(c, back);
    for (std::size_t i = 0; i < n; ++i)
        REQUIRE(back[i] == values[i]);

    // Integers keep every bit too.
    buffer<std::int64_t, host_system> hi(n);
    for (std::size_t i = 0; i < n; ++i)
        hi[i] = static_cast<std::int64_t>(i) * -1234567891011LL;
    buffer<std::int64_t, cuda_system> di(n, s_last.system());
    buffer<std::int64_t, host_system> hi_back(n);
    lockstep::copy(hi, di);
    lockstep::copy(di, hi_back);
    for (std::size_t i = 0; i < n; ++i)
        REQUIRE(hi_back[i] == hi[i]);
}

TEST_CASE("cuda_system synchronize and allocation on a default-stream system",
          "[system][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system sys(0); // legacy default stream
    void* p = sys.allocate(1 << 16);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(p, 0x5a, 1 << 16, sys.stream()));
    sys.synchronize();
    std::vector<unsigned char> h(1 << 16);
    LOCKSTEP_CUDA_CHECK(cudaMemcpy(h.data(), p, h.size(), cudaMemcpyDeviceToHost));
    for (unsigned char c : h)
        REQUIRE(c == 0x5a);
    sys.deallocate(p, 1 << 16);
    sys.synchronize();
}

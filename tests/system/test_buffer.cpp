// Tests of buffer<T, host_system>, copies and the host system's policy.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/system/buffer.hpp"

#include <catch2/catch.hpp>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/reduce.h>
#include <thrust/sequence.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#if LOCKSTEP_HAS_OPENMP
#include <omp.h>
#endif

using lockstep::buffer;
using lockstep::host_system;

TEST_CASE("host buffer allocates aligned memory and moves", "[system][host]") {
    buffer<float> a(1000);
    REQUIRE(a.size() == 1000);
    CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % host_system::alignment == 0);
    thrust::sequence(a.system().policy(), a.begin(), a.end(), 0.0f);
    CHECK(thrust::reduce(a.system().policy(), a.begin(), a.end(), 0.0) == 999.0 * 1000.0 / 2.0);
    buffer<float> b = std::move(a);
    CHECK(a.empty());           // NOLINT(bugprone-use-after-move): the moved-from state is checked
    CHECK(a.data() == nullptr); // NOLINT(bugprone-use-after-move)
    CHECK(b[999] == 999.0f);
    buffer<float> empty(0);
    CHECK(empty.data() == nullptr);
    CHECK(empty.span().empty());
}

TEST_CASE("copy between buffers checks sizes", "[system][host]") {
    buffer<int> a(5), b(5), c(4);
    for (int i = 0; i < 5; ++i)
        a[i] = i * i;
    lockstep::copy(a, b);
    for (int i = 0; i < 5; ++i)
        CHECK(b[i] == i * i);
    CHECK_THROWS_AS(lockstep::copy(a, c), lockstep::error);
}

TEST_CASE("host_system thread budget", "[system][host]") {
    CHECK(host_system(3).threads() == 3);
    CHECK(host_system().threads() >= 1);
    CHECK(host_system::default_threads(1000) == 1);
}

TEST_CASE("host passes below host_serial_below run on the calling thread, larger ones on the "
          "budget",
          "[system][host]") {
    using lockstep::kernels::host_serial_below;
    const host_system sys{2};
    CHECK(lockstep::kernels::threads_for(sys, host_serial_below - 1) == 1);
    CHECK(lockstep::kernels::threads_for(sys, host_serial_below) == 2);
    // The largest team that ran a pass of 256 indices through with_policy_for(sys, elements), and
    // what the pass wrote (every index once, whatever the team).
    const auto team = [&](std::size_t elements) {
        std::vector<int> threads(256, 0);
        std::vector<int> seen(256, 0);
        const int returned = lockstep::kernels::with_policy_for(sys, elements, [&](auto policy) {
            thrust::for_each(policy, thrust::counting_iterator<std::size_t>(0),
                             thrust::counting_iterator<std::size_t>(256), [&](std::size_t i) {
#if LOCKSTEP_HAS_OPENMP
                                 threads[i] = omp_get_num_threads();
#else
                                 threads[i] = 1;
#endif
                                 seen[i] += 1;
                             });
            return 7;
        });
        CHECK(returned == 7);
        CHECK(std::count(seen.begin(), seen.end(), 1) == 256);
        return *std::max_element(threads.begin(), threads.end());
    };
#if LOCKSTEP_HAS_OPENMP
    // A small pass leaves the calling thread's OpenMP budget alone (the user's own OpenMP code
    // inherits it): set it to 3, run one, read it back.
    omp_set_num_threads(3);
    CHECK(team(host_serial_below - 1) == 1);
    CHECK(omp_get_max_threads() == 3);
    // A large pass runs on the system's budget (sys.policy() sets it), where OpenMP may start a
    // second thread.
    if (omp_get_thread_limit() >= 2 && omp_get_dynamic() == 0) {
        CHECK(team(host_serial_below) == 2);
        CHECK(omp_get_max_threads() == 2);
    }
#endif
    CHECK(team(host_serial_below - 1) == 1);
    CHECK(team(0) == 1);
}

TEST_CASE("host_system's default budget follows OMP_NUM_THREADS, else the hardware threads",
          "[system][host]") {
    const char* old = std::getenv("OMP_NUM_THREADS");
    const std::string saved = old != nullptr ? old : "";
    const int hw = host_system::hardware_threads();
    const auto with = [](const char* value) {
        if (value != nullptr)
            setenv("OMP_NUM_THREADS", value, 1);
        else
            unsetenv("OMP_NUM_THREADS");
    };
    with(nullptr);
    CHECK(host_system::omp_env_threads() == 0);
    CHECK(host_system::default_threads(1) == hw);
    CHECK(host_system::process_threads(2) == std::max(1, hw / 2));
    with("6");
    CHECK(host_system::omp_env_threads() == 6);
    CHECK(host_system::default_threads(1) == 6);
    CHECK(host_system::default_threads(4) == 1); // 6 / 4
    CHECK(host_system::default_threads(8) == 1); // never 0
    CHECK(host_system::process_threads(3) == 6); // OpenMP's budget is per process
    CHECK(host_system().threads() == 6);
    with("4,2"); // nested levels: the first is the process's
    CHECK(host_system::default_threads(2) == 2);
    for (const char* bad : {"", "0", "-3", "x", "3x"}) {
        INFO("OMP_NUM_THREADS=\"" << bad << "\"");
        with(bad);
        CHECK(host_system::omp_env_threads() == 0);
        CHECK(host_system::default_threads(1) == hw);
    }
    with(old != nullptr ? saved.c_str() : nullptr);
}

TEST_CASE("buffer refuses element counts whose byte size overflows", "[system][host]") {
    // 2^62 + 1 floats: n * sizeof(float) wraps to 4 bytes without the check.
    const std::size_t n = (std::size_t(1) << 62) + 1;
    try {
        buffer<float> b(n);
        FAIL("allocated " << b.size_bytes() << " bytes for " << b.size() << " floats");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::invalid_argument);
        CHECK(std::string(e.what()).find("4611686018427387905") != std::string::npos);
    }
    // Fits in size_t, but beyond the largest object.
    CHECK_THROWS_AS(buffer<double>(std::size_t(1) << 61), lockstep::error);
    buffer<float> ok(3); // the check does not get in the way of normal sizes
    CHECK(ok.size_bytes() == 12);
}

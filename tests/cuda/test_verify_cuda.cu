// train_params::verify_every on the CUDA system: the one-pass digests equal the host's bit for
// bit, and the check waits only through the communicator's polled wait (a stream that never
// finishes ends in errc::timeout, not in a blocking reduction). The [gpu] cases are skipped
// where no GPU exists. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/detail/replica_consistency.hpp"

#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::host_system;
using lockstep::detail::consistency_section;

/// Holds the stream until *release is set or limit_ns have passed (a peer that never comes,
/// with a way out so the test ends either way).
__global__ void hold_stream(const volatile int* release, unsigned long long limit_ns) {
    unsigned long long start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        if (*release != 0)
            return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > limit_ns)
            return;
        __nanosleep(1000);
    }
}

template <class T>
std::vector<T> values(std::size_t n, unsigned seed) {
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i)
        v[i] = static_cast<T>((i * 2654435761u + seed) % 1000003u) / T(7);
    return v;
}

} // namespace

TEMPLATE_TEST_CASE("section_digests on the GPU equals the host's bit for bit",
                   "[train][verify][gpu]", float, double) {
    if (lockstep_test::skip_without_gpu())
        return;
    using T = TestType;
    const cuda_system sys(0);
    const std::vector<std::size_t> sizes = {0, 1, 4097, 0, 3 * 2048 + 5, 64, 0};
    std::vector<std::vector<T>> host;
    std::vector<buffer<T, cuda_system>> dev;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
        host.push_back(values<T>(sizes[k], static_cast<unsigned>(k)));
        dev.emplace_back(sizes[k], sys);
        lockstep::copy(std::span<const T>(host[k]), host_system{1}, dev[k].span(), sys);
    }
    std::vector<consistency_section<T>> on_host, on_device;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
        on_host.push_back({"t", std::span<const T>(host[k])});
        on_device.push_back({"t", std::span<const T>(dev[k].data(), dev[k].size())});
    }
    lockstep::detail::section_digests<host_system, T> h(host_system{1}, on_host);
    h.enqueue();
    lockstep::detail::section_digests<cuda_system, T> d(sys, on_device);
    d.enqueue();
    std::vector<std::int64_t> got(sizes.size());
    lockstep::copy(d.digests(), sys, std::span<std::int64_t>(got), host_system{1});
    for (std::size_t k = 0; k < sizes.size(); ++k) {
        CAPTURE(k, sizes[k]);
        CHECK(got[k] == h.digests()[k]);
    }
}

TEST_CASE("verify_replicas on the GPU waits only through the communicator's polled wait",
          "[train][verify][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const std::vector<int> devices = {0};
    auto comms = lockstep::nccl_communicator::init_all(
        devices, lockstep::nccl_options{.timeout = std::chrono::milliseconds(500)});
    auto& comm = comms[0];
    const cuda_system sys = comm.system();
    std::vector<buffer<float, cuda_system>> tensors;
    std::vector<consistency_section<float>> sections;
    for (std::size_t k = 0; k < 40; ++k) {
        tensors.emplace_back(100 + k, sys);
        const std::vector<float> v = values<float>(100 + k, static_cast<unsigned>(k));
        lockstep::copy(std::span<const float>(v), host_system{1}, tensors.back().span(), sys);
    }
    for (auto& t : tensors)
        sections.push_back({"t", std::span<const float>(t.data(), t.size())});

    // Healthy: one rank agrees with itself.
    CHECK_NOTHROW(lockstep::detail::verify_replicas(comm, sys, 1, sections));

    // The stream held (as by a collective whose peer never comes) until a watchdog releases it
    // after 2.5 s, as the abort that follows a timeout ends a stuck NCCL kernel. The check must
    // end with the communicator's 500 ms timeout: a blocking reduction before the polled wait
    // would instead wait for the release and then succeed. The pinned memory the throw frees
    // (cudaFreeHost waits for the device) is freed once the hold has ended, within the 6 s.
    int* release = nullptr;
    REQUIRE(cudaHostAlloc(&release, sizeof(int), cudaHostAllocMapped) == cudaSuccess);
    *release = 0;
    hold_stream<<<1, 1, 0, sys.stream()>>>(release, 8'000'000'000ull);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    std::thread watchdog([release] {
        std::this_thread::sleep_for(std::chrono::milliseconds(2500));
        *static_cast<volatile int*>(release) = 1;
    });
    const auto start = std::chrono::steady_clock::now();
    lockstep::errc code = lockstep::errc::internal;
    bool threw = false;
    try {
        lockstep::detail::verify_replicas(comm, sys, 2, sections);
    } catch (const lockstep::error& e) {
        threw = true;
        code = e.code();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    watchdog.join();
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(threw);
    CHECK(code == lockstep::errc::timeout);
    CHECK(waited < std::chrono::seconds(6));
    tensors.clear();
    CHECK(cudaFreeHost(release) == cudaSuccess);
}

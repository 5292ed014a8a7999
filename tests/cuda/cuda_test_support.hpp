// Shared helpers of the CUDA tests: skip GPU tests cleanly where no device exists, and run one
// replica per GPU through lockstep::gpu_group. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <exception>
#include <numeric>
#include <thread>
#include <vector>

namespace lockstep_test {

/// The exit code CTest reads as "skipped" (SKIP_RETURN_CODE in tests/cuda/CMakeLists.txt): a
/// CUDA test executable returns it where no CUDA device exists, after running the cases that
/// need none.
inline constexpr int skip_return_code = 77;

/// True (after a Catch2 warning "no CUDA device: skipped") when no CUDA device is usable, so a
/// GPU test case can `if (skip_without_gpu()) return;`. The CUDA build is compiled in CI on
/// machines without a GPU; there the executable as a whole is reported as skipped.
inline bool skip_without_gpu() {
    if (lockstep::cuda_device_count() > 0)
        return false;
    WARN("no CUDA device: skipped");
    return true;
}

#ifdef CATCH_CONFIG_RUNNER // Catch::Session exists only where the test main is defined
/// The main of a CUDA test executable: runs every Catch2 case; where no CUDA device exists it
/// runs only the cases not tagged [gpu] (unless a test spec was given) and then returns
/// skip_return_code instead of 0, so CTest reports the executable as skipped, not passed.
inline int run_cuda_session(int argc, char** argv) {
    Catch::Session session;
    if (const int rc = session.applyCommandLine(argc, argv); rc != 0)
        return rc;
    const bool has_gpu = lockstep::cuda_device_count() > 0;
    if (!has_gpu && session.configData().testsOrTags.empty())
        session.configData().testsOrTags.emplace_back("~[gpu]");
    const int failed = session.run();
    if (failed != 0 || has_gpu)
        return failed;
    std::printf("no CUDA device: the GPU cases were not run (exit %d: skipped)\n",
                skip_return_code);
    return skip_return_code;
}
#endif

#if LOCKSTEP_HAS_NCCL
/// One NCCL communicator per visible device (ncclCommInitAll).
inline std::vector<lockstep::nccl_communicator> all_devices() {
    std::vector<int> devices(static_cast<std::size_t>(lockstep::cuda_device_count()));
    std::iota(devices.begin(), devices.end(), 0);
    return lockstep::nccl_communicator::init_all(devices);
}

/// Runs f(comm) for every communicator on its own thread; a replica that throws aborts its
/// communicator (so its peers get errc::peer_failure instead of waiting); rethrows the root
/// cause after all threads ended. Catch2 assertions are not thread-safe: f records, the main
/// thread checks. New tests use lockstep::gpu_group, which also creates the communicators.
template <class F>
void run_replicas(std::vector<lockstep::nccl_communicator>& comms, F f) {
    std::vector<std::exception_ptr> errors(comms.size());
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < comms.size(); ++r)
        threads.emplace_back([&, r] {
            try {
                f(comms[r]);
            } catch (...) {
                errors[r] = std::current_exception();
                comms[r].abort();
            }
        });
    for (auto& t : threads)
        t.join();
    for (auto& e : errors)
        if (e)
            std::rethrow_exception(e);
}
#endif

} // namespace lockstep_test

// Shared helpers of the CUDA tests: skip GPU tests cleanly where no device exists or, for the
// [multi_gpu] cases, where fewer than two do, and run one replica per GPU through
// lockstep::gpu_group. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "cuda_test_main.hpp"

#include <catch2/catch.hpp>

#include <exception>
#include <numeric>
#include <thread>
#include <vector>

namespace lockstep_test {

/// True (after a Catch2 warning "no CUDA device: skipped") when no CUDA device is usable, so a
/// GPU test case can `if (skip_without_gpu()) return;`. The CUDA build is compiled in CI on
/// machines without a GPU; there the executable as a whole is reported as skipped.
inline bool skip_without_gpu() {
    if (lockstep::cuda_device_count() > 0)
        return false;
    WARN("no CUDA device: skipped");
    return true;
}

/// For a case tagged [multi_gpu], whose claim needs several replicas, one per GPU: false where
/// multi_gpu_devices or more devices are usable; else true, after a Catch2 warning and with the
/// case's name added to multi_gpu_not_run(), so the case can
/// `if (skip_without_multi_gpu()) return;` and the main reports it as not run (the executable
/// skipped, never passed). The main leaves [multi_gpu] out by itself; this catches a test spec
/// that names such a case on a machine with one GPU.
inline bool skip_without_multi_gpu() {
    const int devices = lockstep::cuda_device_count();
    if (devices >= multi_gpu_devices)
        return false;
    WARN(devices << " CUDA device(s): this case needs " << multi_gpu_devices << "; not run");
    multi_gpu_not_run().push_back(Catch::getResultCapture().getCurrentTestName());
    return true;
}

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

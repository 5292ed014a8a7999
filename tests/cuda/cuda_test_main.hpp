// What the mains of the CUDA tests (cuda_test_main.cpp, cuda_mpi_test_main.cpp) share with the
// tests: the skip exit code, the device count without nvcc and the [multi_gpu] cases not run.
// The mains are compiled by the host compiler, so this header includes only CUDA's runtime API,
// no nvcc-only header. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace lockstep_test {

/// The exit code CTest reads as "skipped" (SKIP_RETURN_CODE in tests/cuda/CMakeLists.txt): a
/// CUDA test executable returns it where no CUDA device exists, after running the cases that
/// need none.
inline constexpr int skip_return_code = 77;

/// The number of usable CUDA devices, as lockstep::cuda_device_count() counts them (that header
/// declares nothing outside nvcc): 0 when there is no device or no usable driver, the error
/// read so it does not surface in a later check.
inline int device_count() noexcept {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

/// The devices a case tagged [multi_gpu] needs: its claim is about several replicas, one per GPU
/// (gpu_group, all_devices()), and a single replica would pass it with the claim unchecked.
/// With fewer, cuda_test_main.cpp leaves such cases out and reports the executable as skipped.
inline constexpr int multi_gpu_devices = 2;

/// The [multi_gpu] cases that started with fewer than multi_gpu_devices devices and returned at
/// once (lockstep_test::skip_without_multi_gpu, cuda_test_support.hpp: a test spec named them),
/// by name, for the main to report. Main thread only.
inline std::vector<std::string>& multi_gpu_not_run() {
    static std::vector<std::string> names;
    return names;
}

} // namespace lockstep_test

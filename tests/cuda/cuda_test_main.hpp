// What the mains of the CUDA tests (cuda_test_main.cpp, cuda_mpi_test_main.cpp) share with the
// tests: the skip exit code, and the device count without nvcc. The mains are compiled by the
// host compiler, so this header includes only CUDA's runtime API, no nvcc-only header.
// SPDX-License-Identifier: Apache-2.0
#pragma once

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

} // namespace lockstep_test

// Shared helpers of the CUDA tests: skip a GPU test cleanly where no device exists.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/system/cuda_system.hpp"

#include <catch2/catch.hpp>

namespace lockstep_test {

/// True (after a Catch2 warning "no CUDA device: skipped") when no CUDA device is usable, so a
/// GPU test case can `if (skip_without_gpu()) return;` and pass with the message: the CUDA
/// build is compiled in CI on machines without a GPU and runs where one exists.
inline bool skip_without_gpu() {
    if (lockstep::cuda_device_count() > 0)
        return false;
    WARN("no CUDA device: skipped");
    return true;
}

} // namespace lockstep_test

// device_delay: keeps a stream busy for a fixed wall-clock time on the device, the slow GPU of
// the straggler tests (train_params::report_stragglers_every over NCCL).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <chrono>

#include <cuda_runtime_api.h>

namespace lockstep_test {

/// One thread that returns once the device's global timer (ns) has advanced by `ns` since it
/// started, sleeping between reads. A template, so that every test that includes it may.
template <int = 0>
__global__ void device_delay_kernel(unsigned long long ns) {
    unsigned long long start = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        unsigned long long now = 0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= ns)
            return;
        __nanosleep(1000);
    }
}

/// Enqueues device_delay_kernel for `delay` on `stream`: the stream reaches its next work that
/// much later, whatever the host does meanwhile.
inline void device_delay(cudaStream_t stream, std::chrono::nanoseconds delay) {
    device_delay_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(delay.count()));
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

} // namespace lockstep_test

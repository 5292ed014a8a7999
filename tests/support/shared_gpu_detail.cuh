// tests/support/shared_gpu_detail.cuh: the pieces of shared_gpu_communicator: the rank-order
// fold kernel, the call descriptor every collective gathers, the run-wide events. Test support.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace lockstep::testing {

namespace shared_gpu_detail {

inline constexpr int max_replicas = 16;

/// The peers' send pointers, by value in the kernel's parameters (no device table to fill).
template <class T>
struct source_table {
    const T* at[max_replicas];
};

/// dst[i] = op(...op(op(s[0][i], s[1][i]), s[2][i])..., s[n-1][i]):
/// lockstep::detail::shm::reduce_block's rank order with its functors, so the bits equal the host
/// thread group's.
template <class T, class Op>
__global__ void fold_kernel(source_table<T> s, int n, T* dst, std::size_t count) {
    const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
         i += stride) {
        T acc = s.at[0][i];
        for (int j = 1; j < n; ++j)
            acc = Op{}(acc, s.at[j][i]);
        dst[i] = acc;
    }
}

/// What one replica passed to one collective (gathered at rendezvous 1).
struct call_desc {
    int kind = 0; ///< index into kind_names
    int op = 0;
    int root = 0;
    int replica = 0; ///< global replica index: selects the run-wide events
    std::size_t elem_size = 0;
    std::size_t count = 0;      ///< send elements (broadcast: data elements)
    std::size_t recv_count = 0; ///< receive elements
    std::uint64_t counts_hash = 0;
    const void* send = nullptr;
    void* recv = nullptr;
};

enum kind : int { barrier, all_reduce, broadcast, all_gather, reduce, reduce_scatter, all_to_all };
inline constexpr const char* kind_names[] = {"barrier", "all_reduce",     "broadcast", "all_gather",
                                             "reduce",  "reduce_scatter", "all_to_all"};

/// What every replica of one run shares: the device, the timeout, one ready and one done event
/// per replica (by global index), and the thread group (for abort).
struct run_state {
    int device;
    std::chrono::milliseconds timeout;
    thread_group* group;
    std::vector<cuda_event> ready, done;
    run_state(int d, std::chrono::milliseconds t, thread_group* g, int n)
        : device(d), timeout(t), group(g) {
        for (int i = 0; i < n; ++i) {
            ready.emplace_back(d);
            done.emplace_back(d);
        }
    }
};

} // namespace shared_gpu_detail

} // namespace lockstep::testing

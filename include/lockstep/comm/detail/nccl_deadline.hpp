// lockstep/comm/detail/nccl_deadline.hpp: an NCCL call that makes a communicator
// (ncclCommInitRank, ncclCommSplit: each returns only once every rank that takes
// part has made it) run against a deadline. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/system/cuda_system.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <utility>

#include <nccl.h>

namespace lockstep::detail {

/// What nccl_make_within's call did: returned in time, with its result and communicator (then
/// the caller's), or not.
struct nccl_made {
    bool in_time = false;
    ncclResult_t result = ncclSuccess;
    ncclComm_t comm = nullptr;
};

/// Runs `make(&comm)` on a helper thread with `device` current, while this one waits at most
/// `timeout` (zero: no limit). Past the deadline the helper is detached with what it owns (`make`
/// is moved into it: it must hold its arguments by value) and the caller gets in_time = false;
/// should the call return after all, the helper aborts the communicator it made, which nobody
/// will use. What `make` reads (a parent communicator) must then outlive the helper: the caller
/// leaves it alive.
template <class Make>
nccl_made nccl_make_within(int device, std::chrono::milliseconds timeout, Make make) {
    enum : int { running, returned, abandoned };
    struct attempt {
        explicit attempt(Make m) : make(std::move(m)) {}
        Make make;
        nccl_made made;
        std::atomic<int> state{running};
    };
    auto a = std::make_shared<attempt>(std::move(make));
    std::thread maker([a, device] {
        cuda_device_guard_noexcept guard(device);
        ncclComm_t comm = nullptr;
        const ncclResult_t result = a->make(&comm);
        a->made = {true, result, comm};
        int expected = running;
        if (!a->state.compare_exchange_strong(expected, returned, std::memory_order_acq_rel) &&
            comm != nullptr)
            (void)ncclCommAbort(comm);
    });
    const auto deadline = deadline_after(timeout); // max() waits max_wait
    while (a->state.load(std::memory_order_acquire) == running &&
           (timeout.count() <= 0 || std::chrono::steady_clock::now() < deadline))
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    int expected = running;
    if (a->state.compare_exchange_strong(expected, abandoned, std::memory_order_acq_rel)) {
        maker.detach();
        return {};
    }
    maker.join();
    return a->made;
}

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

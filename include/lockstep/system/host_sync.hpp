// lockstep/system/host_sync.hpp: the count of host synchronisations lockstep makes, so that a
// test on the host can hold the line the GPU path relies on. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

namespace lockstep {

namespace detail {
/// The calling thread's counter (each replica runs on its own thread).
inline std::uint64_t& host_sync_counter() noexcept {
    thread_local std::uint64_t n = 0;
    return n;
}
/// Records one host synchronisation on the calling thread.
inline void count_host_sync() noexcept {
    ++host_sync_counter();
}
} // namespace detail

/// The number of times lockstep code running on the calling thread made the host wait for a
/// system's queued work: a system's synchronize(), a copy() that involves device memory, and
/// every read of a result produced by a kernel (a staged_read waited for). The host system counts
/// the same points although it never waits, so host tests check the number of synchronisations
/// the CUDA system would make on the same path.
inline std::uint64_t host_sync_count() noexcept {
    return detail::host_sync_counter();
}

} // namespace lockstep

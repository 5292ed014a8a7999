// lockstep/comm/host_wait.hpp: wait_for, the one way lockstep's host code waits for a result of
// a replica's queued work: through the communicator, so a failed or missing peer ends the wait
// with an error instead of a hang. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/system/system.hpp"

#include <span>

namespace lockstep {

/// Waits until `read` (enqueued on comm.system()) is complete and returns its values. Counts one
/// host synchronisation (host_sync_count()) on every system. On the CUDA system the wait polls:
/// a communicator with `wait(cudaEvent_t, const char*)` (nccl_communicator) checks NCCL's
/// asynchronous errors, its peers' failures and its timeout while it waits, and aborts and
/// throws lockstep::error on any of them; on the host system the values are already there.
/// While the read's stream is being captured into a CUDA graph the work it waits for has not
/// run (it runs when the graph is launched): the wait is refused with lockstep::error
/// (errc::invalid_argument) naming `what`, before anything is queried, and nothing is counted.
/// requires: read was enqueued since the last wait_for.
template <communicator Comm, class T, class System>
std::span<const T> wait_for(Comm& comm, const staged_read<T, System>& read, const char* what) {
    if constexpr (staged_read<T, System>::needs_wait) {
        LOCKSTEP_REQUIRE(!detail::capturing(read.system()), errc::invalid_argument, comm.rank(),
                         what,
                         "the stream is being captured into a CUDA graph: the host cannot wait "
                         "for work that runs only when the graph is launched (wait after a "
                         "launch)");
    }
    detail::count_host_sync();
    if constexpr (staged_read<T, System>::needs_wait) {
#if LOCKSTEP_HAS_CUDA
        if constexpr (requires { comm.wait(read.event(), what); }) {
            comm.wait(read.event(), what);
        } else {
            cuda_device_guard guard(read.system().device());
            LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(read.event()));
        }
#endif
    }
    (void)comm;
    (void)what;
    return read.values();
}

} // namespace lockstep

// lockstep/train/detail/host_collective.hpp: collectives on host memory for any communicator,
// staged through the communicator's memory when that is not the host (nccl_communicator).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/tag_forwarding.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/system/system.hpp"

#include <algorithm>
#include <span>

namespace lockstep::detail {

/// Copies host values into a new buffer in sys's memory (any system: lockstep::copy, which
/// returns once the bytes have arrived).
template <class T, execution_system System>
struct staged_upload {
    buffer<T, System> device;
    staged_upload(std::span<const T> src, const System& sys) : device(src.size(), sys) {
        lockstep::copy(src, host_system{1}, device.span(), sys);
    }
};

#if LOCKSTEP_HAS_CUDA
/// On CUDA without a blocking wait: through pinned memory and an asynchronous copy on the
/// system's stream (the pinned source stays alive until the staged_upload is destroyed, which
/// the caller does only after waiting for later work on the stream).
template <class T>
struct staged_upload<T, cuda_system> {
    buffer<T, cuda_system> device;
    pinned_array<T> pinned;
    staged_upload(std::span<const T> src, const cuda_system& sys)
        : device(src.size(), sys), pinned(src.size()) {
        std::copy(src.begin(), src.end(), pinned.data());
        if (!src.empty()) {
            cuda_device_guard guard(sys.device());
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(device.data(), pinned.data(), src.size_bytes(),
                                                cudaMemcpyHostToDevice, sys.stream()));
        }
    }
};
#endif

/// all_reduce of host arrays. On a host communicator it is comm.all_reduce itself (no copy);
/// otherwise send goes through pinned memory into a buffer in the communicator's memory, is
/// reduced there in place, and comes back through pinned memory; the one wait polls through the
/// communicator (wait_for), so a failed peer is an error, not a hang. Every allocation (the
/// pinned staging of both directions, the device buffer) happens BEFORE the collective is
/// enqueued: cudaMallocHost takes the driver's lock, and between an NCCL enqueue and its wait
/// that can deadlock with another thread's NCCL operation that holds the lock while it waits
/// for this replica's part of a collective.
/// requires: send.size() == recv.size(). Collective.
template <class Communicator, class T>
void host_all_reduce(Communicator& comm, std::span<const T> send, std::span<T> recv, reduce_op op) {
    using system_type = typename Communicator::system_type;
    // Not a dispatch on the system type: a communicator whose memory the host reads reduces
    // the host arrays themselves.
    if constexpr (system_type::is_host) {
        comm.all_reduce(send, recv, op);
    } else {
        staged_upload<T, system_type> staged(send, comm.system());
        staged_read<T, system_type> back(recv.size() == 0 ? 1 : recv.size(), comm.system());
        comm.all_reduce(std::span<const T>(staged.device.span()), staged.device.span(), op);
        back.enqueue(std::span<const T>(staged.device.span()));
        const std::span<const T> v = wait_for(comm, back, "host_all_reduce");
        std::copy(v.begin(), v.end(), recv.begin());
    }
}

/// all_gather of host arrays (recv holds comm.size() blocks of send.size()), staged like
/// host_all_reduce when the communicator's memory is not the host (every allocation before the
/// collective is enqueued, as there). Collective. `tag`: the call's identity (collective_tag);
/// by default one site, here, for every caller.
template <class Communicator, class T>
void host_all_gather(Communicator& comm, std::span<const T> send, std::span<T> recv,
                     const collective_tag& tag = collective_tag(call_site{__FILE__, __LINE__})) {
    using system_type = typename Communicator::system_type;
    if constexpr (system_type::is_host) {
        with_tag(comm, tag).all_gather(send, recv);
    } else {
        staged_upload<T, system_type> mine(send, comm.system());
        buffer<T, system_type> all(recv.size(), comm.system());
        staged_read<T, system_type> back(recv.size() == 0 ? 1 : recv.size(), comm.system());
        with_tag(comm, tag).all_gather(std::span<const T>(mine.device.span()), all.span());
        back.enqueue(std::span<const T>(all.span()));
        const std::span<const T> v = wait_for(comm, back, "host_all_gather");
        std::copy(v.begin(), v.end(), recv.begin());
    }
}

} // namespace lockstep::detail

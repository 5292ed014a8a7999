// lockstep/train/detail/host_collective.hpp: collectives on host memory for any communicator,
// staged through the communicator's memory when that is not the host (nccl_communicator).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"

#include <span>

namespace lockstep::detail {

/// all_reduce of host arrays. On a host communicator it is comm.all_reduce itself (no copy);
/// otherwise send is copied into a buffer in the communicator's memory, reduced there in place,
/// and copied back into recv. requires: send.size() == recv.size(). Collective.
template <class Communicator, class T>
void host_all_reduce(Communicator& comm, std::span<const T> send, std::span<T> recv, reduce_op op) {
    using system_type = typename Communicator::system_type;
    if constexpr (system_type::is_host) {
        comm.all_reduce(send, recv, op);
    } else {
        buffer<T, system_type> staged(send.size(), comm.system());
        copy(send, host_system{}, staged.span(), comm.system());
        comm.all_reduce(std::span<const T>(staged.span()), staged.span(), op);
        copy(std::span<const T>(staged.span()), comm.system(), recv, host_system{});
    }
}

/// all_gather of host arrays (recv holds comm.size() blocks of send.size()), staged like
/// host_all_reduce when the communicator's memory is not the host. Collective.
template <class Communicator, class T>
void host_all_gather(Communicator& comm, std::span<const T> send, std::span<T> recv) {
    using system_type = typename Communicator::system_type;
    if constexpr (system_type::is_host) {
        comm.all_gather(send, recv);
    } else {
        buffer<T, system_type> mine(send.size(), comm.system());
        buffer<T, system_type> all(recv.size(), comm.system());
        copy(send, host_system{}, mine.span(), comm.system());
        comm.all_gather(std::span<const T>(mine.span()), all.span());
        copy(std::span<const T>(all.span()), comm.system(), recv, host_system{});
    }
}

} // namespace lockstep::detail

// A communicator with collectives only (no point-to-point), as NCCL is for lockstep's purposes:
// the compile-fail cases use it where an NCCL build is not available.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <span>

struct collective_only_communicator {
    using system_type = lockstep::host_system;
    system_type system() const { return system_type(1); }
    int rank() const { return 0; }
    int size() const { return 1; }
    template <class T>
    void all_reduce(std::span<const T>, std::span<T>, lockstep::reduce_op) {}
    template <class T>
    void broadcast(std::span<T>, int) {}
    template <class T>
    void all_gather(std::span<const T>, std::span<T>) {}
    template <class T>
    void reduce(std::span<const T>, std::span<T>, lockstep::reduce_op, int) {}
    template <class T>
    void reduce_scatter(std::span<const T>, std::span<T>, std::span<const std::size_t>,
                        lockstep::reduce_op) {}
    template <class T>
    void reduce_scatter(std::span<const T>, std::span<T>, lockstep::reduce_op) {}
    void barrier() {}
    collective_only_communicator split(int, int) { return {}; }
};
static_assert(lockstep::communicator<collective_only_communicator>);
static_assert(!lockstep::point_to_point_communicator<collective_only_communicator>);

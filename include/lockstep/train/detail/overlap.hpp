// lockstep/train/detail/overlap.hpp: whether a trainer reduces gradient buckets on a
// communication stream (train_params::overlap), decided once and agreed by every replica.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/train/detail/gradient_collective.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/train_params.hpp"

#include <span>
#include <type_traits>

#if LOCKSTEP_HAS_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#include <mpi.h>
#endif

namespace lockstep::detail {

/// Buckets go on a comm_stream with overlap_mode::always wherever the backend allows it (MPI
/// needs MPI_THREAD_MULTIPLE: the communication thread calls MPI while the compute thread may
/// too), with automatic where it also pays (the collectives do not run on the compute cores:
/// communicator_traits, MPI spanning nodes), never with never. On single-node MPI (a forced
/// always) the communication thread runs at comm_priority::background: MPI moves data only
/// inside MPI calls, so its waits poll, and a polling thread at the compute's priority takes
/// the compute's core. Everywhere else it keeps normal priority (on the thread group, whose
/// waits spin only microseconds before they sleep, a lower priority only delayed the
/// rendezvous of the reduction: measured, docs/overlap.md). Collective: the replicas agree on
/// the least of their answers, so all of them build a stream or none does, all at the same
/// priority.
template <communicator Comm>
overlap_setting use_overlap(Comm& comm, overlap_mode mode) {
    if (mode == overlap_mode::never)
        return {};
    bool possible = true;
    bool pays = !communicator_traits<Comm>::collectives_use_compute_cores;
    bool background = false;
#if LOCKSTEP_HAS_MPI
    if constexpr (std::is_same_v<Comm, mpi_communicator>) {
        int level = MPI_THREAD_SINGLE;
        LOCKSTEP_MPI_CHECK(MPI_Query_thread(&level));
        possible = level == MPI_THREAD_MULTIPLE;
        pays = comm.spans_nodes();
        background = !pays;
    }
#endif
    int mine[2] = {(mode == overlap_mode::always ? possible : possible && pays) ? 1 : 0,
                   background ? 0 : 1};
    host_all_reduce(comm, std::span<const int>(mine), std::span<int>(mine), reduce_op::min);
    return {.enabled = mine[0] != 0,
            .priority = mine[1] != 0 ? comm_priority::normal : comm_priority::background};
}

} // namespace lockstep::detail

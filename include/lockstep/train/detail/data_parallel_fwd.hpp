// lockstep/train/detail/data_parallel_fwd.hpp: the declaration of data_parallel with its default
// policies, shared by the synchronous trainer and the asynchronous specialisations.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"

namespace lockstep {

/// The trainer; see lockstep/train/data_parallel.hpp.
template <class Network, class Optimizer, sync_policy SyncPolicy = sync::synchronous,
          reduce_policy ReducePolicy = reduce::bucketed<>,
          communicator Communicator = thread_communicator>
class data_parallel;

} // namespace lockstep

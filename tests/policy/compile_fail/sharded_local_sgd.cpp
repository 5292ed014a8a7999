// Must not compile: the sharded optimizer state with local SGD (no gradient reduction to shard).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(
    lockstep::check_compatible<lockstep::sync::local_sgd<2>, lockstep::reduce::sharded<1024>,
                               lockstep::thread_communicator>());
int main() {}

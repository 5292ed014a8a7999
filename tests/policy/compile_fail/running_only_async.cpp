// Must not compile: a BN policy with forward collectives under asynchronous workers.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(lockstep::check_compatible<lockstep::sync::asynchronous, lockstep::reduce::per_tensor,
                                         lockstep::thread_communicator,
                                         std::tuple<lockstep::bn::running_only>>());
int main() {}

// Must not compile: the sharded optimizer state with the asynchronous parameter server.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(lockstep::check_compatible<lockstep::sync::asynchronous, lockstep::reduce::sharded<>,
                                         lockstep::thread_communicator>());
int main() {}

// Must not compile: reduce::reproducible with the asynchronous parameter server.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(
    lockstep::check_compatible<lockstep::sync::asynchronous, lockstep::reduce::reproducible<8>,
                               lockstep::thread_communicator>());
int main() {}

// Must not compile: reduce::parameter_server with sync::asynchronous. SPDX-License-Identifier:
// Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(
    lockstep::check_compatible<lockstep::sync::asynchronous, lockstep::reduce::parameter_server<0>,
                               lockstep::thread_communicator>());
int main() {}

// Must not compile: local SGD averaging weights through a 16-bit wire. SPDX-License-Identifier:
// Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(lockstep::check_compatible<lockstep::sync::local_sgd<2>,
                                         lockstep::reduce::compressed<lockstep::bfloat16>,
                                         lockstep::thread_communicator>());
int main() {}

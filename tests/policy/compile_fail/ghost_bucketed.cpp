// Must not compile: bn::ghost without reduce::reproducible. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(lockstep::check_compatible<lockstep::sync::synchronous, lockstep::reduce::bucketed<>,
                                         lockstep::thread_communicator,
                                         std::tuple<lockstep::bn::ghost<8>>>());
int main() {}

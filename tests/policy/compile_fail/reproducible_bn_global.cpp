// Must not compile: reduce::reproducible with bn::global. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(
    lockstep::check_compatible<lockstep::sync::synchronous, lockstep::reduce::reproducible<8>,
                               lockstep::thread_communicator, std::tuple<lockstep::bn::global>>());
int main() {}

// Must not compile: exact global BN statistics with local SGD. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(
    lockstep::check_compatible<lockstep::sync::local_sgd<4>, lockstep::reduce::bucketed<>,
                               lockstep::thread_communicator, std::tuple<lockstep::bn::global>>());
int main() {}

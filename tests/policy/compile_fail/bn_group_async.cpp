// Must not compile: group BN statistics with asynchronous workers. SPDX-License-Identifier:
// Apache-2.0
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(
    lockstep::check_compatible<lockstep::sync::bounded_staleness<2>, lockstep::reduce::per_tensor,
                               lockstep::thread_communicator,
                               std::tuple<lockstep::bn::local, lockstep::bn::group<2>>>());
int main() {}

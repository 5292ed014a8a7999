// Must not compile: the asynchronous server over a communicator without point-to-point (NCCL).
// SPDX-License-Identifier: Apache-2.0
#include "fake_collective_communicator.hpp"
#include "lockstep/policy/compat.hpp"
static_assert(lockstep::check_compatible<lockstep::sync::asynchronous, lockstep::reduce::per_tensor,
                                         collective_only_communicator>());
int main() {}

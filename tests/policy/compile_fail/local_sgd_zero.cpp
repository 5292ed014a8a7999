// Must not compile: local SGD that never averages. SPDX-License-Identifier: Apache-2.0
#include "lockstep/policy/sync.hpp"
lockstep::sync::local_sgd<0> never;
int main() {}

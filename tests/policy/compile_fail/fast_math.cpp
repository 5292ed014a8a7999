// Must not compile: lockstep under -ffast-math without LOCKSTEP_ALLOW_FAST_MATH (the CMake case
// adds the flag). SPDX-License-Identifier: Apache-2.0
#include "lockstep/core/config.hpp"
int main() {}

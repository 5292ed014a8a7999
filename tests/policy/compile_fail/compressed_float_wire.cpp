// Must not compile: a wire type that is not 16-bit. SPDX-License-Identifier: Apache-2.0
#include "lockstep/policy/reduce.hpp"
lockstep::reduce::compressed<float> wire;
int main() {}

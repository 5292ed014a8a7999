// Runs once the generated one-header translation units have compiled (tests/headers).
// SPDX-License-Identifier: Apache-2.0
#include <cstdio>

int main() {
    std::printf("%d public lockstep headers compiled on their own: %s\n", LOCKSTEP_HEADERS_CHECKED,
                LOCKSTEP_HEADER_NAMES);
    return LOCKSTEP_HEADERS_CHECKED > 0 ? 0 : 1;
}

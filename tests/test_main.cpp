// The main of every test executable without MPI: the Catch2 session (Catch2's implementation is
// in tests/catch2_session.cpp). SPDX-License-Identifier: Apache-2.0
#include "support/catch2_session.hpp"

int main(int argc, char** argv) {
    return lockstep::testing::run_catch2(argc, argv);
}

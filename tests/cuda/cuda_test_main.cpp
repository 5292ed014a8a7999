// The main of the CUDA test executables, compiled by the host compiler (Catch2's implementation is
// in tests/catch2_session.cpp): runs every Catch2 case; where no CUDA device exists it runs only
// the cases not tagged [gpu] (unless a test spec was given) and then returns skip_return_code
// instead of 0, so CTest reports the executable as skipped, not passed.
// SPDX-License-Identifier: Apache-2.0
#include "cuda_test_main.hpp"
#include "support/catch2_session.hpp"

#include <cstdio>

int main(int argc, char** argv) {
    using lockstep_test::skip_return_code;
    const bool has_gpu = lockstep_test::device_count() > 0;
    const int failed = lockstep::testing::run_catch2(argc, argv, has_gpu ? nullptr : "~[gpu]");
    if (failed != 0 || has_gpu)
        return failed;
    std::printf("no CUDA device: the GPU cases were not run (exit %d: skipped)\n",
                skip_return_code);
    return skip_return_code;
}

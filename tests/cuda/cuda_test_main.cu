// The Catch2 main of the CUDA test executables: reports them as skipped (exit 77) where no CUDA
// device exists, after running the cases that need none. SPDX-License-Identifier: Apache-2.0
#define CATCH_CONFIG_RUNNER
#include "cuda_test_support.hpp"

int main(int argc, char** argv) {
    return lockstep_test::run_cuda_session(argc, argv);
}

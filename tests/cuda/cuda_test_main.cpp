// The main of the CUDA test executables, compiled by the host compiler (Catch2's implementation is
// in tests/catch2_session.cpp): runs every Catch2 case; where no CUDA device exists it runs only
// the cases not tagged [gpu] (unless a test spec was given) and then returns skip_return_code
// instead of 0, so CTest reports the executable as skipped, not passed. With one device a run
// without a test spec leaves out the cases tagged [multi_gpu]; a case tagged [multi_gpu] that a
// test spec selects returns at once (skip_without_multi_gpu). Either way the cases not run are
// named, and a run that passed returns skip_return_code: its last line says how many were not
// run and why. CTest runs an executable with [multi_gpu] cases as two tests (tests/cuda/
// CMakeLists.txt): the other cases, and the [multi_gpu] ones. SPDX-License-Identifier: Apache-2.0
#include "cuda_test_main.hpp"
#include "support/catch2_session.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace {

/// The test spec of a run without one on a machine with too few GPUs for [multi_gpu]: hidden
/// cases stay out, as in Catch2's own default.
constexpr const char* without_multi_gpu = "~[.] ~[multi_gpu]";

/// The cases tagged [multi_gpu] that a run without a test spec would select (not hidden). Read
/// before the session: its end clears Catch2's registry.
std::vector<std::string> multi_gpu_cases() {
    std::vector<std::string> names;
    for (const Catch::TestCase& t : Catch::getRegistryHub().getTestCaseRegistry().getAllTests())
        if (!t.isHidden() &&
            std::find(t.lcaseTags.begin(), t.lcaseTags.end(), "multi_gpu") != t.lcaseTags.end())
            names.push_back(t.name);
    return names;
}

} // namespace

int main(int argc, char** argv) {
    using lockstep_test::multi_gpu_devices;
    using lockstep_test::skip_return_code;
    const int devices = lockstep_test::device_count();
    if (devices == 0) {
        const int failed = lockstep::testing::run_catch2(argc, argv, "~[gpu]");
        if (failed != 0)
            return failed;
        std::printf("no CUDA device: the GPU cases were not run (exit %d: skipped)\n",
                    skip_return_code);
        return skip_return_code;
    }
    if (devices >= multi_gpu_devices)
        return lockstep::testing::run_catch2(argc, argv);
    const std::vector<std::string> left_out = multi_gpu_cases();
    bool defaulted = false;
    const int failed = lockstep::testing::run_catch2(argc, argv, without_multi_gpu, &defaulted);
    std::vector<std::string> not_run = lockstep_test::multi_gpu_not_run();
    if (defaulted)
        not_run.insert(not_run.end(), left_out.begin(), left_out.end());
    if (not_run.empty())
        return failed;
    for (const std::string& name : not_run)
        std::printf("not run (needs %d or more GPUs): %s\n", multi_gpu_devices, name.c_str());
    // The last line of the log: scripts/gpu_run.py records it as the reason of the skip.
    std::printf("not run: %zu case(s) tagged [multi_gpu] need %d or more GPUs, this machine has %d",
                not_run.size(), multi_gpu_devices, devices);
    if (failed != 0) {
        std::printf("\n");
        return failed;
    }
    std::printf(" (exit %d: skipped)\n", skip_return_code);
    return skip_return_code;
}

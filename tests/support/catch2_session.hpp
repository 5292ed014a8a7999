// tests/support/catch2_session.hpp: the Catch2 session every test main runs. Catch2's
// implementation is compiled once per build, with it, in tests/catch2_session.cpp.
// SPDX-License-Identifier: Apache-2.0
#pragma once

namespace lockstep::testing {

/// Runs the Catch2 session of a test executable: reads the command line and runs the test cases
/// it selects; when it names no test case or tag and default_spec is not null, runs the cases
/// default_spec selects instead (the CUDA tests pass "~[gpu]" without a device), and sets
/// *used_default (when not null) to whether it did.
/// ensures: returns Catch2's exit code: non-zero when the command line was invalid or a test
/// case failed, else 0.
int run_catch2(int argc, char** argv, const char* default_spec = nullptr,
               bool* used_default = nullptr);

} // namespace lockstep::testing

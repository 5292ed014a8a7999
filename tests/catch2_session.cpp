// Catch2's implementation, compiled once per build and linked into every test executable (the
// MPI and CUDA tests' too), and the one Catch2 session their mains run (run_catch2, declared in
// support/catch2_session.hpp). No lockstep header is included: tests/CMakeLists.txt compiles this
// unit at -O0 without debug information. SPDX-License-Identifier: Apache-2.0
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "support/catch2_session.hpp"

namespace lockstep::testing {

int run_catch2(int argc, char** argv, const char* default_spec, bool* used_default) {
    Catch::Session session;
    if (const int rc = session.applyCommandLine(argc, argv); rc != 0)
        return rc;
    const bool use = default_spec != nullptr && session.configData().testsOrTags.empty();
    if (use)
        session.configData().testsOrTags.emplace_back(default_spec);
    if (used_default != nullptr)
        *used_default = use;
    return session.run();
}

} // namespace lockstep::testing

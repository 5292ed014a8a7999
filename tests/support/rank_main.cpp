// tests/support/rank_main.cpp: the main of a multi-rank Catch2 executable (rank_main, declared in
// rank_launcher.hpp) and the listener that ends every test case with an agreement of the ranks.
// SPDX-License-Identifier: Apache-2.0
#include "support/catch2_session.hpp"
#include "support/rank_launcher.hpp"

// The listener base and CATCH_REGISTER_LISTENER (Catch2 v2 declares them for the implementation
// unit, or where this is defined).
#define CATCH_CONFIG_EXTERNAL_INTERFACES
#include <catch2/catch.hpp>

#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

/// At the end of every test case, on every rank: agree on whether the case passed here; when any
/// rank failed (or died, or hung), end this rank at once instead of starting the next case, which
/// would wait for the failed rank in its first collective.
struct rank_listener : Catch::TestEventListenerBase {
    using TestEventListenerBase::TestEventListenerBase;

    void testCaseEnded(const Catch::TestCaseStats& stats) override {
        namespace ranks = lockstep_test::ranks;
        const bool passed =
            stats.totals.assertions.failed == 0 && stats.totals.testCases.failed == 0;
        if (ranks::agree(passed, stats.testInfo.name))
            return;
        std::fprintf(stderr, "rank %d: test case '%s' failed on a rank: ending this rank\n",
                     ranks::rank(), stats.testInfo.name.c_str());
        std::cout.flush();
        std::cerr.flush();
        std::fflush(nullptr);
        ::_exit(1);
    }
};

} // namespace

CATCH_REGISTER_LISTENER(rank_listener)

namespace lockstep_test::ranks {

int ranks_argument(int argc, char** argv, int fallback) {
    for (int i = 1; i < argc; ++i) {
        const std::string_view a(argv[i]);
        const char* value = nullptr;
        if (a == "--ranks" && i + 1 < argc)
            value = argv[i + 1];
        else if (a.starts_with("--ranks="))
            value = argv[i] + 8;
        else if (a == "--ranks")
            throw std::invalid_argument("--ranks needs a value");
        if (value == nullptr)
            continue;
        char* end = nullptr;
        const long n = std::strtol(value, &end, 10);
        if (*value == '\0' || *end != '\0' || n < 1 || n > 4096)
            throw std::invalid_argument(std::string("--ranks ") + value +
                                        ": need an integer in [1, 4096]");
        return static_cast<int>(n);
    }
    return fallback;
}

int rank_main(int argc, char** argv, const char* default_spec, int skip_code,
              const launch_options& options) {
    try {
        if (is_rank_process())
            return lockstep::testing::run_catch2(argc, argv, default_spec);
        launch_options o = options;
        o.ranks = ranks_argument(argc, argv, options.ranks);
        char exe[PATH_MAX];
        const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0)
            throw std::runtime_error("cannot read /proc/self/exe");
        std::vector<std::string> args{std::string(exe, static_cast<std::size_t>(n))};
        for (int i = 1; i < argc; ++i) {
            const std::string_view a(argv[i]);
            if (a == "--ranks")
                ++i;
            else if (!a.starts_with("--ranks="))
                args.emplace_back(a);
        }
        const launch_result result = launch(args, o);
        std::cerr << result.report << std::flush;
        return result.exit_code == 77 ? skip_code : result.exit_code;
    } catch (const std::exception& e) {
        std::cerr << "rank launcher: " << e.what() << '\n';
        return 2;
    }
}

int rank_main(int argc, char** argv, const char* default_spec, int skip_code) {
    return rank_main(argc, argv, default_spec, skip_code, launch_options{});
}

} // namespace lockstep_test::ranks

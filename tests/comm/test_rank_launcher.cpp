// Tests of the multi-rank test launcher (tests/support/rank_launcher.hpp) on the CPU: rank_probe's
// ranks pass, share, fail, exit, hang, crash or die as planned; rank_main_probe's Catch2 ranks.
// SPDX-License-Identifier: Apache-2.0
#include "support/rank_launcher.hpp"

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using lockstep_test::ranks::launch;
using lockstep_test::ranks::launch_options;
using lockstep_test::ranks::launch_result;
using end = lockstep_test::ranks::rank_outcome::end;
using namespace std::chrono_literals;

namespace {

/// A fault the launcher sees as a death or a failed agreement must end the run long before this
/// case timeout; only the hang cases wait for theirs (short, so the test stays fast).
const launch_options fault_options{.ranks = 2, .case_timeout = 30s, .grace = 3s};
const launch_options hang_options{.ranks = 2, .case_timeout = 2s, .grace = 2s};
/// A fault seen as a death or a failed agreement ends the run at once: well before this bound
/// (half of fault_options' case timeout), which only a timeout would reach.
constexpr double fault_bound_s = 15.0;
/// The longest a run may take beyond its case timeout and grace (a loaded 2-core machine).
constexpr double slack_s = 5.0;

struct timed_result {
    launch_result result;
    double seconds;
};

timed_result run(const std::vector<std::string>& argv, int ranks, launch_options options) {
    options.ranks = ranks;
    const auto t0 = std::chrono::steady_clock::now();
    launch_result r = launch(argv, options);
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    // No rank is left behind, not even as a zombie: this process has no child any more.
    errno = 0;
    CHECK(::waitpid(-1, nullptr, WNOHANG) == -1);
    CHECK(errno == ECHILD);
    return {std::move(r), dt.count()};
}

timed_result probe(const std::string& scenario, int ranks, const launch_options& options,
                   int culprit = 1) {
    return run({LOCKSTEP_RANK_PROBE, scenario, std::to_string(culprit)}, ranks, options);
}

std::string first_line(const std::string& s) {
    return s.substr(0, s.find('\n'));
}

/// The report's line for rank r ("  rank r: ...").
std::string rank_line(const std::string& report, int r) {
    std::istringstream in(report);
    const std::string prefix = "  rank " + std::to_string(r) + ": ";
    for (std::string line; std::getline(in, line);)
        if (line.starts_with(prefix))
            return line;
    return "";
}

/// Checks that every rank but the culprit exited with code 1 (its agreement failed) and that the
/// report's verdict and the culprit's line name the culprit.
void check_peers_failed(const launch_result& r, int ranks, int culprit,
                        const std::string& verdict) {
    CHECK(r.exit_code == 1);
    REQUIRE(static_cast<int>(r.ranks.size()) == ranks);
    for (const auto& o : r.ranks) {
        CHECK(o.rank == static_cast<int>(&o - r.ranks.data()));
        CHECK_FALSE(o.planned);
        if (o.rank == culprit)
            continue;
        CHECK(o.how == end::exited);
        CHECK(o.value == 1);
    }
    CHECK_THAT(first_line(r.report), Catch::Matchers::Contains("FAILED: " + verdict));
    CHECK_THAT(rank_line(r.report, culprit), Catch::Matchers::EndsWith("<- the failure"));
}

std::map<std::string, std::string> read_lines(const std::filesystem::path& file) {
    std::map<std::string, std::string> kv;
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);)
        if (const auto eq = line.find('='); eq != std::string::npos)
            kv[line.substr(0, eq)] = line.substr(eq + 1);
    return kv;
}

} // namespace

TEST_CASE("launcher: every rank passes", "[launcher]") {
    const int ranks = GENERATE(1, 2, 3);
    const auto [r, s] = probe("pass", ranks, fault_options);
    INFO(r.report);
    CHECK(r.exit_code == 0);
    REQUIRE(static_cast<int>(r.ranks.size()) == ranks);
    for (const auto& o : r.ranks) {
        CHECK(o.how == end::exited);
        CHECK(o.value == 0);
        CHECK_FALSE(o.planned);
    }
    CHECK_THAT(first_line(r.report), Catch::Matchers::EndsWith("passed"));
}

TEST_CASE("launcher: a rank started through a wrapper that forks is still the rank", "[launcher]") {
    // The shell forks the probe (a command follows it): the probe holds the shell's socket.
    const auto [r, s] = run({"/bin/sh", "-c", "\"$0\" \"$@\"; status=$?; exit $status",
                             LOCKSTEP_RANK_PROBE, "share", "1"},
                            2, fault_options);
    INFO(r.report);
    CHECK(r.exit_code == 0);
}

TEST_CASE("launcher: every rank gets rank 0's 128 bytes", "[launcher]") {
    const int ranks = GENERATE(2, 3);
    const auto [r, s] = probe("share", ranks, fault_options);
    INFO(r.report);
    CHECK(r.exit_code == 0);
    for (const auto& o : r.ranks)
        CHECK((o.how == end::exited && o.value == 0));
}

TEST_CASE("launcher: a failed agreement on one rank ends every rank", "[launcher]") {
    const int ranks = GENERATE(2, 3);
    const int culprit = GENERATE_COPY(0, ranks - 1);
    const auto [r, s] = probe("fail", ranks, fault_options, culprit);
    INFO(r.report);
    check_peers_failed(r, ranks, culprit,
                       "rank " + std::to_string(culprit) + " failed 'probe check'");
    CHECK(r.ranks[static_cast<std::size_t>(culprit)].how == end::exited);
    CHECK(r.ranks[static_cast<std::size_t>(culprit)].value == 1);
    CHECK(s < fault_bound_s);
}

TEST_CASE("launcher: a rank that exits before an agreement ends every rank", "[launcher]") {
    const int ranks = GENERATE(2, 3);
    const auto [r, s] = probe("exit", ranks, fault_options);
    INFO(r.report);
    check_peers_failed(r, ranks, 1, "rank 1 exited with code 3");
    CHECK(r.ranks[1].how == end::exited);
    CHECK(r.ranks[1].value == 3);
    CHECK(s < fault_bound_s);
}

TEST_CASE("launcher: a rank that exits 0 while others wait for it is a failure", "[launcher]") {
    const int ranks = GENERATE(2, 3);
    const auto [r, s] = probe("leave", ranks, fault_options);
    INFO(r.report);
    check_peers_failed(r, ranks, 1, "rank 1 exited with code 0 while");
    CHECK(r.ranks[1].how == end::exited);
    CHECK(r.ranks[1].value == 0);
    CHECK(s < fault_bound_s);
}

TEST_CASE("launcher: a rank that crashes ends every rank", "[launcher]") {
    const int ranks = GENERATE(2, 3);
    const auto [r, s] = probe("crash", ranks, fault_options);
    INFO(r.report);
    check_peers_failed(r, ranks, 1, "rank 1 was killed by signal SIGSEGV");
    CHECK(r.ranks[1].how == end::signalled);
    CHECK(r.ranks[1].value == SIGSEGV);
    CHECK(s < fault_bound_s);
}

TEST_CASE("launcher: a rank that hangs is killed after the timeout", "[launcher][hang]") {
    // hang_early: before its first message; hang: between two agreements.
    const auto [ranks, scenario] =
        GENERATE(table<int, std::string>({{2, "hang_early"}, {3, "hang"}}));
    INFO(scenario);
    const auto [r, s] = probe(scenario, ranks, hang_options);
    INFO(r.report);
    check_peers_failed(r, ranks, 1, "rank 1 hung past the timeout (2 s) while rank");
    CHECK(r.ranks[1].how == end::killed_by_launcher);
    CHECK(r.ranks[1].value == SIGKILL);
    CHECK_THAT(rank_line(r.report, 1), Catch::Matchers::Contains("hung past the timeout"));
    // The peers fail at the timeout; the hung rank dies when the grace after it ends.
    const double limit =
        static_cast<double>((hang_options.case_timeout + hang_options.grace).count());
    CHECK(s >= limit - 0.1);
    CHECK(s < limit + slack_s);
}

// scripts/gpu_run.py and CTest end a test that runs too long with SIGTERM (then SIGKILL 5 s
// later): the launcher must still kill its ranks and say where they were.
TEST_CASE("launcher: a SIGTERM from outside kills the ranks and still gives the verdict",
          "[launcher][hang]") {
    const launch_options slow{.ranks = 3, .case_timeout = 60s, .grace = 30s};
    std::thread stopper([] {
        std::this_thread::sleep_for(3s); // the ranks wait in their second agreement by then
        ::kill(::getpid(), SIGTERM);
    });
    const auto [r, s] = probe("hang", 3, slow);
    stopper.join();
    INFO(r.report);
    CHECK(r.exit_code == 1);
    CHECK_THAT(first_line(r.report),
               Catch::Matchers::Contains("FAILED: stopped by SIGTERM from outside after "));
    CHECK_THAT(
        first_line(r.report),
        Catch::Matchers::EndsWith(" s: rank 1 had not arrived while ranks 0, 2 wait in agree"));
    // The waiting ranks get "failed" and exit 1, unless the SIGKILL that follows at once is
    // faster; the hung rank is killed.
    for (const int waiting : {0, 2}) {
        const auto& o = r.ranks[static_cast<std::size_t>(waiting)];
        CHECK(((o.how == end::exited && o.value == 1) || o.how == end::killed_by_launcher));
    }
    CHECK(r.ranks[1].how == end::killed_by_launcher);
    CHECK_THAT(rank_line(r.report, 1),
               Catch::Matchers::EndsWith("killed by the launcher when SIGTERM stopped it <- the "
                                         "failure"));
    // At once: neither the 60 s case timeout nor the 30 s grace.
    CHECK(s < 3.0 + slack_s);
}

TEST_CASE("launcher: a planned death counts as success", "[launcher]") {
    const int ranks = GENERATE(2, 3);
    const int culprit = GENERATE_COPY(0, ranks - 1);
    const auto [r, s] = probe("planned", ranks, fault_options, culprit);
    INFO(r.report);
    CHECK(r.exit_code == 0);
    REQUIRE(static_cast<int>(r.ranks.size()) == ranks);
    for (const auto& o : r.ranks) {
        if (o.rank == culprit) {
            CHECK(o.how == end::signalled);
            CHECK(o.value == SIGKILL);
            CHECK(o.planned);
        } else {
            CHECK(o.how == end::exited);
            CHECK(o.value == 0);
            CHECK_FALSE(o.planned);
        }
    }
}

TEST_CASE("launcher: every rank skipped gives 77", "[launcher]") {
    const int ranks = GENERATE(2, 3);
    const auto [r, s] = probe("skip", ranks, fault_options);
    INFO(r.report);
    CHECK(r.exit_code == 77);
    for (const auto& o : r.ranks)
        CHECK((o.how == end::exited && o.value == 77));
}

TEST_CASE("launcher: a program that cannot be executed is a failure, not a hang", "[launcher]") {
    const auto [r, s] = run({"/nonexistent/rank_program"}, 2, fault_options);
    INFO(r.report);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.report, Catch::Matchers::Contains("could not execute the program"));
    CHECK(s < fault_bound_s);
}

TEST_CASE("launcher: each rank's environment, and no launcher socket in a grandchild",
          "[launcher]") {
    const bool distinct = GENERATE(false, true);
    const int ranks = 3;
    const auto dir = std::filesystem::temp_directory_path() /
                     ("lockstep_rank_env_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    launch_options o = fault_options;
    o.distinct_host_ids = distinct;
    const auto [r, s] = run({LOCKSTEP_RANK_PROBE, "env", "0", dir.string()}, ranks, o);
    INFO(r.report);
    CHECK(r.exit_code == 0);
    const char* parent_host_id = std::getenv("NCCL_HOSTID");
    const std::string unset = "(unset)";
    for (int rank = 0; rank < ranks; ++rank) {
        auto env = read_lines(dir / ("rank" + std::to_string(rank) + ".txt"));
        INFO("rank " << rank);
        CHECK(env["NCCL_SOCKET_IFNAME"] == "lo");
        CHECK(env["LOCKSTEP_RANKS"] == std::to_string(ranks));
        if (distinct) {
            CHECK(env["NCCL_HOSTID"] == "lockstep-rank-" + std::to_string(rank));
            CHECK(env["NCCL_P2P_DISABLE"] == "1");
            CHECK(env["NCCL_SHM_DISABLE"] == "1");
            CHECK(env["NCCL_NET"] == "Socket");
        } else {
            // Without distinct host ids the launcher leaves NCCL's host id to the environment.
            CHECK(env["NCCL_HOSTID"] == (parent_host_id != nullptr ? parent_host_id : unset));
        }
        // Its own end of its socket, no other rank's (they are close-on-exec).
        CHECK(env["sockets"] == "1");
        // A program the rank starts holds no launcher socket and knows it is no rank (it
        // inherits the rank's variables, not its fd).
        auto grandchild = read_lines(dir / ("grandchild" + std::to_string(rank) + ".txt"));
        CHECK(grandchild["sockets"] == "0");
        CHECK(grandchild["rank_process"] == "0");
    }
    std::filesystem::remove_all(dir);
}

TEST_CASE("launcher: a Catch2 rank main ends every rank when a case fails on one", "[launcher]") {
    SECTION("a case that passes on every rank") {
        const auto [r, s] = run({LOCKSTEP_RANK_MAIN_PROBE, "[pass]"}, 3, fault_options);
        INFO(r.report);
        CHECK(r.exit_code == 0);
    }
    SECTION("a case that fails on rank 1: no rank starts the next case") {
        const auto [r, s] = run({LOCKSTEP_RANK_MAIN_PROBE, "[fail]"}, 3, fault_options);
        INFO(r.report);
        check_peers_failed(r, 3, 1, "rank 1 failed 'rank main probe: fails on rank 1 only'");
        CHECK(r.ranks[1].how == end::exited);
        CHECK(r.ranks[1].value == 1);
        CHECK(s < fault_bound_s);
    }
    SECTION("a case that fails on rank 1 while the others wait in share_from_rank0") {
        const auto [r, s] = run({LOCKSTEP_RANK_MAIN_PROBE, "[fail_share]"}, 3, fault_options);
        INFO(r.report);
        check_peers_failed(r, 3, 1, "rank 1 failed 'rank main probe: fails on rank 1 while");
        CHECK(r.ranks[1].how == end::exited);
        CHECK(r.ranks[1].value == 1);
        CHECK(s < fault_bound_s);
    }
}

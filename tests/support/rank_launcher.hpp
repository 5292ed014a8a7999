// tests/support/rank_launcher.hpp: the multi-rank test launcher: starts N rank processes of one
// program (fork + execve), relays their collectives and ends every rank when one fails.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "support/rank_launcher_detail.hpp"
#include "support/rank_process.hpp"

#include <csignal>
#include <sys/wait.h>

#include <chrono>
#include <string>
#include <vector>

namespace lockstep_test::ranks {

/// How launch() runs the ranks.
struct launch_options {
    /// The number of rank processes (>= 1).
    int ranks = 2;
    /// The longest a rank may go without the ranks completing a collective (counted from the start
    /// and from each completed collective): past it the ranks that did not arrive count as hung.
    std::chrono::seconds case_timeout{120};
    /// How long the ranks get to exit after a failure before the launcher SIGKILLs them.
    std::chrono::seconds grace{10};
    /// Gives rank r NCCL_HOSTID=lockstep-rank-<r> (and NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1,
    /// NCCL_NET=Socket), so NCCL sees the ranks as separate hosts: several ranks on one GPU.
    bool distinct_host_ids = false;
};

/// How one rank ended.
struct rank_outcome {
    enum class end { exited, signalled, killed_by_launcher };
    int rank;
    /// exited: value is the exit code; signalled: value is the signal; killed_by_launcher: value
    /// is SIGKILL (the rank hung past the timeout or outlived the grace after a failure).
    end how;
    int value;
    /// The rank announced planned_exit() before it died: its death counts as success.
    bool planned;
};

/// What launch() returns.
struct launch_result {
    /// 0: every rank exited 0 or died as planned; 77: every (unplanned) rank exited 77
    /// (skipped); else 1.
    int exit_code;
    /// One per rank, in rank order.
    std::vector<rank_outcome> ranks;
    /// A first line with the verdict (naming the rank that failed, died or hung first), then
    /// one line per rank saying how it ended.
    std::string report;
};

namespace detail {

/// launch_result::exit_code of a finished launcher.
inline int exit_code(const launcher& l) {
    if (l.failed() || !l.all_reaped())
        return 1;
    int passed = 0, skipped = 0, members = 0;
    for (const auto& r : l.states()) {
        if (!r.member())
            continue;
        ++members;
        const int code = WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1;
        passed += code == 0;
        skipped += code == 77;
    }
    if (passed == members)
        return 0;
    return skipped == members ? 77 : 1;
}

/// How rank r ended, in words.
inline std::string describe(const rank_state& r, const launch_options& o, int stopped_by) {
    if (!r.reaped)
        return "survived SIGKILL for 10 s (not reaped)";
    std::string s;
    if (r.killed && WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGKILL)
        s = r.hung ? "hung past the timeout (" + std::to_string(o.case_timeout.count()) +
                         " s); killed by the launcher"
            : stopped_by != 0
                ? "killed by the launcher when " + signal_name(stopped_by) + " stopped it"
                : "killed by the launcher " + std::to_string(o.grace.count()) +
                      " s after the failure (did not exit in the grace period)";
    else
        s = death(r);
    if (r.planned)
        s += " (planned_exit: counts as success)";
    else if (r.culprit)
        s += " <- the failure";
    return s;
}

/// launch_result::report: the verdict line, then one line per rank.
inline std::string report(const launcher& l, int code, const launch_options& o) {
    std::string s = "rank launcher: " + std::to_string(l.states().size()) + " ranks: ";
    if (code == 0)
        s += "passed";
    else if (code == 77)
        s += "every rank skipped (exit 77)";
    else if (l.failed())
        s += "FAILED: " + l.reason();
    else if (!l.all_reaped())
        s += "FAILED: a rank survived SIGKILL";
    else
        s += "FAILED: some ranks skipped (exit 77), others did not";
    s += '\n';
    for (const auto& r : l.states())
        s += "  rank " + std::to_string(r.rank) + ": " + describe(r, o, l.stopped_by()) + '\n';
    return s;
}

} // namespace detail

/// Runs argv (argv[0] is the program's path; no PATH search) as options.ranks processes, each
/// forked and exec'd (never a plain fork: a child must not use CUDA that its parent may have
/// initialised) with its environment set before execve, so before its first NCCL call:
/// LOCKSTEP_RANK, LOCKSTEP_RANKS, LOCKSTEP_RANK_FD (its end of a socket to the launcher, the only
/// launcher fd it inherits), NCCL_SOCKET_IFNAME=lo and, with distinct_host_ids, the NCCL_HOSTID
/// set above. Each rank is its own process group and dies with the launcher (Linux).
/// Relays share_from_rank0 and agree; when a rank dies unplanned, fails an agreement, exits
/// while others wait for it, or no collective completes within case_timeout, answers every
/// waiting rank "failed", gives the ranks grace to exit, then SIGKILLs the rest. A SIGTERM or
/// SIGINT while it runs (a caller's timeout) SIGKILLs every rank at once and returns exit code
/// 1 with the verdict: which ranks waited in which collective, which had not arrived.
/// requires: !argv.empty(), options.ranks >= 1.
/// ensures: returns after every rank was reaped (within case_timeout + grace + a few seconds
/// of the last completed collective); never hangs. Throws std::invalid_argument on bad
/// arguments, std::runtime_error when a socket or fork fails (ranks already started are killed
/// and reaped).
inline launch_result launch(const std::vector<std::string>& argv, const launch_options& options) {
    detail::launcher l(argv, options.ranks, options.case_timeout, options.grace,
                       options.distinct_host_ids);
    l.run();
    const int code = detail::exit_code(l);
    launch_result out{code, {}, detail::report(l, code, options)};
    for (const auto& r : l.states()) {
        rank_outcome o{r.rank, rank_outcome::end::exited, 0, r.planned};
        if (!r.reaped || (r.killed && WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGKILL)) {
            o.how = rank_outcome::end::killed_by_launcher;
            o.value = SIGKILL;
        } else if (WIFSIGNALED(r.status)) {
            o.how = rank_outcome::end::signalled;
            o.value = WTERMSIG(r.status);
        } else {
            o.value = WEXITSTATUS(r.status);
        }
        out.ranks.push_back(o);
    }
    return out;
}

/// The value of a `--ranks N` (or `--ranks=N`) argument, or fallback when there is none; lets a
/// main pick its launch_options (distinct_host_ids when there are fewer GPUs than ranks) before
/// rank_main. Throws std::invalid_argument when N is not an integer in [1, 4096].
int ranks_argument(int argc, char** argv, int fallback);

/// The whole main() of a multi-rank Catch2 executable (defined in tests/support/rank_main.cpp,
/// target lockstep_rank_main, which also registers the Catch2 listener that calls
/// agree(case passed, case name) at the end of every test case and _exit(1)s the rank when the
/// agreement fails). In the launcher (no LOCKSTEP_RANK): reads `--ranks N` (default
/// options.ranks), removes it, launches /proc/self/exe with the other arguments N times with
/// options, prints the report on stderr and returns the exit code (skip_code where every rank
/// skipped). In a rank: runs the Catch2 session (run_catch2 with default_spec) and returns its
/// exit code.
int rank_main(int argc, char** argv, const char* default_spec, int skip_code,
              const launch_options& options);

/// rank_main with the default launch_options.
int rank_main(int argc, char** argv, const char* default_spec, int skip_code);

} // namespace lockstep_test::ranks

// tests/support/rank_spawn.hpp: one rank as the launcher sees it: its state, how it ended, and
// starting it (socketpair, fork, execve with the rank's environment). Used by
// rank_launcher_detail.hpp. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "support/rank_wire.hpp"

#include <csignal>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep_test::ranks::detail {

/// "SIGSEGV" for the signals a test meets, else "signal N".
inline std::string signal_name(int sig) {
    switch (sig) {
    case SIGABRT:
        return "SIGABRT";
    case SIGBUS:
        return "SIGBUS";
    case SIGFPE:
        return "SIGFPE";
    case SIGHUP:
        return "SIGHUP";
    case SIGILL:
        return "SIGILL";
    case SIGINT:
        return "SIGINT";
    case SIGKILL:
        return "SIGKILL";
    case SIGPIPE:
        return "SIGPIPE";
    case SIGQUIT:
        return "SIGQUIT";
    case SIGSEGV:
        return "SIGSEGV";
    case SIGTERM:
        return "SIGTERM";
    case SIGTRAP:
        return "SIGTRAP";
    default:
        return "signal " + std::to_string(sig);
    }
}

/// One rank as the launcher sees it.
struct rank_state {
    int rank = 0;
    pid_t pid = -1;
    int fd = -1;                  // the launcher's end of the rank's socket; -1 once closed
    std::vector<std::byte> inbox; // bytes read that do not make a whole frame yet
    bool reaped = false;
    int status = 0; // waitpid's status once reaped
    bool planned = false;
    bool killed = false;  // SIGKILLed by the launcher
    bool culprit = false; // named by the failure
    bool hung = false;    // the culprit of a timeout
    bool waiting = false; // posted a share or agree and waits for the answer
    frame_kind posted = frame_kind::agree;
    bool ok = true; // agree: this rank's vote
    std::string what;
    std::vector<std::byte> bytes; // share: rank 0's bytes
    std::string exec_error;

    /// Whether the collectives wait for this rank (a rank that announced planned_exit leaves).
    bool member() const { return !planned; }
};

/// "exited with code 3" / "was killed by signal SIGSEGV" (with the exec error, if any).
/// requires: r.reaped.
inline std::string death(const rank_state& r) {
    std::string s = WIFSIGNALED(r.status)
                        ? "was killed by signal " + signal_name(WTERMSIG(r.status))
                        : "exited with code " + std::to_string(WEXITSTATUS(r.status));
    if (!r.exec_error.empty())
        s += " (could not execute the program: " + r.exec_error + ")";
    return s;
}

/// The environment of rank `rank` of `ranks`: this process's, with the launcher's variables set
/// (replacing any inherited value). fd is the rank's end of its socket.
inline std::vector<std::string> rank_environment(int rank, int ranks, int fd,
                                                 std::chrono::milliseconds rank_wait,
                                                 bool distinct_host_ids) {
    const auto var = [](const char* name, auto value) {
        return std::string(name) + "=" + std::to_string(value);
    };
    std::vector<std::string> set = {var(env_rank, rank),
                                    var(env_ranks, ranks),
                                    var(env_rank_fd, fd),
                                    var(env_rank_wait_ms, rank_wait.count()),
                                    var(env_launcher_pid, ::getpid()),
                                    "NCCL_SOCKET_IFNAME=lo"};
    if (distinct_host_ids) {
        // Distinct host ids make NCCL take the ranks for separate nodes (it refuses two ranks on
        // one device of one host); nodes talk over sockets, not P2P or shared memory.
        set.push_back("NCCL_HOSTID=lockstep-rank-" + std::to_string(rank));
        for (const char* v : {"NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_NET=Socket"})
            set.emplace_back(v);
    }
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string_view v(*e);
        const auto key = v.substr(0, v.find('=') + 1);
        if (std::none_of(set.begin(), set.end(), [&](auto& s) { return s.starts_with(key); }))
            env.emplace_back(v);
    }
    env.insert(env.end(), set.begin(), set.end());
    return env;
}

/// A started rank: its pid (also its process group) and the launcher's end of its socket.
struct spawned {
    pid_t pid;
    int fd;
};

/// Starts argv as rank `rank` of `ranks`: a socketpair (close-on-exec, so no other rank
/// inherits it), fork, then in the child a process group of its own, death with the
/// launcher (Linux), its own socket end kept open and execve with rank_environment. When execve
/// fails the child writes an exec_failed frame (errno) and exits 127.
/// ensures: the launcher's end is non-blocking; throws std::runtime_error when socketpair or
/// fork fails (nothing is left open then).
inline spawned spawn_rank(const std::vector<std::string>& argv, int rank, int ranks,
                          std::chrono::milliseconds rank_wait, bool distinct_host_ids) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        throw std::runtime_error("rank launcher: socketpair for rank " + std::to_string(rank) +
                                 ": " + std::strerror(errno));
    const int child_fd = sv[1];
    // Everything the child needs is built before fork: between fork and execve it may call only
    // async-signal-safe functions (the launcher may have other threads, CUDA's for one).
    std::vector<std::string> env;
    std::vector<char*> envp, args;
    try {
        env = rank_environment(rank, ranks, child_fd, rank_wait, distinct_host_ids);
        for (auto& e : env)
            envp.push_back(e.data());
        envp.push_back(nullptr);
        for (const auto& a : argv)
            args.push_back(const_cast<char*>(a.c_str()));
        args.push_back(nullptr);
    } catch (...) {
        ::close(sv[0]);
        ::close(sv[1]);
        throw;
    }
    const frame_header exec_failed{static_cast<std::uint32_t>(frame_kind::exec_failed),
                                   sizeof(int)};
    [[maybe_unused]] const pid_t parent = ::getpid();
    std::cout.flush(); // what the launcher printed comes out before the rank's output
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
        ::setpgid(0, 0); // the launcher kills the rank's process group, grandchildren too
#ifdef __linux__
        ::prctl(PR_SET_PDEATHSIG, SIGKILL); // no rank outlives a killed launcher
        if (::getppid() != parent)
            ::_exit(127);
#endif
        sigset_t none;
        ::sigemptyset(&none);
        ::sigprocmask(SIG_SETMASK, &none, nullptr);
        ::fcntl(child_fd, F_SETFD, 0);
        ::execve(args[0], args.data(), envp.data());
        const int err = errno;
        (void)!::write(child_fd, &exec_failed, sizeof exec_failed);
        (void)!::write(child_fd, &err, sizeof err);
        ::_exit(127);
    }
    const int err = errno;
    ::close(child_fd);
    if (pid < 0) {
        ::close(sv[0]);
        throw std::runtime_error("rank launcher: fork of rank " + std::to_string(rank) + ": " +
                                 std::strerror(err));
    }
    ::fcntl(sv[0], F_SETFL, ::fcntl(sv[0], F_GETFL) | O_NONBLOCK);
    return {pid, sv[0]};
}

} // namespace lockstep_test::ranks::detail

// tests/comm/rank_probe.cpp: a rank program for test_rank_launcher: each scenario (argv[1]) makes
// one rank (argv[2], default 1) pass, fail, exit, hang, crash or leave as planned.
// SPDX-License-Identifier: Apache-2.0
#include "support/rank_launcher.hpp"

#include <dirent.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

namespace ranks = lockstep_test::ranks;

namespace {

/// The bytes rank 0 shares: 128 (an ncclUniqueId's size), none of them equal to its index.
std::vector<std::byte> pattern(int salt) {
    std::vector<std::byte> v(128);
    for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<std::byte>((i * 7 + 3 + static_cast<std::size_t>(salt)) % 251);
    return v;
}

/// The open sockets of this process (/proc/self/fd).
int count_sockets() {
    int n = 0;
    DIR* d = ::opendir("/proc/self/fd");
    if (d == nullptr)
        return -1;
    while (const dirent* e = ::readdir(d)) {
        char target[256] = {};
        const std::string path = std::string("/proc/self/fd/") + e->d_name;
        if (::readlink(path.c_str(), target, sizeof target - 1) > 0 &&
            std::string_view(target).starts_with("socket:"))
            ++n;
    }
    ::closedir(d);
    return n;
}

/// Runs this program again as "sockets FILE" (fork + exec, as a test helper would) and waits.
bool run_grandchild(const char* self, const std::string& file) {
    const pid_t pid = ::fork();
    if (pid == 0) {
        ::execl(self, self, "sockets", file.c_str(), static_cast<char*>(nullptr));
        ::_exit(127);
    }
    int status = 0;
    return pid > 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
           WEXITSTATUS(status) == 0;
}

std::string env_or(const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return v != nullptr ? v : fallback;
}

int finish(bool agreed) {
    return agreed ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    const std::string_view scenario = argc > 1 ? argv[1] : "";
    if (scenario == "sockets") { // the grandchild: which of the launcher's sockets it holds
        std::ofstream(argv[2]) << "sockets=" << count_sockets() << '\n'
                               << "rank_process=" << ranks::is_rank_process() << '\n';
        return 0;
    }
    if (!ranks::is_rank_process()) {
        std::fprintf(stderr, "rank_probe: not started by the rank launcher\n");
        return 2;
    }
    static constexpr std::string_view known[] = {"pass",    "share", "fail",       "exit",
                                                 "leave",   "hang",  "hang_early", "crash",
                                                 "planned", "skip",  "env"};
    if (std::find(std::begin(known), std::end(known), scenario) == std::end(known)) {
        std::fprintf(stderr, "rank_probe: unknown scenario '%.*s'\n",
                     static_cast<int>(scenario.size()), scenario.data());
        return 2;
    }
    const int me = ranks::rank();
    const int culprit = argc > 2 ? std::atoi(argv[2]) : 1;
    const bool guilty = me == culprit;
    if (scenario == "pass")
        return finish(ranks::agree(true, "first") && ranks::agree(true, "second"));
    if (scenario == "share") {
        bool ok = true;
        for (int salt = 0; salt < 2; ++salt) {
            const auto mine = me == 0 ? pattern(salt) : std::vector<std::byte>{};
            ok = ranks::share_from_rank0(mine) == pattern(salt) && ok;
        }
        return finish(ranks::agree(ok, "rank 0's bytes arrived"));
    }
    if (scenario == "fail")
        return finish(ranks::agree(!guilty, "probe check"));
    if (scenario == "exit" && guilty)
        ::_exit(3);
    if (scenario == "leave" && guilty)
        return 0; // exits 0 without the agreement the others wait in
    if (scenario == "hang_early" && guilty)
        ::sleep(600);         // before its first message
    if (scenario == "hang") { // between two agreements
        if (!ranks::agree(true, "before the hang"))
            return 1;
        if (guilty)
            ::sleep(600);
    }
    if (scenario == "crash" && guilty) {
        const rlimit no_core{0, 0};
        ::setrlimit(RLIMIT_CORE, &no_core);
        ::prctl(PR_SET_DUMPABLE, 0);
        std::raise(SIGSEGV);
    }
    if (scenario == "planned") {
        if (!ranks::agree(true, "before the planned death"))
            return 1;
        if (guilty) {
            ranks::planned_exit();
            std::raise(SIGKILL);
        }
        if (culprit != 0 &&
            ranks::share_from_rank0(me == 0 ? pattern(5) : std::vector<std::byte>{}) != pattern(5))
            return 1;
        return finish(ranks::agree(true, "after the planned death"));
    }
    if (scenario == "skip")
        return 77;
    if (scenario == "env") { // what this rank and a program it starts see
        const std::string dir = argc > 3 ? argv[3] : ".";
        const std::string grandchild = dir + "/grandchild" + std::to_string(me) + ".txt";
        const bool started = run_grandchild(argv[0], grandchild);
        std::ofstream(dir + "/rank" + std::to_string(me) + ".txt")
            << "NCCL_HOSTID=" << env_or("NCCL_HOSTID", "(unset)") << '\n'
            << "NCCL_SOCKET_IFNAME=" << env_or("NCCL_SOCKET_IFNAME", "(unset)") << '\n'
            << "NCCL_P2P_DISABLE=" << env_or("NCCL_P2P_DISABLE", "(unset)") << '\n'
            << "NCCL_SHM_DISABLE=" << env_or("NCCL_SHM_DISABLE", "(unset)") << '\n'
            << "NCCL_NET=" << env_or("NCCL_NET", "(unset)") << '\n'
            << "LOCKSTEP_RANKS=" << env_or("LOCKSTEP_RANKS", "(unset)") << '\n'
            << "sockets=" << count_sockets() << '\n';
        return finish(ranks::agree(started, "grandchild started"));
    }
    return finish(ranks::agree(true, "the culprit's peers"));
}

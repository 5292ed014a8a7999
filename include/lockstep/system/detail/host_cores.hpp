// lockstep/system/detail/host_cores.hpp: how many cores this process may use (its affinity mask
// and its cgroup's CPU quota) and how many processes of its job share the node (the launcher's
// environment), so host_system's thread budget fits the node. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace lockstep::detail {

/// A positive decimal integer, or nothing (empty, a sign, a trailing character, overflow).
inline std::optional<long> parse_positive(std::string_view s) noexcept {
    long n = 0;
    if (s.empty())
        return std::nullopt;
    for (const char c : s) {
        if (c < '0' || c > '9' || n > (1L << 40))
            return std::nullopt;
        n = 10 * n + (c - '0');
    }
    return n > 0 ? std::optional<long>(n) : std::nullopt;
}

/// The cores a CPU quota allows, rounded up (a quota of 1.5 cores still runs 2 threads at
/// times): from cgroup v2's cpu.max ("<quota> <period>" or "max <period>") or cgroup v1's
/// cpu.cfs_quota_us / cpu.cfs_period_us (quota -1: none). Nothing when there is no quota.
inline std::optional<int> quota_cores(std::string_view quota, std::string_view period) noexcept {
    const auto q = parse_positive(quota);
    const auto p = parse_positive(period);
    if (!q || !p)
        return std::nullopt;
    return static_cast<int>(std::max(1L, (*q + *p - 1) / *p));
}

/// quota_cores() of a cgroup v2 cpu.max line.
inline std::optional<int> cpu_max_cores(std::string_view line) noexcept {
    while (!line.empty() && (line.back() == '\n' || line.back() == ' '))
        line.remove_suffix(1);
    const std::size_t space = line.find(' ');
    if (space == std::string_view::npos)
        return std::nullopt;
    return quota_cores(line.substr(0, space), line.substr(space + 1));
}

inline std::string read_first_line(const std::string& path) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    return line;
}

/// The cores this process's cgroup allows (the smallest quota from its cgroup up to the root of
/// the hierarchy mounted at /sys/fs/cgroup, v2 and v1), or nothing without a quota.
inline std::optional<int> cgroup_quota_cores() {
    std::optional<int> best;
    auto keep = [&](std::optional<int> c) {
        if (c && (!best || *c < *best))
            best = c;
    };
    std::ifstream self("/proc/self/cgroup");
    std::string line;
    while (std::getline(self, line)) {
        // "0::/path" (v2) or "N:cpu,cpuacct:/path" (v1).
        const std::size_t a = line.find(':');
        const std::size_t b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos)
            continue;
        const std::string controllers = line.substr(a + 1, b - a - 1);
        std::string path = line.substr(b + 1);
        const bool v2 = controllers.empty();
        const bool v1_cpu =
            controllers == "cpu" || controllers.rfind("cpu,", 0) == 0 ||
            controllers.find(",cpu,") != std::string::npos ||
            (controllers.size() > 4 && controllers.compare(controllers.size() - 4, 4, ",cpu") == 0);
        if (!v2 && !v1_cpu)
            continue;
        const std::string root = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/" + controllers;
        for (;;) { // this cgroup and every parent: the tightest quota binds
            const std::string dir = root + (path == "/" ? "" : path);
            if (v2)
                keep(cpu_max_cores(read_first_line(dir + "/cpu.max")));
            else
                keep(quota_cores(read_first_line(dir + "/cpu.cfs_quota_us"),
                                 read_first_line(dir + "/cpu.cfs_period_us")));
            if (path.empty() || path == "/")
                break;
            path.resize(std::max<std::size_t>(1, path.find_last_of('/')));
        }
    }
    return best;
}

/// The CPUs of this process's affinity mask (taskset, numactl, a batch system's binding), or
/// nothing where it cannot be read.
inline std::optional<int> affinity_cores() noexcept {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        const int n = CPU_COUNT(&set);
        if (n > 0)
            return n;
    }
#endif
    return std::nullopt;
}

/// The cores this process may use (>= 1): the hardware threads, capped by its affinity mask and
/// its cgroup's CPU quota.
inline int usable_cores() {
    int n = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    if (const auto a = affinity_cores())
        n = std::min(n, *a);
    if (const auto q = cgroup_quota_cores())
        n = std::min(n, *q);
    return std::max(1, n);
}

/// The processes of this job on this node as its launcher tells them (>= 1; 1 when no known
/// variable is set): MPICH's Hydra (MPI_LOCALNRANKS), Open MPI (OMPI_COMM_WORLD_LOCAL_SIZE),
/// MVAPICH2 (MV2_COMM_WORLD_LOCAL_SIZE), Slurm's srun (SLURM_NTASKS_PER_NODE when a plain
/// number). `get` is std::getenv or a stand-in (tests).
template <class Getenv>
int launcher_local_processes(Getenv get) {
    for (const char* name : {"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                             "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"}) {
        const char* v = get(name);
        if (v == nullptr)
            continue;
        if (const auto n = parse_positive(v))
            return static_cast<int>(std::min(*n, 1L << 20));
    }
    return 1;
}

} // namespace lockstep::detail

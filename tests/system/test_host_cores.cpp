// tests/system/test_host_cores.cpp: host_system's thread budget fits the node: the cores the
// process may use (affinity mask, cgroup quota) and the processes of its job sharing the node
// (the launcher's environment). SPDX-License-Identifier: Apache-2.0
#include "lockstep/system/detail/host_cores.hpp"
#include "lockstep/system/host_system.hpp"

#include <catch2/catch.hpp>

#include <map>
#include <sched.h>
#include <string>
#include <thread>

using lockstep::host_system;
namespace detail = lockstep::detail;

TEST_CASE("a CPU quota gives its cores, rounded up", "[system][host]") {
    CHECK(detail::cpu_max_cores("200000 100000") == 2);
    CHECK(detail::cpu_max_cores("150000 100000\n") == 2); // 1.5 cores still run 2 threads
    CHECK(detail::cpu_max_cores("50000 100000") == 1);
    CHECK_FALSE(detail::cpu_max_cores("max 100000").has_value());
    CHECK_FALSE(detail::cpu_max_cores("").has_value());
    CHECK(detail::quota_cores("400000", "100000") == 4); // cgroup v1
    CHECK_FALSE(detail::quota_cores("-1", "100000").has_value());
    CHECK_FALSE(detail::quota_cores("12x", "100000").has_value());
}

TEST_CASE("the launcher's environment names the processes on the node", "[system][host]") {
    std::map<std::string, std::string> env;
    auto get = [&](const char* name) -> const char* {
        const auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
    };
    CHECK(detail::launcher_local_processes(get) == 1);
    env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "3";
    CHECK(detail::launcher_local_processes(get) == 3);
    env["MPI_LOCALNRANKS"] = "2"; // MPICH's Hydra comes first
    CHECK(detail::launcher_local_processes(get) == 2);
    env["MPI_LOCALNRANKS"] = "0"; // not a count: the next variable
    CHECK(detail::launcher_local_processes(get) == 3);
    env.clear();
    env["SLURM_NTASKS_PER_NODE"] = "2(x3)"; // not a plain number
    CHECK(detail::launcher_local_processes(get) == 1);
}

TEST_CASE("the budget never exceeds the cores this process may use", "[system][host]") {
    const int cores = host_system::hardware_threads();
    CHECK(cores >= 1);
    CHECK(cores <= std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
    if (const auto a = detail::affinity_cores())
        CHECK(cores <= *a);
    if (const auto q = detail::cgroup_quota_cores())
        CHECK(cores <= *q);
}

// Run by CTest alone (`test_host_cores [pinned]`, a process of its own, so host_system has not
// read its cores yet) with MPI_LOCALNRANKS=2 and without OMP_NUM_THREADS: the process pins
// itself to its first allowed CPU, as taskset would, and shares the node with 2 processes.
TEST_CASE("a process pinned to one core, beside another, gets one thread", "[.][pinned]") {
    REQUIRE(host_system::omp_env_threads() == 0);
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    REQUIRE(sched_getaffinity(0, sizeof(allowed), &allowed) == 0);
    int first = 0;
    while (!CPU_ISSET(first, &allowed))
        ++first;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    REQUIRE(sched_setaffinity(0, sizeof(one), &one) == 0);
    REQUIRE(detail::affinity_cores() == 1);
    CHECK(host_system::hardware_threads() == 1);
    CHECK(host_system::node_processes() == 2);
    CHECK(host_system::default_threads(1) == 1);
    CHECK(host_system{}.threads() == 1);
}

// Run by CTest with MPI_LOCALNRANKS=2 and no OMP_NUM_THREADS: each process of the two on the
// node gets half the cores.
TEST_CASE("two processes on the node share its cores", "[.][shared_node]") {
    REQUIRE(host_system::omp_env_threads() == 0);
    const int cores = host_system::hardware_threads();
    CHECK(host_system::node_processes() == 2);
    CHECK(host_system::default_threads(1) == std::max(1, cores / 2));
    CHECK(host_system::default_threads(2) == std::max(1, cores / 4));
}

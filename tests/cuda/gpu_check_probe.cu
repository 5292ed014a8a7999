// gpu_check_probe: what scripts/gpu_run.py asks a GPU machine before its stages: the runtime
// versions, one kernel launch (whether ncu can read counters) and an N-rank NCCL all_reduce.
// SPDX-License-Identifier: Apache-2.0
//
// usage: gpu_check_probe versions | kernel | nccl [--ranks N]
// Exit 0: done; 77: no CUDA device (the probe could not run); 1: it ran and failed, with the
// answer of CUDA or NCCL on stderr. The NCCL ranks are processes (fork + exec of this binary,
// so none inherits the parent's CUDA state). With fewer devices than ranks, each rank gets its
// own NCCL_HOSTID and talks through sockets on lo: NCCL refuses two ranks of one host on one
// device.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <csignal>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

std::string who();

// A failed CUDA or NCCL call ends the probe through main's catch, naming the call and the answer.
struct probe_failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void check(cudaError_t status, const char* what) {
    if (status != cudaSuccess)
        throw probe_failure(who() + ": " + what + " failed: " + cudaGetErrorString(status));
}

void check(ncclResult_t status, const char* what) {
    if (status != ncclSuccess)
        throw probe_failure(who() + ": " + what + " failed: " + ncclGetErrorString(status) + " (" +
                            ncclGetLastError(nullptr) + ")");
}

std::string who() {
    const char* rank = std::getenv("LOCKSTEP_PROBE_RANK");
    return rank ? "gpu_check_probe rank " + std::string(rank) : "gpu_check_probe";
}

int devices() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

int versions() {
    int runtime = 0;
    int driver = 0;
    int nccl = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    ncclGetVersion(&nccl);
    std::printf("cuda_runtime %d\ncuda_driver %d\nnccl %d\nnccl_headers %d\ndevices %d\n", runtime,
                driver, nccl, NCCL_VERSION_CODE, devices());
    return 0;
}

__global__ void add_one(int* x) {
    ++*x;
}

int kernel() {
    if (devices() == 0)
        return 77;
    int* x = nullptr;
    check(cudaMalloc(&x, sizeof(int)), "cudaMalloc");
    check(cudaMemset(x, 0, sizeof(int)), "cudaMemset");
    add_one<<<1, 1>>>(x);
    check(cudaGetLastError(), "cudaGetLastError");
    int host = 0;
    check(cudaMemcpy(&host, x, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaFree(x), "cudaFree");
    if (host != 1) {
        std::fprintf(stderr, "gpu_check_probe: the kernel wrote %d, expected 1\n", host);
        return 1;
    }
    std::puts("kernel ok");
    return 0;
}

// One rank: joins the communicator whose id the parent passed in hex, sums rank + 1 over ranks.
int nccl_rank() {
    const int rank = std::atoi(std::getenv("LOCKSTEP_PROBE_RANK"));
    const int ranks = std::atoi(std::getenv("LOCKSTEP_PROBE_RANKS"));
    const char* hex = std::getenv("LOCKSTEP_PROBE_ID");
    ncclUniqueId id{};
    for (std::size_t i = 0; i < sizeof(id.internal); ++i)
        id.internal[i] =
            static_cast<char>(std::strtol(std::string(hex + 2 * i, 2).c_str(), nullptr, 16));
    check(cudaSetDevice(rank % devices()), "cudaSetDevice");
    ncclComm_t comm = nullptr;
    check(ncclCommInitRank(&comm, ranks, id, rank), "ncclCommInitRank");
    float* x = nullptr;
    check(cudaMalloc(&x, sizeof(float)), "cudaMalloc");
    const float mine = static_cast<float>(rank + 1);
    check(cudaMemcpy(x, &mine, sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    check(ncclAllReduce(x, x, 1, ncclFloat, ncclSum, comm, nullptr), "ncclAllReduce");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    float sum = 0;
    check(cudaMemcpy(&sum, x, sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(ncclCommFinalize(comm), "ncclCommFinalize");
    check(ncclCommDestroy(comm), "ncclCommDestroy");
    check(cudaFree(x), "cudaFree");
    const float expected = static_cast<float>(ranks * (ranks + 1) / 2);
    if (sum != expected) {
        std::fprintf(stderr, "%s: all_reduce gave %g, expected %g\n", who().c_str(), sum, expected);
        return 1;
    }
    std::printf("%s: all_reduce of %d ranks ok (%g)\n", who().c_str(), ranks, sum);
    return 0;
}

// The parent: the id, then one exec'd child per rank; 0 only when every rank exits 0.
int nccl_parent(int ranks) {
    const int n = devices();
    if (n == 0)
        return 77;
    setenv("NCCL_SOCKET_IFNAME", "lo", 1); // as the rank launcher: the interface the tests use
    ncclUniqueId id{};
    check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::string hex;
    for (const char c : id.internal) {
        char byte[3];
        std::snprintf(byte, sizeof byte, "%02x", static_cast<unsigned char>(c));
        hex += byte;
    }
    const bool distinct_hosts = n < ranks;
    std::printf("%d ranks on %d devices%s\n", ranks, n,
                distinct_hosts ? " (distinct NCCL_HOSTID, sockets on lo)" : "");
    std::fflush(stdout);
    std::vector<pid_t> children;
    for (int r = 0; r < ranks; ++r) {
        // The child's environment is built here: between fork and exec only async-signal-safe
        // calls (NCCL's bootstrap thread may hold the allocator's lock at the fork).
        std::vector<std::string> env{"LOCKSTEP_PROBE_RANK=" + std::to_string(r),
                                     "LOCKSTEP_PROBE_RANKS=" + std::to_string(ranks),
                                     "LOCKSTEP_PROBE_ID=" + hex};
        if (distinct_hosts)
            env.insert(env.end(), {"NCCL_HOSTID=gpu-check-probe-" + std::to_string(r),
                                   "NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_NET=Socket"});
        for (char** e = environ; *e != nullptr; ++e) {
            const std::string kv(*e);
            const std::string key = kv.substr(0, kv.find('=') + 1);
            if (std::none_of(env.begin(), env.end(),
                             [&](const std::string& x) { return x.starts_with(key); }))
                env.push_back(kv);
        }
        std::vector<char*> envp;
        for (std::string& kv : env)
            envp.push_back(kv.data());
        envp.push_back(nullptr);
        char* argv[] = {const_cast<char*>("gpu_check_probe"), const_cast<char*>("nccl-rank"),
                        nullptr};
        const pid_t pid = fork();
        if (pid < 0) {
            std::perror("gpu_check_probe: fork");
            return 1;
        }
        if (pid == 0) {
            execve("/proc/self/exe", argv, envp.data());
            static const char msg[] = "gpu_check_probe: execve failed\n";
            (void)!write(2, msg, sizeof msg - 1);
            _exit(127);
        }
        children.push_back(pid);
    }
    // A rank that fails leaves the others waiting in NCCL: they get 10 s, then SIGKILL.
    int failed = 0;
    std::size_t running = children.size();
    auto deadline = std::chrono::steady_clock::time_point::max();
    while (running > 0) {
        int status = 0;
        const pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) {
            if (std::chrono::steady_clock::now() > deadline) {
                for (std::size_t r = 0; r < children.size(); ++r)
                    if (children[r] > 0) {
                        std::fprintf(stderr, "gpu_check_probe: rank %zu killed: a peer failed\n",
                                     r);
                        kill(children[r], SIGKILL);
                    }
                deadline = std::chrono::steady_clock::time_point::max();
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            continue;
        }
        std::size_t r = 0;
        while (r < children.size() && children[r] != pid)
            ++r;
        if (r == children.size())
            continue;
        children[r] = -1;
        --running;
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
            continue;
        ++failed;
        deadline = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(10));
        if (WIFSIGNALED(status))
            std::fprintf(stderr, "gpu_check_probe: rank %zu died of signal %d\n", r,
                         WTERMSIG(status));
        else
            std::fprintf(stderr, "gpu_check_probe: rank %zu exited %d\n", r, WEXITSTATUS(status));
    }
    return failed == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    try {
        if (mode == "versions")
            return versions();
        if (mode == "kernel")
            return kernel();
        if (mode == "nccl-rank")
            return nccl_rank();
        if (mode == "nccl") {
            const int ranks =
                argc > 3 && std::string(argv[2]) == "--ranks" ? std::atoi(argv[3]) : 2;
            return nccl_parent(ranks < 1 ? 2 : ranks);
        }
    } catch (const probe_failure& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
    std::fprintf(stderr, "usage: gpu_check_probe versions | kernel | nccl [--ranks N]\n");
    return 2;
}

// Temporary stand-in for lockstep/comm/gpu_group.hpp until that header is merged: the subset of
// its API these tests and examples use. SPDX-License-Identifier: Apache-2.0
#pragma once

#if __has_include("lockstep/comm/gpu_group.hpp")
#include "lockstep/comm/gpu_group.hpp"
#else
#include "lockstep/comm/nccl_communicator.hpp"

#include <chrono>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

namespace lockstep {

struct gpu_group_params {
    std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

class gpu_group {
public:
    using params = gpu_group_params;
    explicit gpu_group(params p = {}) : gpu_group(all(), p) {}
    explicit gpu_group(std::vector<int> devices, params p = {})
        : devices_(std::move(devices)), p_(p) {}
    int size() const noexcept { return static_cast<int>(devices_.size()); }

    template <class F>
    void run(F&& f) {
        auto comms = nccl_communicator::init_all(devices_, nccl_options{.timeout = p_.timeout});
        std::mutex m;
        std::exception_ptr first, root;
        std::vector<std::thread> threads;
        for (std::size_t r = 0; r < comms.size(); ++r)
            threads.emplace_back([&, r] {
                try {
                    LOCKSTEP_CUDA_CHECK(cudaSetDevice(comms[r].device()));
                    f(comms[r]);
                } catch (const error& e) {
                    const std::lock_guard<std::mutex> lock(m);
                    if (!first)
                        first = std::current_exception();
                    if (!root && e.code() != errc::peer_failure)
                        root = std::current_exception();
                    comms[r].abort();
                } catch (...) {
                    const std::lock_guard<std::mutex> lock(m);
                    if (!first)
                        first = std::current_exception();
                    if (!root)
                        root = std::current_exception();
                    comms[r].abort();
                }
            });
        for (auto& t : threads)
            t.join();
        comms.clear();
        if (root || first)
            std::rethrow_exception(root ? root : first);
    }

private:
    static std::vector<int> all() {
        std::vector<int> d(static_cast<std::size_t>(cuda_device_count()));
        std::iota(d.begin(), d.end(), 0);
        return d;
    }
    std::vector<int> devices_;
    params p_;
};

} // namespace lockstep
#endif

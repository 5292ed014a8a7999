// examples/comm_demo/comm_demo.cpp: replicas as threads of one process run every thread_group
// collective on data that differs per replica, check the results, time all_reduce, and show
// that a failing replica turns into an error on every replica instead of a hang.
// SPDX-License-Identifier: Apache-2.0
#include <lockstep/comm/thread_group.hpp>
#include <lockstep/system/buffer.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Small integers keep every float sum exact, so results can be compared with ==.
float gradient_value(int rank, std::size_t i) {
    return static_cast<float>((rank + 1) * static_cast<int>(i % 17) - 8);
}

struct timing {
    std::size_t bytes;
    int iterations;
    double seconds; // per all_reduce, rank 0's view between two barriers
};

// Checks one condition on one replica; a false check throws, and thread_group::run rethrows it.
void check(bool ok, int rank, const char* what) {
    if (!ok)
        throw std::runtime_error("replica " + std::to_string(rank) + ": wrong " + what);
}

} // namespace

int main(int argc, char** argv) {
    const int replicas = argc > 1 ? std::atoi(argv[1]) : 4;
    const std::size_t max_mib = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 64;
    if (replicas < 1 || max_mib < 1) {
        std::fprintf(stderr, "usage: comm_demo [replicas >= 1] [largest all_reduce in MiB]\n");
        return 2;
    }
    std::printf("lockstep %d.%d.%d comm_demo: %d replicas as threads, %d host threads each\n",
                lockstep::version.major, lockstep::version.minor, lockstep::version.patch, replicas,
                lockstep::host_system::default_threads(replicas));

    // 1. Every collective once, with data that differs per replica, checked on every replica.
    constexpr std::size_t n = 100003; // prime: chunk ownership never divides evenly
    std::vector<float> losses(static_cast<std::size_t>(replicas));
    lockstep::thread_group group(replicas);
    group.run([&](lockstep::thread_communicator& comm) {
        const int r = comm.rank();
        const int p = comm.size();
        const auto sys = comm.system();

        // broadcast: replica 0's initial weights reach everyone.
        lockstep::buffer<float> weights(n, sys);
        for (std::size_t i = 0; i < n; ++i)
            weights[i] = r == 0 ? static_cast<float>(i % 101) : -1;
        comm.broadcast(weights.span(), 0);
        for (std::size_t i = 0; i < n; ++i)
            check(weights[i] == static_cast<float>(i % 101), r, "broadcast");

        // all_reduce: the sum of every replica's gradient, exact against a serial reference.
        lockstep::buffer<float> grad(n, sys);
        lockstep::buffer<float> sum(n, sys);
        for (std::size_t i = 0; i < n; ++i)
            grad[i] = gradient_value(r, i);
        const auto& cgrad = grad;
        comm.all_reduce(cgrad.span(), sum.span(), lockstep::reduce_op::sum);
        for (std::size_t i = 0; i < n; ++i) {
            double expected = 0;
            for (int q = 0; q < p; ++q)
                expected += gradient_value(q, i);
            check(sum[i] == expected, r, "all_reduce sum");
        }

        // all_gather: one loss per replica, in rank order.
        lockstep::buffer<float> my_loss(1, sys);
        lockstep::buffer<float> all_loss(static_cast<std::size_t>(p), sys);
        my_loss[0] = 2.5f - 0.25f * static_cast<float>(r);
        const auto& cmy = my_loss;
        comm.all_gather(cmy.span(), all_loss.span());
        for (int q = 0; q < p; ++q)
            check(all_loss[q] == 2.5f - 0.25f * static_cast<float>(q), r, "all_gather");
        if (r == 0)
            std::copy(all_loss.begin(), all_loss.end(), losses.begin());

        // reduce: only the root's result is defined; max over replicas.
        lockstep::buffer<int> steps(1, sys);
        lockstep::buffer<int> max_steps(1, sys);
        steps[0] = 10 * (r + 1);
        const auto& csteps = steps;
        comm.reduce(csteps.span(), max_steps.span(), lockstep::reduce_op::max, 0);
        if (r == 0)
            check(max_steps[0] == 10 * p, r, "reduce max");

        // split: even and odd replicas form sub-groups (as group-wise batch norm does).
        auto sub = comm.split(r % 2, r);
        lockstep::buffer<int> id(1, sys);
        lockstep::buffer<int> id_sum(1, sys);
        id[0] = r;
        const auto& cid = id;
        sub.all_reduce(cid.span(), id_sum.span(), lockstep::reduce_op::sum);
        int expected_ids = 0;
        for (int q = r % 2; q < p; q += 2)
            expected_ids += q;
        check(id_sum[0] == expected_ids, r, "sub-group all_reduce");
        comm.barrier();
    });
    std::printf("broadcast, all_reduce, all_gather, reduce, split: correct on all %d replicas\n",
                replicas);
    std::printf("losses gathered in rank order:");
    for (float l : losses)
        std::printf(" %.2f", static_cast<double>(l));
    std::printf("\n\n");

    // 2. all_reduce timing, with one thread's memcpy of the same bytes as the anchor.
    std::vector<timing> timings;
    group.run([&](lockstep::thread_communicator& comm) {
        const int r = comm.rank();
        for (std::size_t bytes = 4096; bytes <= max_mib << 20; bytes *= 4) {
            const std::size_t count = bytes / sizeof(float);
            lockstep::buffer<float> send(count, comm.system());
            lockstep::buffer<float> recv(count, comm.system());
            std::fill(send.begin(), send.end(), static_cast<float>(r));
            const auto& csend = send;
            const int iterations = bytes >= (std::size_t{16} << 20) ? 5 : 50;
            comm.all_reduce(csend.span(), recv.span(), lockstep::reduce_op::sum); // warm-up
            comm.barrier();
            const auto t0 = clock_type::now();
            for (int it = 0; it < iterations; ++it) {
                comm.all_reduce(csend.span(), recv.span(), lockstep::reduce_op::sum);
            }
            comm.barrier();
            const double per_call = seconds_since(t0) / iterations;
            // 0 + 1 + ... + (p - 1): send holds the rank.
            const int rank_sum = comm.size() * (comm.size() - 1) / 2;
            const auto expected = static_cast<float>(rank_sum);
            check(recv[0] == expected && recv[count - 1] == expected, r, "timed all_reduce");
            if (r == 0)
                timings.push_back({bytes, iterations, per_call});
        }
    });
    std::printf("%12s %10s %12s %14s %16s\n", "bytes", "calls", "time/call", "algbw GB/s",
                "memcpy GB/s (1t)");
    for (const timing& t : timings) {
        std::vector<char> a(t.bytes, 1), b(t.bytes);
        std::memcpy(b.data(), a.data(), t.bytes); // fault the pages in first
        const auto t0 = clock_type::now();
        for (int it = 0; it < t.iterations; ++it) {
            std::memcpy((it % 2 ? a : b).data(), (it % 2 ? b : a).data(), t.bytes);
        }
        const double copy = seconds_since(t0) / t.iterations;
        std::printf("%12zu %10d %10.1f us %14.2f %16.2f\n", t.bytes, t.iterations, t.seconds * 1e6,
                    static_cast<double>(t.bytes) / t.seconds / 1e9,
                    static_cast<double>(t.bytes) / copy / 1e9);
    }

    // 3. A replica that fails mid-training: its peers get an error, run() rethrows the first.
    std::atomic<int> peers_told{0};
    try {
        group.run([&](lockstep::thread_communicator& comm) {
            lockstep::buffer<float> g(1024, comm.system());
            std::fill(g.begin(), g.end(), 1.0f);
            if (comm.rank() == replicas - 1)
                throw std::runtime_error("simulated data loader crash");
            try {
                const auto& cg = g;
                comm.all_reduce(cg.span(), g.span(), lockstep::reduce_op::sum);
            } catch (const lockstep::error&) {
                ++peers_told;
                throw;
            }
        });
        std::printf("\nerror demo: run() returned normally, which it must not\n");
        return 1;
    } catch (const std::exception& e) {
        std::printf("\nerror demo: replica %d threw; %d peers got lockstep::error instead of "
                    "hanging; run() rethrew: %s\n",
                    replicas - 1, peers_told.load(), e.what());
        if (peers_told.load() != replicas - 1) {
            std::printf("error demo: expected %d peers to get lockstep::error\n", replicas - 1);
            return 1;
        }
    }
    std::printf("comm_demo: every check passed\n");
    return 0;
}

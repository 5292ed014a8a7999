// The GPU trainer tests' runner: trains tn::test_net (gpu_test_net.hpp) on any communicator and
// logs what each replica saw, plus the double reference and the checks the GPU trainer cases share
// (test_trainer_gpu.cu over NCCL, test_shared_gpu.cu on one shared GPU). SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "gpu_test_net.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace lockstep_test::gpu_train {

using namespace lockstep;
namespace tn = lockstep_test::net;

inline constexpr double lr = 0.05;
inline constexpr double momentum = 0.9;
using small_buckets = reduce::bucketed<32, 16>; // 9 tensors, 1280 bytes: 8 buckets

/// What one replica saw: parameters after every step (and after finish()), losses, buckets,
/// host synchronisations per step, the error it ended with.
struct run_log {
    std::vector<std::vector<float>> params;
    std::vector<double> losses;
    std::vector<std::uint64_t> syncs;
    std::size_t buckets = 0;
    std::string error;
    errc code = errc::internal;
    bool failed = false;
};

template <class T, class System>
std::vector<T> to_host(std::span<const T> s, const System& sys) {
    std::vector<T> h(s.size());
    copy(s, sys, std::span<T>(h), host_system{});
    return h;
}

/// Trains `steps` steps of global batch `batch` on this replica; read_each: train_params'
/// read_result (else read_result() is called after each step, outside the counted region).
template <class Sync, class Reduce, class BN, bool Visitor = false, class Comm>
run_log train(Comm& comm, int steps, std::size_t batch, tn::knobs k = {}, bool read_each = true) {
    using net_t = tn::test_net<Comm, BN, Visitor>;
    using system_type = typename Comm::system_type;
    using trainer_t = data_parallel<net_t, optim::sgd<float, system_type>, Sync, Reduce, Comm>;
    const std::size_t cap = batch / static_cast<std::size_t>(comm.size()) + 1;
    run_log log;
    trainer_t trainer(comm, [&](auto& ctx) { return net_t(ctx, cap, k); },
                      {.lr = lr, .momentum = momentum}, {.read_result = read_each});
    log.buckets = trainer.buckets().size();
    for (int s = 0; s < steps; ++s) {
        const auto before = host_sync_count();
        step_result r =
            trainer.step(batch, [](net_t& n, shard_range sr, auto& ctx) { n.train(sr, ctx); });
        log.syncs.push_back(host_sync_count() - before);
        if (!r.ready)
            r = trainer.read_result();
        log.losses.push_back(r.loss);
        log.params.push_back(to_host(std::span<const float>(trainer.parameters()), comm.system()));
    }
    trainer.finish();
    log.params.push_back(to_host(std::span<const float>(trainer.parameters()), comm.system()));
    return log;
}

/// Runs f(comm) -> run_log on every replica of `group` (a gpu_group, a shared_gpu_group, ...)
/// and returns the logs by rank; a replica's lockstep::error is recorded in its log.
template <class Group, class F>
std::vector<run_log> run_logged(Group& group, F f) {
    std::vector<run_log> logs(static_cast<std::size_t>(group.size()));
    try {
        group.run([&](auto& comm) {
            run_log& log = logs[static_cast<std::size_t>(comm.rank())];
            try {
                log = f(comm);
            } catch (const error& e) {
                log.failed = true;
                log.error = e.what();
                log.code = e.code();
                throw;
            }
        });
    } catch (const error&) {
        // Recorded per replica; the cases check the logs.
    }
    return logs;
}

/// The same on a thread group of `replicas` host replicas.
template <class F>
std::vector<run_log> on_threads(int replicas, F f) {
    std::vector<run_log> logs(static_cast<std::size_t>(replicas));
    thread_group group(replicas, {.timeout = std::chrono::seconds(60)});
    group.run(
        [&](thread_communicator& comm) { logs[static_cast<std::size_t>(comm.rank())] = f(comm); });
    return logs;
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
        m = std::max(m, std::abs(double(a[i]) - double(b[i])));
    return m;
}

inline void require_clean(const std::vector<run_log>& logs) {
    for (const auto& l : logs) {
        INFO(l.error);
        REQUIRE(!l.failed);
    }
}

/// Every replica holds the same bits as replica 0 after every step.
inline void check_bitwise_replicas(const std::vector<run_log>& logs) {
    for (const auto& l : logs) {
        REQUIRE(l.params.size() == logs[0].params.size());
        for (std::size_t s = 0; s < l.params.size(); ++s)
            CHECK(l.params[s] == logs[0].params[s]);
    }
}

/// The double reference of steps 0..steps-1 of global batch `batch`: parameters and losses.
inline std::pair<std::vector<std::vector<double>>, std::vector<double>>
reference_run(int steps, std::size_t batch) {
    tn::reference ref;
    std::vector<std::vector<double>> params;
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
        std::vector<std::uint64_t> keys(batch);
        for (std::size_t p = 0; p < batch; ++p)
            keys[p] = static_cast<std::uint64_t>(s) * batch + p;
        losses.push_back(ref.step(keys, lr, momentum));
        params.push_back(ref.parameters());
    }
    return {params, losses};
}

/// |got - want| <= tol (1 + |want|) for every parameter.
inline void check_against(const std::vector<float>& got, const std::vector<double>& want,
                          double tol) {
    REQUIRE(got.size() == want.size());
    std::size_t bad = 0;
    for (std::size_t i = 0; i < want.size(); ++i)
        bad += std::abs(double(got[i]) - want[i]) > tol * (1 + std::abs(want[i]));
    CHECK(bad == 0);
}

/// The policy combinations the GPU trainers are compared with the host thread group in, and their
/// tolerances: the exact reducers differ from the host only in summation order and FMA contraction
/// (2e-5 absolute after 4 steps); compressed<bfloat16> may round a gradient element to the other
/// neighbouring bfloat16 when host and device differ in its last float bits (2^-8 relative, times
/// lr and momentum over 4 steps: 2e-3 absolute).
template <class Sync, class Reduce, class BN, int TolExp>
struct combination {
    using sync_policy = Sync;
    using reduce_policy = Reduce;
    using bn_policy = BN;
    static double tolerance() { return TolExp == 3 ? 2e-3 : 2e-5; }
};
using per_tensor_case = combination<sync::synchronous, reduce::per_tensor, bn::global, 5>;
using bucketed_case = combination<sync::synchronous, small_buckets, bn::global, 5>;
using ps_case = combination<sync::synchronous, reduce::parameter_server<0>, bn::global, 5>;
using bf16_case =
    combination<sync::synchronous, reduce::compressed<lockstep::bfloat16>, bn::global, 3>;
using local_sgd_case = combination<sync::local_sgd<2>, small_buckets, bn::local, 5>;
} // namespace lockstep_test::gpu_train

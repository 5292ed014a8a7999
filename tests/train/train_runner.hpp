// tests/train/train_runner.hpp: runs the test network under data_parallel on a thread group and
// records every replica's parameters after every step; comparison helpers.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "mlp_fixture.hpp"

#include "lockstep/comm/thread_group.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace lockstep_test {

/// The global batch sizes of the 20 steps: uneven splits (37 over 4), an empty replica (3 over
/// 4), and a few others, cycled.
inline std::vector<std::size_t> batch_schedule(std::size_t steps = 20) {
    const std::size_t cycle[] = {37, 3, 12, 7, 20};
    std::vector<std::size_t> out(steps);
    for (std::size_t i = 0; i < steps; ++i)
        out[i] = cycle[i % 5];
    return out;
}

/// Everything a run records.
template <class T>
struct run_record {
    std::vector<std::vector<std::vector<T>>> params; ///< [rank][step] flat parameter values
    std::vector<std::vector<std::vector<T>>> state;  ///< [rank][step] BN running mean and var
    std::vector<std::vector<step_result>> results;   ///< [rank][step]
    std::vector<tensor_info> layout;                 ///< the parameter tensors (rank 0)
    std::vector<std::size_t> collectives;            ///< per rank: reducer collectives issued
};

/// Options of one run besides the policies.
struct run_options {
    int replicas = 1;
    std::vector<std::size_t> batches = batch_schedule();
    int micro_batches = 1;
    bool mark_ready = true;
    mlp_shape shape = {};
    int poison_rank = -1; ///< this replica's gradient gets a NaN at step poison_step
    int poison_step = -1;
    bool skip_non_finite = true;
    overlap_mode overlap = overlap_mode::automatic;
    std::vector<int>* overlapped = nullptr; ///< if set: per rank, trainer.overlaps() (int:
                                            ///< vector<bool> packs ranks into one word)
};

/// One training run of mlp<T, thread_communicator, S, BN> with data_parallel<..., Opt, Sync,
/// Reduce> on `o.replicas` threads.
template <class T, class Opt, class Sync, class Reduce, storage S, class BN = bn::global>
run_record<T> train_run(const run_options& o, typename Opt::params_type op = {}) {
    using net = mlp<T, thread_communicator, S, BN>;
    run_record<T> rec;
    const auto R = static_cast<std::size_t>(o.replicas);
    rec.params.resize(R);
    rec.state.resize(R);
    rec.results.resize(R);
    rec.collectives.resize(R);
    thread_group group(o.replicas);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        data_parallel<net, Opt, Sync, Reduce, thread_communicator> dp(
            comm, [&](auto& ctx) { return net(ctx, o.shape); }, op,
            {.micro_batches = o.micro_batches,
             .skip_non_finite = o.skip_non_finite,
             .overlap = o.overlap,
             .seed = 42});
        if (o.overlapped != nullptr)
            (*o.overlapped)[r] = dp.overlaps();
        if (r == 0)
            rec.layout = dp.registry().parameters();
        for (std::size_t s = 0; s < o.batches.size(); ++s) {
            dp.network().poison =
                comm.rank() == o.poison_rank && static_cast<int>(s) == o.poison_step;
            rec.results[r].push_back(
                dp.step(o.batches[s], [&](net& n, const shard_range& range, auto& ctx) {
                    return n.train(range, ctx, o.mark_ready);
                }));
            auto p = dp.parameters();
            rec.params[r].emplace_back(p.begin(), p.end());
            auto& bnl = dp.network().batch_norm();
            std::vector<T> st(bnl.running_mean().begin(), bnl.running_mean().end());
            st.insert(st.end(), bnl.running_var().begin(), bnl.running_var().end());
            rec.state[r].push_back(std::move(st));
        }
        if constexpr (is_local_sgd_v<Sync>) {
            dp.finish();
            auto p = dp.parameters();
            rec.params[r].emplace_back(p.begin(), p.end());
        }
        rec.collectives[r] = dp.collectives();
    });
    return rec;
}

/// The largest normwise relative difference over tensors: max over tensors t of
/// max_i |a_i - b_i| / max_i |b_i| (tensor t's elements of the flat buffers a, b).
template <class T>
double max_tensor_rel_error(const std::vector<T>& a, const std::vector<T>& b,
                            const std::vector<tensor_info>& layout) {
    double worst = 0;
    for (const tensor_info& t : layout) {
        double diff = 0, ref = 0;
        for (std::size_t i = t.offset; i < t.offset + t.size; ++i) {
            diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
            ref = std::max(ref, std::abs(double(b[i])));
        }
        worst = std::max(worst, ref > 0 ? diff / ref : diff);
    }
    return worst;
}

/// max_i |a_i - b_i| / max_i |b_i| over whole vectors.
template <class T>
double rel_error(const std::vector<T>& a, const std::vector<T>& b) {
    return max_tensor_rel_error(a, b, {tensor_info{"all", {a.size()}, 0, a.size()}});
}

/// The first (rank, step) whose parameters differ in any bit from rank 0's at that step, or
/// "" when every replica holds identical bits after every step.
template <class T>
std::string first_divergence(const run_record<T>& rec) {
    for (std::size_t r = 1; r < rec.params.size(); ++r)
        for (std::size_t s = 0; s < rec.params[r].size(); ++s) {
            const auto& a = rec.params[r][s];
            const auto& b = rec.params[0][s];
            if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) != 0)
                return "replica " + std::to_string(r) + " step " + std::to_string(s);
        }
    return "";
}

} // namespace lockstep_test

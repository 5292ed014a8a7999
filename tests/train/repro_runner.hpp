// tests/train/repro_runner.hpp: trains the test network with reduce::reproducible<8> and
// bn::ghost<8> on any communicator and records every bit a step depends on.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "mlp_fixture.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/sgd.hpp"

#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace lockstep_test {

/// The chunk size of the reproducible tests: 37 = 4 x 8 + 5, and every chunk of the schedule
/// has at least 2 samples (ghost BN needs more than one value per channel).
inline constexpr std::size_t repro_chunk = 8;
using repro_reduce = reduce::reproducible<repro_chunk>;
/// The same sums exchanged by blocks at every size (the test network is small enough for
/// repro_reduce to gather every chunk to every replica).
using repro_blocks = reduce::reproducible<repro_chunk, 0>;
using repro_bn = bn::ghost<repro_chunk>;

/// 50 steps of uneven global batches: 37, 3, 12, 7, 20, 64, 10 (cycled).
inline std::vector<std::size_t> repro_schedule(std::size_t steps = 50) {
    const std::size_t cycle[] = {37, 3, 12, 7, 20, 64, 10};
    std::vector<std::size_t> out(steps);
    for (std::size_t i = 0; i < steps; ++i)
        out[i] = cycle[i % 7];
    return out;
}

/// Everything a reproducible run must agree on, from one replica.
template <class T>
struct repro_record {
    std::vector<T> params;             ///< after the last step
    std::vector<std::vector<T>> state; ///< optimizer state slots after the last step
    std::vector<T> running;            ///< BN running mean, then running var
    std::int64_t batches_tracked = 0;  ///< BN num_batches_tracked
    std::int64_t optimizer_steps = 0;  ///< the optimizer's applied steps
    std::vector<double> losses;        ///< every step's loss
    std::vector<std::vector<T>> trace; ///< parameters after every step
};

/// The first difference between two records in any bit ("" when identical).
template <class T>
std::string repro_difference(const repro_record<T>& a, const repro_record<T>& b) {
    const auto differs = [](const auto& x, const auto& y) {
        using E = typename std::decay_t<decltype(x)>::value_type;
        return x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * sizeof(E)) != 0;
    };
    for (std::size_t s = 0; s < a.trace.size() && s < b.trace.size(); ++s)
        if (differs(a.trace[s], b.trace[s]))
            return "parameters after step " + std::to_string(s);
    if (differs(a.params, b.params))
        return "parameters";
    if (a.state.size() != b.state.size())
        return "optimizer state slot count";
    for (std::size_t k = 0; k < a.state.size(); ++k)
        if (differs(a.state[k], b.state[k]))
            return "optimizer state slot " + std::to_string(k);
    if (differs(a.running, b.running))
        return "BN running statistics";
    if (a.batches_tracked != b.batches_tracked)
        return "num_batches_tracked";
    if (a.optimizer_steps != b.optimizer_steps)
        return "optimizer step count";
    if (differs(a.losses, b.losses))
        return "losses";
    return "";
}

/// Puts what dp holds after its last step into rec: parameters, optimizer state, the BN layer's
/// running statistics and count, the optimizer's step count.
template <class T, class DP>
void record_final(repro_record<T>& rec, DP& dp) {
    auto p = dp.parameters();
    rec.params.assign(p.begin(), p.end());
    for (const auto& slot : dp.optimizer().state().slots)
        rec.state.emplace_back(slot.data.begin(), slot.data.end());
    auto& bnl = dp.network().batch_norm();
    rec.running.assign(bnl.running_mean().begin(), bnl.running_mean().end());
    rec.running.insert(rec.running.end(), bnl.running_var().begin(), bnl.running_var().end());
    rec.batches_tracked = bnl.num_batches_tracked();
    rec.optimizer_steps = dp.optimizer().step_count();
}

/// One replica's part of a reproducible run over comm (collective). `BN` and `Reduce` default to
/// the ghost / reproducible pair; `shape.batch_norm = false` makes the BN layer the identity;
/// `mark_ready`: the backward marks each tensor ready as it finishes it (else none).
template <class T, class Opt, class Comm, class Reduce = repro_reduce, class BN = repro_bn>
repro_record<T> repro_train(Comm& comm, typename Opt::params_type op,
                            const std::vector<std::size_t>& batches, mlp_shape shape = {},
                            bool mark_ready = true) {
    using net = mlp<T, Comm, storage::registry, BN>;
    data_parallel<net, Opt, sync::synchronous, Reduce, Comm> dp(
        comm, [&](auto& ctx) { return net(ctx, shape); }, op, {.seed = 42});
    repro_record<T> rec;
    for (std::size_t b : batches) {
        const step_result r = dp.step(b, [&](net& n, const shard_range& range, auto& ctx) {
            return n.train(range, ctx, mark_ready);
        });
        rec.losses.push_back(r.loss);
        auto p = dp.parameters();
        rec.trace.emplace_back(p.begin(), p.end());
    }
    record_final(rec, dp);
    return rec;
}

/// repro_train on `replicas` thread replicas; every replica's record (rank order).
template <class T, class Opt, class Reduce = repro_reduce, class BN = repro_bn>
std::vector<repro_record<T>> repro_threads(int replicas, typename Opt::params_type op,
                                           const std::vector<std::size_t>& batches,
                                           mlp_shape shape = {}, bool mark_ready = true) {
    std::vector<repro_record<T>> out(static_cast<std::size_t>(replicas));
    thread_group group(replicas);
    group.run([&](thread_communicator& comm) {
        out[static_cast<std::size_t>(comm.rank())] =
            repro_train<T, Opt, thread_communicator, Reduce, BN>(comm, op, batches, shape,
                                                                 mark_ready);
    });
    return out;
}

/// One parameter "w" of 3 elements whose chunk gradients (chunks of repro_chunk samples) are,
/// at element 0, float's largest value in every chunk when `overflow` (the sum of 2 chunks or
/// more is beyond float's range), else 1; at element 1, 0.25 (c + 1); at element 2, a NaN in
/// chunk `nan_chunk` and 2^-20 c in the others. The backward marks w ready.
template <class Context>
struct extreme_net {
    typename Context::handle w;
    bool overflow = false;
    std::size_t nan_chunk = std::numeric_limits<std::size_t>::max();
    explicit extreme_net(Context& ctx) : w(ctx.registry().add("w", {3})) {}
    double train(const shard_range& r, Context& ctx) {
        const std::size_t c = r.begin / repro_chunk;
        const std::span<float> g = w.grad();
        if (!r.empty()) {
            g[0] += overflow ? std::numeric_limits<float>::max() : 1.0f;
            g[1] += 0.25f * static_cast<float>(c + 1);
            g[2] += c == nan_chunk ? std::numeric_limits<float>::quiet_NaN()
                                   : std::ldexp(static_cast<float>(c), -20);
        }
        ctx.mark_ready(w);
        return 0.0;
    }
};

/// What one step of 32 samples (4 chunks) of extreme_net under Reduce throws on this replica
/// ("" when nothing), non-finite gradients reported as errors (skip_non_finite = false).
template <class Reduce, class Comm>
std::string extreme_step_message(Comm& comm, bool overflow, std::size_t nan_chunk) {
    using net = extreme_net<replica_context<float, Comm>>;
    data_parallel<net, optim::sgd<float>, sync::synchronous, Reduce, Comm> dp(
        comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.5f}, {.skip_non_finite = false});
    dp.network().overflow = overflow;
    dp.network().nan_chunk = nan_chunk;
    try {
        dp.step(32,
                [](net& n, const shard_range& range, auto& ctx) { return n.train(range, ctx); });
    } catch (const error& e) {
        return e.what();
    }
    return "";
}

} // namespace lockstep_test

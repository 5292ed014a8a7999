// tests/train/resize_runner.hpp: trains the test network on any communicator with a checkpoint
// loaded or saved, for the tests of loading at another replica count; every replica's state.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "checkpoint_support.hpp"
#include "repro_runner.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace lockstep_test {

inline train_params params_for(std::uint64_t seed) {
    return {.lr =
                optim::linear_scaling{
                    .base_lr = 0.05, .base_batch = 8, .global_batch = 16, .warmup_steps = 8},
            .seed = seed};
}

/// Uneven global batches (37 over 4 replicas, 9 over 2...), at least one sample per replica.
inline std::size_t batch_of(std::int64_t step) {
    const std::size_t cycle[] = {37, 9, 12, 7, 20};
    return cycle[static_cast<std::size_t>(step) % 5];
}

/// One replica's state: what a later step depends on.
template <class T>
struct replica_state {
    std::vector<T> params;
    std::vector<T> running; ///< BN running mean, then running variance
    std::vector<std::vector<T>> slots;
    std::int64_t optimizer_steps = 0;
    std::int64_t steps = 0;
    std::uint64_t samples = 0;
    std::uint64_t seed = 0;
};

template <class Opt, class Reduce, class BN, class Comm = thread_communicator>
using resize_trainer = data_parallel<mlp<typename Opt::value_type, Comm, storage::registry, BN>,
                                     Opt, sync::synchronous, Reduce, Comm>;

/// One replica of comm: a trainer built with `seed`, loaded from `load` (if any), stepped until
/// `steps`, saved to `save` (if any); its state at the end (collective).
template <class Opt, class Reduce, class BN, class Comm>
replica_state<typename Opt::value_type>
train_replica(Comm& comm, typename Opt::params_type op, std::uint64_t seed, std::size_t steps,
              const fs::path& load = {}, const fs::path& save = {}) {
    using T = typename Opt::value_type;
    using dp_type = resize_trainer<Opt, Reduce, BN, Comm>;
    using net = typename dp_type::network_type;
    dp_type dp(
        comm, [](auto& ctx) { return net(ctx); }, op, params_for(seed));
    if (!load.empty())
        load_checkpoint(dp, load);
    while (static_cast<std::size_t>(dp.steps()) < steps)
        dp.step(batch_of(dp.steps()),
                [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
    if (!save.empty())
        save_checkpoint(dp, save);
    replica_state<T> s;
    s.params.assign(dp.parameters().begin(), dp.parameters().end());
    auto& bn = dp.network().batch_norm();
    s.running.assign(bn.running_mean().begin(), bn.running_mean().end());
    s.running.insert(s.running.end(), bn.running_var().begin(), bn.running_var().end());
    for (const auto& slot : dp.optimizer().state().slots)
        s.slots.emplace_back(slot.data.begin(), slot.data.end());
    s.optimizer_steps = dp.optimizer().step_count();
    s.steps = dp.steps();
    s.samples = dp.samples();
    s.seed = dp.context().seed();
    return s;
}

/// train_replica on `replicas` thread replicas; every replica's state (rank order).
template <class Opt, class Reduce, class BN>
std::vector<replica_state<typename Opt::value_type>>
run(int replicas, typename Opt::params_type op, std::uint64_t seed, std::size_t steps,
    const fs::path& load = {}, const fs::path& save = {}) {
    std::vector<replica_state<typename Opt::value_type>> out(static_cast<std::size_t>(replicas));
    thread_group(replicas).run([&](thread_communicator& comm) {
        out[static_cast<std::size_t>(comm.rank())] =
            train_replica<Opt, Reduce, BN>(comm, op, seed, steps, load, save);
    });
    return out;
}

/// Slot k of the logical (unsharded) optimizer state: the replicas' slots concatenated in rank
/// order (sharded) or replica `source`'s.
template <class T>
std::vector<T> logical_slot(const std::vector<replica_state<T>>& run, std::size_t k, bool sharded,
                            int source = 0) {
    if (!sharded)
        return run[static_cast<std::size_t>(source)].slots[k];
    std::vector<T> out;
    for (const auto& r : run)
        out.insert(out.end(), r.slots[k].begin(), r.slots[k].end());
    return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// max |a - b| / max(1, max |b|).
template <class T>
double relative_distance(const std::vector<T>& a, const std::vector<T>& b) {
    if (a.size() != b.size())
        return 1e300;
    double diff = 0, scale = 1;
    for (std::size_t i = 0; i < a.size(); ++i) {
        diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
        scale = std::max(scale, std::abs(static_cast<double>(b[i])));
    }
    return diff / scale;
}

/// One replica of a reduce::reproducible<8> / bn::ghost<8> run over `batches` (Adam): built with
/// `seed`, loaded from `load` (if any); with `save`, saved after step save_at and stopped there.
/// Records the losses of the steps it ran (collective).
template <class Comm>
repro_record<float> repro_replica(Comm& comm, const std::vector<std::size_t>& batches,
                                  std::uint64_t seed, const fs::path& load, const fs::path& save,
                                  std::size_t save_at) {
    using net = mlp<float, Comm, storage::registry, repro_bn>;
    data_parallel<net, optim::adam<float>, sync::synchronous, repro_reduce, Comm> dp(
        comm, [](auto& ctx) { return net(ctx); }, {.lr = 1e-2}, {.seed = seed});
    if (!load.empty())
        load_checkpoint(dp, load);
    repro_record<float> rec;
    while (static_cast<std::size_t>(dp.steps()) < batches.size()) {
        const auto b = batches[static_cast<std::size_t>(dp.steps())];
        rec.losses.push_back(dp.step(b, [](net& n, const shard_range& r, auto& ctx) {
                                   return n.train(r, ctx);
                               }).loss);
        if (!save.empty() && static_cast<std::size_t>(dp.steps()) == save_at) {
            save_checkpoint(dp, save);
            break;
        }
    }
    rec.params.assign(dp.parameters().begin(), dp.parameters().end());
    for (const auto& slot : dp.optimizer().state().slots)
        rec.state.emplace_back(slot.data.begin(), slot.data.end());
    auto& bnl = dp.network().batch_norm();
    rec.running.assign(bnl.running_mean().begin(), bnl.running_mean().end());
    rec.running.insert(rec.running.end(), bnl.running_var().begin(), bnl.running_var().end());
    // num_batches_tracked is left out: the test network does not expose it as state.
    rec.optimizer_steps = dp.optimizer().step_count();
    return rec;
}

/// repro_replica on `replicas` thread replicas; every replica's record.
inline std::vector<repro_record<float>>
repro_threads_resumed(int replicas, const std::vector<std::size_t>& batches, std::uint64_t seed,
                      const fs::path& load = {}, const fs::path& save = {},
                      std::size_t save_at = 0) {
    std::vector<repro_record<float>> out(static_cast<std::size_t>(replicas));
    thread_group(replicas).run([&](thread_communicator& comm) {
        out[static_cast<std::size_t>(comm.rank())] =
            repro_replica(comm, batches, seed, load, save, save_at);
    });
    return out;
}

} // namespace lockstep_test

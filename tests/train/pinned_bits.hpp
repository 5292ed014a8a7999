// tests/train/pinned_bits.hpp: golden-bit support of the train tests: 64-bit FNV-1a, the pinned
// table check (LOCKSTEP_PRINT_STEP_BITS=1 prints instead), and a runner that trains the test
// network on any communicator and hashes its end state through the public trainer API only.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "mlp_fixture.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace lockstep_test {

/// 64-bit FNV-1a.
struct fnv1a {
    std::uint64_t h = 0xcbf29ce484222325ull;
    void bytes(const void* p, std::size_t n) {
        const auto* b = static_cast<const unsigned char*>(p);
        for (std::size_t i = 0; i < n; ++i) {
            h ^= b[i];
            h *= 0x100000001b3ull;
        }
    }
    template <class E>
    void span(std::span<E> s) {
        bytes(s.data(), s.size_bytes());
    }
    template <class V>
    void value(const V& v) {
        static_assert(std::is_trivially_copyable_v<V>);
        bytes(&v, sizeof v);
    }
};

inline std::string hex(std::uint64_t v) {
    char buf[19];
    std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
    return buf;
}

/// LOCKSTEP_PRINT_STEP_BITS=1: print every hash in the form of a pinned table's lines.
inline bool print_bits_mode() {
    const char* e = std::getenv("LOCKSTEP_PRINT_STEP_BITS");
    return e != nullptr && std::strcmp(e, "1") == 0;
}

/// Compares `actual` with the constant `table` pins for `name` (printing the table line when
/// print_bits_mode()).
inline void check_pinned(const std::map<std::string, std::uint64_t>& table, const std::string& name,
                         std::uint64_t actual) {
    if (print_bits_mode())
        std::printf("    {\"%s\", %sull},\n", name.c_str(), hex(actual).c_str());
    const auto it = table.find(name);
    INFO("configuration: " << name);
    INFO("expected: " << (it == table.end() ? std::string("(none pinned)") : hex(it->second)));
    INFO("actual:   " << hex(actual));
    CHECK(it != table.end());
    if (it != table.end())
        CHECK(it->second == actual);
}

/// The 8 global batches of the pinned runs: uneven over 2 and 3 replicas, at least 2 samples per
/// replica for bn::local at 3 replicas, every chunk of 8 at least 2 samples for bn::ghost<8>.
inline std::vector<std::size_t> pinned_schedule() {
    return {37, 8, 12, 7, 20, 64, 10, 37};
}

/// Options of one hashed run besides the policies.
struct bits_options {
    train_params tp = {};
    std::vector<std::size_t> batches;
    mlp_shape shape = {};
};

/// What one replica of a hashed run ends with.
struct replica_bits {
    /// The FNV-1a of what every replica must hold alike: the flat parameters, the BN running
    /// mean, var and num_batches_tracked, and every step's loss, skip decision and loss scale.
    std::uint64_t common = 0;
    /// The FNV-1a of this replica's optimizer state slots (a shard of it under a policy with
    /// shards_optimizer_state; none but the root's under reduce::parameter_server) and step
    /// count.
    std::uint64_t state = 0;
    /// dp.collectives() after each step (how many collectives the reducer issued so far).
    std::vector<std::size_t> collectives;
};

/// The state hash pinned for a run: common of replica 0, then the state hash of replica 0, or
/// of every replica in rank order when Reduce shards the optimizer state. A function of the
/// logical state, so (for reduce::reproducible) the same at every replica count. Under local
/// SGD (`per_replica`), whose replicas keep their own BN statistics, losses and optimizer
/// state: every replica's common and state, in rank order.
template <class Reduce, bool per_replica = false>
std::uint64_t combine_bits(const std::vector<replica_bits>& replicas) {
    fnv1a h;
    if constexpr (per_replica) {
        for (const replica_bits& r : replicas) {
            h.value(r.common);
            h.value(r.state);
        }
        return h.h;
    }
    h.value(replicas.at(0).common);
    if constexpr (Reduce::shards_optimizer_state) {
        for (const replica_bits& r : replicas)
            h.value(r.state);
    } else {
        h.value(replicas.at(0).state);
    }
    return h.h;
}

/// Trains mlp<T, Comm, registry, BN> under data_parallel<..., Opt, Sync, Reduce, Comm> on this
/// replica (collective over comm; seed 42) and hashes its end state through the public API. The
/// step function multiplies the loss's backward seed by ctx.loss_scale() (1 without loss
/// scaling, an exact multiplication) and returns the unscaled loss.
template <class T, class Opt, class Sync, class Reduce, class BN, class Comm>
replica_bits hashed_run(Comm& comm, bits_options o, typename Opt::params_type op = {}) {
    using net = mlp<T, Comm, storage::registry, BN>;
    o.tp.seed = 42;
    data_parallel<net, Opt, Sync, Reduce, Comm> dp(
        comm, [&](auto& ctx) { return net(ctx, o.shape); }, op, o.tp);
    replica_bits out;
    fnv1a steps;
    for (std::size_t b : o.batches) {
        const step_result r = dp.step(b, [](net& n, const shard_range& range, auto& ctx) {
            shard_range scaled = range;
            scaled.scale *= ctx.loss_scale();
            return n.train(scaled, ctx) / ctx.loss_scale();
        });
        steps.value(r.loss);
        steps.value(static_cast<unsigned char>(r.skipped));
        steps.value(r.loss_scale);
        out.collectives.push_back(dp.collectives());
    }
    if constexpr (is_local_sgd_v<Sync>)
        dp.finish();
    fnv1a common;
    common.span(dp.parameters());
    auto& bnl = dp.network().batch_norm();
    common.span(bnl.running_mean());
    common.span(bnl.running_var());
    common.value(static_cast<std::int64_t>(bnl.num_batches_tracked()));
    common.value(steps.h);
    out.common = common.h;
    fnv1a state;
    for (const auto& slot : dp.optimizer().state().slots)
        state.span(std::span<const T>(slot.data));
    state.value(static_cast<std::int64_t>(dp.optimizer().step_count()));
    out.state = state.h;
    return out;
}

} // namespace lockstep_test

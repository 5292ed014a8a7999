// Checkpoints loaded at another replica count on thread replicas: right after the load every
// replica holds bitwise the saved logical state (parameters, BN statistics of replica 0, the
// optimizer state, regathered and resplit with reduce::sharded), a run continued at the new
// count stays within a stated tolerance of an uninterrupted run at that count, and
// reduce::reproducible continues to the bits of the uninterrupted run for every pair of counts
// 1..4. Local SGD and the asynchronous trainers refuse another count on every replica, naming
// both counts. SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "resize_runner.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

using namespace lockstep_test;

namespace {

/// Saves after 5 steps with `from` replicas, loads into `to` replicas built with another seed:
/// (1) right after the load every replica holds bitwise the saved parameters, the BN running
/// statistics of replica `source`, the logical optimizer state (regathered over shards with
/// reduce::sharded) and the counters; (2) after 11 steps the parameters are within `tolerance`
/// (relative_distance) of an uninterrupted run at `to` replicas, while a run without the load is
/// not (tolerance < 0: no such comparison, e.g. bn::local, whose math depends on the split).
template <class Opt, class Reduce, class BN = bn::global>
void check_resize(int from, int to, typename Opt::params_type op, double tolerance,
                  int source = 0) {
    using T = typename Opt::value_type;
    constexpr bool sharded = Reduce::shards_optimizer_state;
    INFO(from << " -> " << to << " replicas, " << Reduce::name());
    temp_dir dir;
    const fs::path path = dir.path / "resize.ckpt";
    const auto saved = run<Opt, Reduce, BN>(from, op, 42, 5, {}, path);
    const auto loaded = run<Opt, Reduce, BN>(to, op, 7, 5, path);
    const auto& src = saved[static_cast<std::size_t>(source)];
    REQUIRE(!src.slots.empty());
    for (std::size_t k = 0; k < src.slots.size(); ++k) {
        INFO("optimizer slot " << k);
        const std::vector<T> want = logical_slot(saved, k, sharded, source);
        CHECK(same_bits(logical_slot(loaded, k, sharded), want));
        if (sharded) // each new replica holds its shard of the new layout
            for (int r = 0; r < to; ++r)
                CHECK(
                    loaded[static_cast<std::size_t>(r)].slots[k].size() ==
                    detail::shard_layout(src.params.size(), to)[static_cast<std::size_t>(r)].count);
    }
    for (int r = 0; r < to; ++r) {
        INFO("new replica " << r);
        const auto& l = loaded[static_cast<std::size_t>(r)];
        CHECK(same_bits(l.params, src.params));
        CHECK(same_bits(l.running, src.running));
        if (!sharded)
            for (std::size_t k = 0; k < l.slots.size(); ++k)
                CHECK(same_bits(l.slots[k], src.slots[k]));
        CHECK(l.optimizer_steps == src.optimizer_steps);
        CHECK(l.steps == 5);
        CHECK(l.samples == src.samples);
        CHECK(l.seed == 42);
    }
    const auto resumed = run<Opt, Reduce, BN>(to, op, 7, 11, path);
    const auto full = run<Opt, Reduce, BN>(to, op, 42, 11);
    const auto other = run<Opt, Reduce, BN>(to, op, 7, 11);
    for (int r = 0; r < to; ++r) {
        INFO("new replica " << r);
        const auto i = static_cast<std::size_t>(r);
        const double d = relative_distance(resumed[i].params, full[i].params);
        if (tolerance >= 0) {
            CHECK(d <= tolerance);
            CHECK(relative_distance(other[i].params, full[i].params) > 10 * tolerance);
        }
        CHECK(resumed[i].steps == 11);
    }
}

} // namespace

TEST_CASE("a checkpoint saved by N replicas resumes at M replicas, every synchronous policy",
          "[train][checkpoint][thread]") {
    // Double precision: runs at two replica counts differ only in the order of their sums
    // (measured: below 1e-15).
    constexpr double tol_double = 1e-12;
    const optim::sgd_params momentum{.lr = 0.05, .momentum = 0.9};
    using sgd_d = optim::sgd<double>;
    using adam_d = optim::adam<double>;
    SECTION("per_tensor, SGD momentum") {
        for (auto [n, m] : {std::pair{2, 3}, {3, 2}, {4, 1}})
            check_resize<sgd_d, reduce::per_tensor>(n, m, momentum, tol_double);
    }
    SECTION("bucketed, Adam") {
        for (auto [n, m] : {std::pair{2, 3}, {3, 2}, {4, 1}})
            check_resize<adam_d, reduce::bucketed<64, 32>>(n, m, {.lr = 1e-2}, tol_double);
    }
    SECTION("parameter_server<1>: the root's optimizer state, SGD momentum") {
        for (auto [n, m] : {std::pair{2, 3}, {3, 2}})
            check_resize<sgd_d, reduce::parameter_server<1>>(n, m, momentum, tol_double, 1);
    }
    SECTION("parameter_server<0>, Adam") {
        check_resize<adam_d, reduce::parameter_server<0>>(4, 1, {.lr = 1e-2}, tol_double);
    }
    SECTION("compressed<bfloat16>, float, SGD momentum") {
        // Each replica's contribution is rounded to bfloat16 (2^-9 relative): the split changes
        // the rounding, so runs at two counts differ by that order (measured: 1.1e-3).
        for (auto [n, m] : {std::pair{2, 3}, {3, 2}, {4, 1}})
            check_resize<optim::sgd<float>, reduce::compressed<bfloat16>>(n, m, momentum, 1e-2);
    }
    SECTION("sharded (ZeRO-1): optimizer state regathered and resplit, Adam") {
        for (auto [n, m] : {std::pair{2, 3}, {3, 2}, {4, 1}, {1, 4}, {3, 4}})
            check_resize<adam_d, reduce::sharded<64, 32>>(n, m, {.lr = 1e-2}, tol_double);
    }
    SECTION("sharded, SGD momentum, float (measured: 1.7e-7)") {
        for (auto [n, m] : {std::pair{2, 3}, {4, 3}})
            check_resize<optim::sgd<float>, reduce::sharded<64, 32>>(n, m, momentum, 1e-5);
    }
    SECTION("bn::local: every new replica takes replica 0's running statistics") {
        // Control: the saved replicas' statistics differ (each saw its own samples).
        temp_dir dir;
        const auto saved =
            run<sgd_d, reduce::per_tensor, bn::local>(2, momentum, 42, 5, {}, dir.path / "x");
        CHECK(!same_bits(saved[0].running, saved[1].running));
        // Local batch statistics depend on the split: no comparison with the run at M.
        for (auto [n, m] : {std::pair{2, 3}, {3, 2}})
            check_resize<sgd_d, reduce::per_tensor, bn::local>(n, m, momentum, -1);
    }
}

TEST_CASE("reduce::reproducible resumed at any replica count continues to the same bits",
          "[train][checkpoint][thread][reproducible]") {
    const std::vector<std::size_t> batches = repro_schedule(12);
    constexpr std::size_t save_at = 5;
    auto train = [&](int replicas, std::uint64_t seed, const fs::path& load, const fs::path& save) {
        return repro_threads_resumed(replicas, batches, seed, load, save, save_at);
    };
    std::vector<repro_record<float>> full; // per count; losses of the steps after save_at
    for (int m = 1; m <= 4; ++m) {
        full.push_back(train(m, 42, {}, {})[0]);
        full.back().losses.erase(full.back().losses.begin(), full.back().losses.begin() + save_at);
    }
    // Control: another seed gives other bits (losses compared over the same steps, so the
    // difference is in the values, not in the number of losses kept).
    auto other = train(2, 7, {}, {})[0];
    other.losses.erase(other.losses.begin(), other.losses.begin() + save_at);
    CHECK(other.params != full[0].params);
    CHECK(!repro_difference(other, full[0]).empty());
    for (int n = 1; n <= 4; ++n) {
        temp_dir dir;
        const fs::path path = dir.path / "repro.ckpt";
        train(n, 42, {}, path);
        for (int m = 1; m <= 4; ++m) {
            INFO("saved by " << n << " replicas, resumed by " << m);
            // The uninterrupted runs agree at every count (the policy's promise).
            CHECK(repro_difference(full[static_cast<std::size_t>(m - 1)], full[0]).empty());
            for (const auto& rec : train(m, 7, path, {})) {
                CHECK(repro_difference(rec, full[static_cast<std::size_t>(m - 1)]).empty());
            }
        }
    }
}

namespace {

/// Builds `replicas` trainers of type DP (seed 99, 2 train() calls or steps), loads `path`;
/// every replica's message (empty: loaded) and whether its state stayed as it was.
template <class DP, class Step>
std::vector<std::pair<std::string, bool>> try_load(int replicas, const fs::path& path,
                                                   typename DP::optimizer_type::params_type op,
                                                   Step&& step) {
    using net = typename DP::network_type;
    std::vector<std::pair<std::string, bool>> out(static_cast<std::size_t>(replicas));
    thread_group(replicas).run([&](thread_communicator& comm) {
        DP dp(
            comm, [](auto& ctx) { return net(ctx); }, op, params_for(99));
        step(dp);
        const std::vector<float> before(dp.parameters().begin(), dp.parameters().end());
        auto& o = out[static_cast<std::size_t>(comm.rank())];
        try {
            load_checkpoint(dp, path);
        } catch (const lockstep::error& e) {
            o.first = e.code() == errc::checkpoint ? e.what() : "wrong code";
        }
        o.second =
            same_bits(std::vector<float>(dp.parameters().begin(), dp.parameters().end()), before);
    });
    return out;
}

template <class Sync, class BN>
using refused_trainer =
    data_parallel<mlp<float, thread_communicator, storage::registry, BN>, optim::sgd<float>, Sync,
                  reduce::per_tensor, thread_communicator>;

} // namespace

TEST_CASE("local SGD refuses another replica count on every replica, nothing loaded",
          "[train][checkpoint][thread]") {
    const optim::sgd_params op{.lr = 0.05, .momentum = 0.9};
    temp_dir dir;
    const fs::path path = dir.path / "refused.ckpt";
    using dp_type = refused_trainer<sync::local_sgd<3>, bn::running_only>;
    auto steps = [](dp_type& dp) {
        for (int s = 0; s < 2; ++s)
            dp.step(batch_of(s), [](dp_type::network_type& n, const shard_range& r, auto& ctx) {
                return n.train(r, ctx);
            });
    };
    try_load<dp_type>(2, path, op, [&](dp_type& dp) {
        steps(dp);
        save_checkpoint(dp, path);
    });
    for (const auto& [message, unchanged] : try_load<dp_type>(3, path, op, steps)) {
        INFO(message);
        CHECK(message.find("load_checkpoint: checkpoint '" + path.string() +
                           "' refused: every replica: saved by 2 replicas, loaded by 3: "
                           "sync::local_sgd<3> keeps each replica's own parameters and optimizer "
                           "state between averages, which no other replica count can take over; "
                           "resume with 2 replicas") != std::string::npos);
        CHECK(unchanged);
    }
    // Control: the same count loads.
    for (const auto& [message, unchanged] : try_load<dp_type>(2, path, op, steps))
        CHECK(message.empty());
}

namespace {

/// Asynchronous training with the server on replica `root`: `from` replicas train 6 steps and
/// save; `to` replicas built with another seed and the server on `new_root` (-1: `root`) load:
/// each holds the saved server's state (parameters, BN statistics, optimizer buffers and step
/// count, steps, seed) and trains on. Not compared with an uninterrupted run: the server applies
/// gradients in their order of arrival.
template <class Sync>
void check_async_resize(int from, int to, int root, int new_root = -1) {
    if (new_root < 0)
        new_root = root;
    using dp_type = refused_trainer<Sync, bn::local>;
    using net = typename dp_type::network_type;
    INFO(Sync::name() << ", " << from << " -> " << to << " replicas, server " << root << " -> "
                      << new_root);
    auto fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
    const optim::sgd_params op{.lr = 0.05, .momentum = 0.9};
    temp_dir dir;
    const fs::path path = dir.path / "async.ckpt";
    auto state_of = [](dp_type& dp) {
        replica_state<float> s;
        s.params.assign(dp.parameters().begin(), dp.parameters().end());
        auto& bn = dp.network().batch_norm();
        s.running.assign(bn.running_mean().begin(), bn.running_mean().end());
        s.running.insert(s.running.end(), bn.running_var().begin(), bn.running_var().end());
        for (const auto& slot : dp.optimizer().state().slots)
            s.slots.emplace_back(slot.data.begin(), slot.data.end());
        s.optimizer_steps = dp.optimizer().step_count();
        s.steps = dp.steps();
        s.seed = dp.context().seed();
        return s;
    };
    replica_state<float> server;
    thread_group(from).run([&](thread_communicator& comm) {
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, op, params_for(42), {.root = root});
        dp.train(6, 8, fn);
        save_checkpoint(dp, path);
        if (comm.rank() == root)
            server = state_of(dp);
    });
    REQUIRE(server.optimizer_steps > 0);
    std::vector<replica_state<float>> loaded(static_cast<std::size_t>(to));
    std::vector<std::int64_t> after(static_cast<std::size_t>(to));
    thread_group(to).run([&](thread_communicator& comm) {
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, op, params_for(7), {.root = new_root});
        load_checkpoint(dp, path);
        loaded[static_cast<std::size_t>(comm.rank())] = state_of(dp);
        dp.train(4, 8, fn);
        after[static_cast<std::size_t>(comm.rank())] = dp.steps();
    });
    for (int r = 0; r < to; ++r) {
        INFO("new replica " << r);
        const auto& l = loaded[static_cast<std::size_t>(r)];
        CHECK(same_bits(l.params, server.params));
        CHECK(same_bits(l.running, server.running));
        REQUIRE(l.slots.size() == server.slots.size());
        for (std::size_t k = 0; k < l.slots.size(); ++k)
            CHECK(same_bits(l.slots[k], server.slots[k]));
        CHECK(l.optimizer_steps == server.optimizer_steps);
        CHECK(l.steps == 6);
        CHECK(l.seed == 42);
        CHECK(after[static_cast<std::size_t>(r)] == 10);
    }
}

} // namespace

TEST_CASE("the asynchronous trainers resume at another replica count from the server's shard",
          "[train][checkpoint][thread][async]") {
    check_async_resize<sync::asynchronous>(3, 2, 0);
    check_async_resize<sync::asynchronous>(2, 4, 1);
    check_async_resize<sync::bounded_staleness<1>>(3, 2, 1);
}

TEST_CASE("an asynchronous checkpoint resumes with another server at any replica count",
          "[train][checkpoint][thread][async]") {
    check_async_resize<sync::asynchronous>(3, 2, 2, 0);
    check_async_resize<sync::asynchronous>(3, 4, 2, 0);
    check_async_resize<sync::asynchronous>(3, 3, 2, 0); // the same count: the server's shard
    check_async_resize<sync::bounded_staleness<1>>(3, 2, 2, 1);
}

TEST_CASE("reduce::sharded at another count: a corrupted old shard is refused on every replica",
          "[train][checkpoint][thread]") {
    using opt = optim::adam<double>;
    using reduce_type = reduce::sharded<64, 32>;
    temp_dir dir;
    const fs::path path = dir.path / "sharded.ckpt";
    run<opt, reduce_type, bn::global>(2, {.lr = 1e-2}, 42, 3, {}, path);
    // One bit of replica 1's exp_avg_sq: only the new replicas whose shard overlaps it read it.
    const fs::path file = shard_file(path, 1);
    std::vector<std::byte> bytes = read_all(file);
    const auto h = ck::parse_header(bytes, ck::shard_magic, "shard");
    const auto sec = h.find_section("optimizer.exp_avg_sq");
    REQUIRE(sec);
    bytes[sec->offset + sec->length - 1] ^= std::byte{0x10};
    write_all(file, bytes);
    std::vector<std::string> messages(3);
    std::vector<int> refused(3);
    std::vector<std::int64_t> steps(3, -1);
    using dp_type = resize_trainer<opt, reduce_type, bn::global>;
    using net = dp_type::network_type;
    thread_group(3).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 1e-2}, params_for(7));
        try {
            load_checkpoint(dp, path);
        } catch (const lockstep::error& e) {
            refused[static_cast<std::size_t>(comm.rank())] = e.code() == errc::checkpoint;
            messages[static_cast<std::size_t>(comm.rank())] = e.what();
        }
        // Catch2 assertions stay on the main thread (they are not thread-safe).
        steps[static_cast<std::size_t>(comm.rank())] = dp.steps();
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO(messages[r]);
        CHECK(steps[r] == 0);
        CHECK(refused[r]);
        CHECK(messages[r].find("replica 2: shard '" + file.string() +
                               "': section 'optimizer.exp_avg_sq' is corrupted") !=
              std::string::npos);
    }
}

TEST_CASE("a checkpoint with the first releases' shard names loads at another count",
          "[train][checkpoint][thread]") {
    // Files of the unchanged format (version 1) under the first shard names
    // ("<path>.<generation>.shard<rank>"): the old shards, read whole and in part, still load.
    using opt = optim::adam<double>;
    using reduce_type = reduce::sharded<64, 32>;
    temp_dir dir;
    const fs::path path = dir.path / "old.ckpt";
    const auto saved = run<opt, reduce_type, bn::global>(2, {.lr = 1e-2}, 42, 3, {}, path);
    const auto marker = read_all(path);
    const auto gen =
        *ck::parse_header(marker, ck::manifest_magic, "marker").find_meta("generation");
    for (int r = 0; r < 2; ++r) {
        const std::string legacy = "old.ckpt." + gen + ".shard" + std::to_string(r);
        fs::rename(shard_file(path, r), dir.path / legacy);
        set_marker_value(path, "shard." + std::to_string(r) + ".file", legacy);
    }
    const auto loaded = run<opt, reduce_type, bn::global>(3, {.lr = 1e-2}, 7, 3, path);
    for (std::size_t k = 0; k < saved[0].slots.size(); ++k)
        CHECK(same_bits(logical_slot(loaded, k, true), logical_slot(saved, k, true)));
    for (const auto& l : loaded)
        CHECK(same_bits(l.params, saved[0].params));
}

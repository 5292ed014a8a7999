// Checkpoints of data_parallel on thread replicas: resuming is bitwise equal to not stopping
// (synchronous, local SGD mid-period, parameter server; registry and visitor networks with BN
// running statistics, dropout and an LR warm-up), incompatible checkpoints are refused with every
// difference and leave the trainer unchanged (counters and optimizer step out of range, a save
// committed while the replicas load, another frozen set included), every corruption is refused,
// a save that crashes at any stage leaves the previous checkpoint loadable, a schedule defined
// for the run's steps only (a table) saves and resumes, and a save that would leave out a
// batch-norm layer's unexposed running statistics is refused.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "checkpoint_support.hpp"
#include "support/bn_probe.hpp"
#include "support/contains.hpp"
#include "support/replica_errors.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/async_checkpoint.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

using namespace lockstep_test;

namespace {

/// The warm-up runs over the first 8 steps: checkpoints at step 3 or 5 resume inside it.
/// warmup < 0: no schedule (the optimizer's learning rate at every step).
train_params params_for(std::uint64_t seed, std::int64_t warmup = 8) {
    if (warmup < 0)
        return {.seed = seed};
    return {.lr =
                optim::linear_scaling{
                    .base_lr = 0.05, .base_batch = 8, .global_batch = 16, .warmup_steps = warmup},
            .seed = seed};
}

/// One run: construct (seed), optionally load, step until `steps`, optionally save at `save_at`.
struct plan {
    int replicas = 2;
    std::uint64_t seed = 42;
    std::size_t steps = 10;
    fs::path load = {};
    fs::path save = {};
    std::size_t save_at = 0;
    std::int64_t warmup = 8;                      ///< params_for's
    std::function<void(train_params&)> edit = {}; ///< changes params_for's (when set)
};

/// Local SGD cannot share batch statistics inside a step: it averages running statistics; the
/// asynchronous trainers keep them per replica (the server's travel with the parameters).
template <class Sync>
using bn_for =
    std::conditional_t<is_asynchronous_v<Sync>, bn::local,
                       std::conditional_t<is_local_sgd_v<Sync>, bn::running_only, bn::global>>;

template <class Opt, class Sync, class Reduce, storage S, class T = typename Opt::value_type>
using trainer_of = data_parallel<mlp<T, thread_communicator, S, bn_for<Sync>>, Opt, Sync, Reduce,
                                 thread_communicator>;

/// Global batches of uneven splits over 2 and 3 replicas, at least 2 samples per replica (local
/// SGD normalizes with each replica's own batch statistics), cycled.
std::size_t batch_of(std::int64_t step) {
    const std::size_t cycle[] = {37, 9, 12, 7, 20};
    return cycle[static_cast<std::size_t>(step) % 5];
}

/// Steps dp until it has taken `steps` steps, the global batch of step s being batch_of(s).
template <class DP>
void step_to(DP& dp, std::size_t steps, const fs::path& save = {}, std::size_t save_at = 0) {
    while (static_cast<std::size_t>(dp.steps()) < steps) {
        dp.step(batch_of(dp.steps()),
                [](auto& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
        if (!save.empty() && static_cast<std::size_t>(dp.steps()) == save_at)
            save_checkpoint(dp, save);
    }
}

/// Runs a plan; returns every replica's fingerprint at the end.
template <class Opt, class Sync, class Reduce, storage S>
std::vector<std::vector<std::byte>> run(const plan& p, typename Opt::params_type op) {
    using dp_type = trainer_of<Opt, Sync, Reduce, S>;
    using net = typename dp_type::network_type;
    std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(p.replicas));
    thread_group group(p.replicas);
    group.run([&](thread_communicator& comm) {
        train_params tp = params_for(p.seed, p.warmup);
        if (p.edit)
            p.edit(tp);
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, op, tp);
        if (!p.load.empty())
            load_checkpoint(dp, p.load);
        step_to(dp, p.steps, p.save, p.save_at);
        out[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
    });
    return out;
}

/// Saving after `save_at` steps and resuming in new trainers built with another seed (and other
/// initial weights) ends bitwise where the uninterrupted run ends, on every replica.
template <class Opt, class Sync, class Reduce, storage S>
void check_resume(int replicas, typename Opt::params_type op, std::size_t save_at = 5,
                  std::size_t total = 11) {
    temp_dir dir;
    const fs::path path = dir.path / "run.ckpt";
    const auto full = run<Opt, Sync, Reduce, S>({.replicas = replicas, .steps = total}, op);
    run<Opt, Sync, Reduce, S>(
        {.replicas = replicas, .steps = save_at, .save = path, .save_at = save_at}, op);
    const auto resumed = run<Opt, Sync, Reduce, S>(
        {.replicas = replicas, .seed = 7, .steps = total, .load = path}, op);
    // Control: the seed matters to this network (dropout), so only a restored seed matches.
    const auto other =
        run<Opt, Sync, Reduce, S>({.replicas = replicas, .seed = 7, .steps = total}, op);
    for (int r = 0; r < replicas; ++r) {
        INFO("replica " << r);
        CHECK(resumed[r] == full[r]);
        CHECK(other[r] != full[r]);
    }
}

} // namespace

TEST_CASE("resuming from a checkpoint is bitwise equal to an uninterrupted run",
          "[train][checkpoint][thread]") {
    SECTION("synchronous, per_tensor, registry, SGD momentum, 3 replicas") {
        check_resume<optim::sgd<float>, sync::synchronous, reduce::per_tensor, storage::registry>(
            3, {.lr = 0.05, .momentum = 0.9});
    }
    SECTION("synchronous, bucketed, visitor, Adam, 2 replicas") {
        check_resume<optim::adam<float>, sync::synchronous, reduce::bucketed<64, 32>,
                     storage::visitor>(2, {.lr = 1e-2});
    }
    SECTION("local SGD<3>, resumed mid-period, registry, SGD momentum, 3 replicas") {
        check_resume<optim::sgd<float>, sync::local_sgd<3>, reduce::per_tensor, storage::registry>(
            3, {.lr = 0.05, .momentum = 0.9}, 5, 11);
    }
    SECTION("local SGD<4>, resumed mid-period, visitor, Adam, 2 replicas") {
        check_resume<optim::adam<float>, sync::local_sgd<4>, reduce::per_tensor, storage::visitor>(
            2, {.lr = 1e-2}, 6, 11);
    }
    SECTION("parameter_server<1>, registry, SGD momentum, 3 replicas") {
        check_resume<optim::sgd<double>, sync::synchronous, reduce::parameter_server<1>,
                     storage::registry>(3, {.lr = 0.05, .momentum = 0.9});
    }
    SECTION("parameter_server<0>, visitor, AdamW, 2 replicas") {
        check_resume<optim::adamw<float>, sync::synchronous, reduce::parameter_server<0>,
                     storage::visitor>(2, {.lr = 1e-2});
    }
}

namespace {

/// What a refused load did on every replica.
struct refusal {
    std::vector<std::string> messages; ///< per replica (empty: it did not throw)
    bool all_refused = true;           ///< every replica threw lockstep::error (checkpoint)
    bool unchanged = true;             ///< every trainer's fingerprint is what it was before
    bool trains_after = true;          ///< a step after the refused load works
};

/// Builds trainers (seed 99, 2 steps taken; `edit` changes params_for's parameters), tries to
/// load `path`, records the outcome.
template <class Opt, class Sync, class Reduce, storage S, class T = typename Opt::value_type>
refusal try_load(int replicas, const fs::path& path, typename Opt::params_type op,
                 mlp_shape shape = {}, std::int64_t warmup = 8,
                 const std::function<void(train_params&)>& edit = {}) {
    using dp_type = trainer_of<Opt, Sync, Reduce, S, T>;
    using net = typename dp_type::network_type;
    refusal out;
    out.messages.resize(static_cast<std::size_t>(replicas));
    std::vector<int> refused(static_cast<std::size_t>(replicas)),
        same(static_cast<std::size_t>(replicas)), trained(static_cast<std::size_t>(replicas));
    thread_group group(replicas);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        train_params tp = params_for(99, warmup);
        if (edit)
            edit(tp);
        dp_type dp(
            comm, [&](auto& ctx) { return net(ctx, shape); }, op, tp);
        step_to(dp, 2);
        const auto before = fingerprint(dp);
        try {
            load_checkpoint(dp, path);
        } catch (const lockstep::error& e) {
            refused[r] = e.code() == errc::checkpoint;
            out.messages[r] = e.what();
        }
        same[r] = fingerprint(dp) == before;
        step_to(dp, 3);
        trained[r] = dp.steps() == 3;
    });
    for (std::size_t r = 0; r < refused.size(); ++r) {
        out.all_refused = out.all_refused && refused[r];
        out.unchanged = out.unchanged && same[r];
        out.trains_after = out.trains_after && trained[r];
    }
    return out;
}

using base_opt = optim::sgd<float>;
const optim::sgd_params base_params{.lr = 0.05, .momentum = 0.9};

/// The reference checkpoint of the refusal tests: 2 replicas, SGD momentum, synchronous,
/// per_tensor, registry, float, 3 steps.
void save_reference(const fs::path& path) {
    run<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        {.replicas = 2, .steps = 3, .save = path, .save_at = 3}, base_params);
}

void check_refused(const refusal& r, const std::vector<std::string>& parts) {
    CHECK(r.all_refused);
    CHECK(r.unchanged);
    CHECK(r.trains_after);
    for (const auto& m : r.messages) {
        INFO(m);
        for (const auto& p : parts)
            CHECK(contains(m, p));
    }
}

} // namespace

TEST_CASE("read_result() after a resume refuses until the trainer takes its own step",
          "[train][checkpoint][thread]") {
    // The resumed trainer has a step count but no step state of its own: reading it used to
    // return a made-up result (loss and skip flag from an unread buffer).
    temp_dir dir;
    const fs::path path = dir.path / "run.ckpt";
    save_reference(path);
    using dp_type = trainer_of<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>;
    using net = typename dp_type::network_type;
    std::vector<std::string> before(2);
    std::vector<int> loaded(2, -1), after(2, -1); // Catch's checks stay on the main thread
    thread_group(2).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, base_params,
            [] {
                train_params tp = params_for(5);
                tp.read_result = false;
                return tp;
            }());
        load_checkpoint(dp, path);
        loaded[r] = static_cast<int>(dp.steps());
        try {
            (void)dp.read_result();
        } catch (const lockstep::error& e) {
            if (e.code() == errc::invalid_argument)
                before[r] = e.what();
        }
        step_to(dp, 4);
        after[r] = static_cast<int>(dp.read_result().step);
    });
    for (std::size_t r = 0; r < 2; ++r) {
        INFO(before[r]);
        CHECK(loaded[r] == 3);
        CHECK(contains(before[r], "data_parallel.read_result: no step was taken yet by this "
                                  "trainer"));
        CHECK(after[r] == 3);
    }
}

TEST_CASE("an incompatible checkpoint is refused with every difference, nothing loaded",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path path = dir.path / "ref.ckpt";
    save_reference(path);

    SECTION("the compatible trainer loads it (control)") {
        const auto r = try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            2, path, base_params);
        CHECK(r.messages == std::vector<std::string>(2));
    }
    SECTION("another world size loads (test_checkpoint_resize); shards that contradict it not") {
        using loader = decltype([](int n, const fs::path& p) {
            return try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
                n, p, base_params);
        });
        const refusal loaded = loader{}(3, path);
        CHECK(loaded.messages == std::vector<std::string>(3));
        CHECK(!loaded.unchanged);
        // The marker claims 3 replicas, its shards were written by 2.
        set_marker_value(path, "world_size", "3");
        check_refused(loader{}(2, path),
                      {"was written by replica 0 of 2, the commit marker records "
                       "it as replica 0 of 3"});
        check_refused(loader{}(3, path), {"no shard for replica 2"});
    }
    SECTION("other shapes") {
        check_refused(try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
                          2, path, base_params, {.hidden = 9}),
                      {"section 'param.fc1.weight': checkpoint f32 {8, 5}, trainer f32 {9, 5}",
                       "section 'state.bn1.running_mean': checkpoint f32 {8}, trainer f32 {9}",
                       "section 'optimizer.momentum': checkpoint f32 {83}, trainer f32 {93}"});
    }
    SECTION("other dtype and optimizer type: both listed") {
        check_refused(
            try_load<optim::adam<double>, sync::synchronous, reduce::per_tensor, storage::registry>(
                2, path, {.lr = 1e-2}),
            {"dtype: checkpoint float, trainer double", "dtype.size: checkpoint 4, trainer 8",
             "optimizer: checkpoint sgd, trainer adam",
             "section 'optimizer.exp_avg' (f64 {83}) is missing",
             "section 'optimizer.momentum' (f32 {83}) is not part of this trainer"});
    }
    SECTION("other hyperparameter") {
        check_refused(try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
                          2, path, {.lr = 0.05, .momentum = 0.8}),
                      {"optimizer.momentum: checkpoint 0.9", "trainer 0.8"});
    }
    SECTION("other learning rate schedule") {
        check_refused(try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
                          2, path, base_params, {}, 10),
                      {"lr.schedule: checkpoint "});
    }
    SECTION("other sync policy") {
        check_refused(try_load<base_opt, sync::local_sgd<2>, reduce::per_tensor, storage::registry>(
                          2, path, base_params),
                      {"sync: checkpoint sync::synchronous, trainer sync::local_sgd<2>"});
    }
    SECTION("other reduce policy") {
        check_refused(
            try_load<base_opt, sync::synchronous, reduce::bucketed<64, 32>, storage::registry>(
                2, path, base_params),
            {"reduce: checkpoint reduce::per_tensor, trainer reduce::bucketed<64, 32>"});
    }
    SECTION("a missing section") {
        rewrite_shard(path, 1, [](auto&, std::vector<raw_section>& s) {
            std::erase_if(s,
                          [](const raw_section& x) { return x.name == "state.bn1.running_var"; });
        });
        check_refused(try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
                          2, path, base_params),
                      {"replica 1: section 'state.bn1.running_var' (f32 {8}) is missing"});
    }
    SECTION("a negative optimizer step count on one replica") {
        rewrite_shard(path, 1, [](auto&, std::vector<raw_section>& s) {
            for (raw_section& x : s)
                if (x.name == "optimizer.step") {
                    const std::int64_t v = -3;
                    std::memcpy(x.bytes.data(), &v, sizeof v);
                }
        });
        check_refused(try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
                          2, path, base_params),
                      {"replica 1: section 'optimizer.step': step count -3 is negative"});
    }
    SECTION("an extra section and an extra metadata entry") {
        rewrite_shard(path, 0, [](auto& meta, std::vector<raw_section>& s) {
            s.push_back({"loss_scaler.scale", ck::dtype::f64, {1}, std::vector<std::byte>(8)});
            meta.emplace_back("loss_scaler", "dynamic");
        });
        check_refused(try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
                          2, path, base_params),
                      {"replica 0: ", "section 'loss_scaler.scale' (f64 {1}) is not part of",
                       "loss_scaler: dynamic in the checkpoint, unknown to the trainer"});
    }
}

namespace {

/// Sets counter `index` of the section "trainer.counters" (steps, samples, since_average, seed)
/// of replica r's shard to v.
void set_counter(const fs::path& path, int r, std::size_t index, std::uint64_t v) {
    rewrite_shard(path, r, [&](auto&, std::vector<raw_section>& s) {
        for (raw_section& x : s)
            if (x.name == "trainer.counters")
                std::memcpy(x.bytes.data() + 8 * index, &v, sizeof v);
    });
}

} // namespace

TEST_CASE("another learning rate or hyperparameter is refused with the way to train on; "
          "optimizer().set_lr after the load is that way for the rate",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path path = dir.path / "lr.ckpt", again = dir.path / "lr2.ckpt";
    // Saved without a schedule: the optimizer's lr, 0.05, at every step.
    run<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        {.replicas = 2, .steps = 3, .save = path, .save_at = 3, .warmup = -1}, base_params);
    using loader = decltype([](const fs::path& p, const optim::sgd_params& op) {
        return try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            2, p, op, {}, -1);
    });
    check_refused(loader{}(path, {.lr = 0.01, .momentum = 0.9}),
                  {"lr.schedule: checkpoint 0.05 0.05 0.05 0.05, trainer 0.01 0.01 0.01 0.01 (the "
                   "learning rate at the resume step and 1, 10 and 1000 steps later): a checkpoint "
                   "resumes with the learning rates it was saved with; to go on at another rate, "
                   "load it into a trainer built with the saved rate (the optimizer's lr, or the "
                   "same train_params::lr), then call optimizer().set_lr(x) on every replica "
                   "before the next step"});
    check_refused(loader{}(path, {.lr = 0.05, .momentum = 0.8}),
                  {"optimizer.momentum: checkpoint 0.9, trainer 0.8: a checkpoint resumes with "
                   "the optimizer's hyperparameters it was saved with (only the learning rate has "
                   "a setter, optimizer().set_lr); load it with them, then construct a new "
                   "trainer with the new values"});

    // The way for the rate: load with the saved one, set_lr on every replica. The steps use the
    // new rate, and the next save records it. On one replica only, the step is refused.
    using dp_type = trainer_of<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>;
    using net = typename dp_type::network_type;
    auto fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
    std::vector<double> used(2);
    std::vector<std::string> one_replica(2);
    thread_group(2).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(5, -1));
        load_checkpoint(dp, path);
        dp.optimizer().set_lr(0.01);
        used[r] = dp.step(batch_of(dp.steps()), fn).lr;
        save_checkpoint(dp, again);
        dp.optimizer().set_lr(r == 1 ? 0.02 : 0.01);
        try {
            dp.step(batch_of(dp.steps()), fn);
        } catch (const lockstep::error& e) {
            one_replica[r] = e.what();
        }
    });
    for (std::size_t r = 0; r < 2; ++r) {
        INFO(one_replica[r]);
        CHECK(used[r] == 0.01);
        CHECK(contains(one_replica[r], "lr: 0.01 on replica 0, 0.02 on replica 1;"));
    }
    CHECK(loader{}(again, {.lr = 0.01, .momentum = 0.9}).messages == std::vector<std::string>(2));
    check_refused(loader{}(again, base_params), {"lr.schedule: checkpoint 0.01 0.01 0.01 0.01, "
                                                 "trainer 0.05 0.05 0.05 0.05"});
}
TEST_CASE("counters out of range are refused on every replica, nothing loaded",
          "[train][checkpoint][thread]") {
    // No learning-rate schedule: the schedule's check cannot see the step count.
    temp_dir dir;
    const fs::path sync_path = dir.path / "sync.ckpt";
    const fs::path local_path = dir.path / "local.ckpt";
    using local = sync::local_sgd<4>;
    run<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        {.replicas = 2, .steps = 3, .save = sync_path, .save_at = 3, .warmup = -1}, base_params);
    // 6 steps of local_sgd<4>: 2 steps since the average at step 4.
    run<base_opt, local, reduce::per_tensor, storage::registry>(
        {.replicas = 2, .steps = 6, .save = local_path, .save_at = 6, .warmup = -1}, base_params);
    const auto load_sync = [&] {
        return try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            2, sync_path, base_params, {}, -1);
    };
    const auto load_local = [&] {
        return try_load<base_opt, local, reduce::per_tensor, storage::registry>(
            2, local_path, base_params, {}, -1);
    };

    SECTION("the intact checkpoints load (control)") {
        CHECK(load_sync().messages == std::vector<std::string>(2));
        CHECK(load_local().messages == std::vector<std::string>(2));
    }
    SECTION("local SGD: K steps since the last average (it would never average again)") {
        set_counter(local_path, 1, 2, 4);
        check_refused(load_local(),
                      {"replica 1: section 'trainer.counters': 4 step(s) since the last average, "
                       "sync::local_sgd<4> averages every 4 steps"});
    }
    SECTION("synchronous: any step since an average") {
        set_counter(sync_path, 0, 2, 1);
        check_refused(load_sync(),
                      {"replica 0: section 'trainer.counters': 1 step(s) since the last average, "
                       "sync::synchronous does not average (must be 0)"});
    }
    SECTION("a step count near 2^63 (the schedule's look-ahead would overflow)") {
        set_counter(sync_path, 1, 0, 0x7FFFFFFFFFFFFF00ull);
        check_refused(load_sync(), {"replica 1: section 'trainer.counters': step count "
                                    "9223372036854775552 is above the limit 4611686018427387904"});
    }
    SECTION("a step count of 2^64 - 1 (negative as a signed count)") {
        set_counter(sync_path, 0, 0, std::numeric_limits<std::uint64_t>::max());
        check_refused(load_sync(), {"replica 0: section 'trainer.counters': step count "
                                    "18446744073709551615 is above the limit"});
    }
}

TEST_CASE("a save committed while the replicas load is refused on every replica, nothing loaded",
          "[train][checkpoint][thread]") {
    using dp_type = trainer_of<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>;
    using net = dp_type::network_type;
    temp_dir dir;
    const fs::path path = dir.path / "race.ckpt";
    // Save A (3 steps), then save B (5 steps) to the same path (B's commit removes A's shards);
    // the marker is then put back to A's.
    save_reference(path);
    const auto marker_a = read_all(path);
    run<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        {.replicas = 2, .steps = 5, .save = path, .save_at = 5}, base_params);
    const auto marker_b = read_all(path);
    const auto gen_of = [](const std::vector<std::byte>& m) {
        return std::string(
            *ck::parse_header(m, ck::manifest_magic, "marker").find_meta("generation"));
    };
    const std::string gen_a = gen_of(marker_a), gen_b = gen_of(marker_b);
    REQUIRE(gen_a != gen_b);
    write_all(path, marker_a);
    // Each replica has read marker A when it enters the load's first collective (the all_gather
    // of the generation every replica read): there, once replica 0 has entered it too, replica 1
    // commits B (its marker replaces A's) before either replica reads its shard.
    std::vector<int> armed(2); // per replica, set and read on its own thread
    std::atomic<bool> zero_entered{false};
    std::atomic<bool> swapped{false};
    thread_group_params tp;
    tp.on_collective = [&](const collective_event& e) {
        const auto r = static_cast<std::size_t>(e.replica);
        if (e.when != collective_event::moment::entered || armed[r] == 0)
            return;
        armed[r] = 0;
        if (r == 0) {
            zero_entered = true;
            return;
        }
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!zero_entered && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        write_all(path, marker_b);
        swapped = true;
    };
    std::vector<std::string> messages(2);
    std::vector<int> refused(2), unchanged(2);
    thread_group(2, tp).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(99));
        step_to(dp, 2);
        const auto before = fingerprint(dp);
        armed[r] = 1;
        try {
            load_checkpoint(dp, path);
        } catch (const lockstep::error& e) {
            refused[r] = e.code() == errc::checkpoint;
            messages[r] = e.what();
        }
        unchanged[r] = fingerprint(dp) == before;
    });
    CHECK(swapped);
    CHECK(refused == std::vector<int>{1, 1});
    CHECK(unchanged == std::vector<int>{1, 1});
    for (const std::string& m : messages) {
        INFO(m);
        CHECK(contains(m, std::string("commit marker '")
                              .append(path.string())
                              .append("' changed while the replicas read it (a save committed "
                                      "meanwhile): generation ")
                              .append(gen_a)
                              .append(" agreed, '")
                              .append(gen_b)
                              .append("' read now")));
    }
    // B stands: it loads once nothing changes during the load.
    const auto r = try_load<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        2, path, base_params);
    CHECK(r.messages == std::vector<std::string>(2));
}

namespace {

/// One replica's trainer for the corruption tests, loading `path` after each mutation.
template <class Fn>
void with_single_trainer(Fn&& fn) {
    using dp_type = trainer_of<base_opt, sync::synchronous, reduce::per_tensor, storage::visitor>;
    using net = dp_type::network_type;
    thread_group group(1);
    group.run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(5));
        fn(dp);
    });
}

/// Loads and reports whether the load was refused with errc::checkpoint.
template <class DP>
bool refused(DP& dp, const fs::path& path) {
    try {
        load_checkpoint(dp, path);
    } catch (const lockstep::error& e) {
        return e.code() == errc::checkpoint;
    }
    return false;
}

} // namespace

TEST_CASE("corrupted, truncated, extended, empty or uncommitted checkpoints are refused",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path path = dir.path / "c.ckpt";
    run<base_opt, sync::synchronous, reduce::per_tensor, storage::visitor>(
        {.replicas = 1, .steps = 2, .save = path, .save_at = 2}, base_params);
    const fs::path shard = shard_file(path, 0);
    const auto good_shard = read_all(shard);
    const auto good_marker = read_all(path);
    REQUIRE(good_shard.size() > 500);

    // Counted on the replica thread, checked here afterwards (Catch2 asserts on this thread).
    std::size_t accepted_flips = 0, accepted_cuts = 0, accepted_garbage = 0;
    std::vector<std::string> missed; // the refusals of empty and missing files that did not come
    bool unchanged = false, control_loads = false;
    std::int64_t steps = -1;
    std::uint64_t seed = 0;
    with_single_trainer([&](auto& dp) {
        const auto before = fingerprint(dp);
        // One bit flipped in every byte of the shard (bit i % 8 of byte i): caught by the
        // marker's CRC, and, with the marker updated to the flipped file, by the shard's own
        // header/section CRCs and padding check.
        for (std::size_t i = 0; i < good_shard.size(); ++i) {
            auto b = good_shard;
            b[i] ^= std::byte(1u << (i % 8));
            write_all(shard, b);
            accepted_flips += refused(dp, path) ? 0 : 1;
            commit_shard(path, 0, b);
            accepted_flips += refused(dp, path) ? 0 : 1;
            write_all(path, good_marker);
        }
        write_all(shard, good_shard);
        for (std::size_t i = 0; i < good_marker.size(); ++i) {
            auto b = good_marker;
            b[i] ^= std::byte(1u << (i % 8));
            write_all(path, b);
            accepted_flips += refused(dp, path) ? 0 : 1;
        }
        write_all(path, good_marker);
        // Truncation at every length, of the shard (marker updated) and of the marker.
        for (std::size_t n = 0; n < good_shard.size(); ++n) {
            commit_shard(path, 0, std::span(good_shard).first(n));
            accepted_cuts += refused(dp, path) ? 0 : 1;
        }
        write_all(shard, good_shard);
        write_all(path, good_marker);
        for (std::size_t n = 0; n < good_marker.size(); ++n) {
            write_all(path, std::span(good_marker).first(n));
            accepted_cuts += refused(dp, path) ? 0 : 1;
        }
        write_all(path, good_marker);
        // Appended garbage (zeros and non-zeros), to the shard (marker updated) and the marker.
        for (std::byte fill : {std::byte{0}, std::byte{0x5A}})
            for (std::size_t extra : {1, 7, 8, 100}) {
                auto b = good_shard;
                b.insert(b.end(), extra, fill);
                commit_shard(path, 0, b);
                accepted_garbage += refused(dp, path) ? 0 : 1;
                write_all(path, good_marker);
                auto m = good_marker;
                m.insert(m.end(), extra, fill);
                write_all(path, m);
                accepted_garbage += refused(dp, path) ? 0 : 1;
                write_all(path, good_marker);
            }
        write_all(shard, good_shard);
        // Zero-length marker and shard, missing marker, missing shard.
        auto expect_refused = [&](const char* what) {
            if (!refused(dp, path))
                missed.emplace_back(what);
        };
        write_all(path, {});
        expect_refused("empty marker");
        write_all(path, good_marker);
        write_all(shard, {});
        expect_refused("empty shard");
        write_all(shard, good_shard);
        fs::remove(path);
        expect_refused("missing marker");
        write_all(path, good_marker);
        fs::remove(shard);
        expect_refused("missing shard");
        write_all(shard, good_shard);
        // Nothing of all that reached the trainer; the intact checkpoint loads (control).
        unchanged = fingerprint(dp) == before;
        control_loads = !refused(dp, path);
        steps = dp.steps();
        seed = dp.context().seed();
    });
    CHECK(accepted_flips == 0);
    CHECK(accepted_cuts == 0);
    CHECK(accepted_garbage == 0);
    CHECK(missed.empty());
    CHECK(unchanged);
    CHECK(control_loads);
    CHECK(steps == 2);
    CHECK(seed == 42);
}

TEST_CASE("a save that crashes at any stage leaves the previous checkpoint loadable",
          "[train][checkpoint][thread]") {
    using dp_type = trainer_of<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>;
    using net = dp_type::network_type;
    struct crash_case {
        const char* stage;
        int replica;    ///< the replica that "crashes"
        bool committed; ///< the new checkpoint is the one a load finds afterwards
    };
    const crash_case cases[] = {{"shard.partial", 1, false},    {"shard.written", 0, false},
                                {"shard.renamed", 1, false},    {"manifest.partial", 0, false},
                                {"manifest.written", 0, false}, {"manifest.renamed", 0, true},
                                {"cleanup.done", 0, true}};
    for (const crash_case& c : cases) {
        DYNAMIC_SECTION("crash at " << c.stage << " on replica " << c.replica) {
            temp_dir dir;
            const fs::path path = dir.path / "x.ckpt";
            std::vector<std::vector<std::byte>> at3(2), at5(2);
            std::vector<int> save_failed(2);
            const save_options crash{.on_stage = [&](std::string_view stage, int replica) {
                if (stage == c.stage && replica == c.replica)
                    throw std::runtime_error("simulated crash");
            }};
            thread_group(2).run([&](thread_communicator& comm) {
                const auto r = static_cast<std::size_t>(comm.rank());
                dp_type dp(
                    comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(42));
                step_to(dp, 3);
                save_checkpoint(dp, path);
                at3[r] = fingerprint(dp);
                step_to(dp, 5);
                at5[r] = fingerprint(dp);
                try {
                    save_checkpoint(dp, path, crash);
                } catch (const lockstep::error& e) {
                    // After the commit point the report says the save is the checkpoint.
                    save_failed[r] =
                        e.code() == errc::checkpoint && contains(e.what(), "simulated crash") &&
                        contains(e.what(), "so '" + path.string() + "' loads this save") ==
                            c.committed;
                }
            });
            CHECK(save_failed == std::vector<int>{1, 1});
            std::vector<std::vector<std::byte>> loaded(2);
            thread_group(2).run([&](thread_communicator& comm) {
                dp_type dp(
                    comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(1));
                load_checkpoint(dp, path);
                loaded[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
                // A later successful save removes every leftover of the crashed one.
                save_checkpoint(dp, path);
            });
            CHECK(loaded == (c.committed ? at5 : at3));
            std::size_t files = 0;
            for (const auto& e : fs::directory_iterator(dir.path)) {
                (void)e;
                ++files;
            }
            CHECK(files == 3); // the marker and two shards
        }
    }
}

TEST_CASE("a save's stage hook is its own: a concurrent save in the process never sees it",
          "[train][checkpoint][thread]") {
    using dp_type = trainer_of<base_opt, sync::synchronous, reduce::per_tensor, storage::registry>;
    using net = dp_type::network_type;
    temp_dir dir;
    // Two jobs of two replicas each save at the same time, each with its own hook: job 0's
    // crashes its save at shard.written, job 1's records the stages it sees.
    std::vector<std::string> seen;
    std::vector<int> failed(4, -1);
    std::atomic<int> arrived{0};
    const auto job = [&](int j) {
        const fs::path path = dir.path / ("job" + std::to_string(j) + ".ckpt");
        thread_group(2).run([&](thread_communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            dp_type dp(
                comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(42));
            step_to(dp, 2);
            const save_options own{.on_stage = [&](std::string_view stage, int replica) {
                if (j == 0 && stage == "shard.written")
                    throw std::runtime_error("simulated crash");
                if (j == 1 && replica == 0)
                    seen.emplace_back(stage);
            }};
            ++arrived; // both jobs' replicas are alive before either saves
            while (arrived.load() < 4)
                std::this_thread::yield();
            try {
                save_checkpoint(dp, path, own);
                failed[static_cast<std::size_t>(j) * 2 + r] = 0;
            } catch (const lockstep::error& e) {
                failed[static_cast<std::size_t>(j) * 2 + r] = contains(e.what(), "simulated crash");
            }
        });
    };
    std::thread other(job, 1);
    job(0);
    other.join();
    CHECK(failed == std::vector<int>{1, 1, 0, 0});
    CHECK(seen == std::vector<std::string>{"shard.partial", "shard.written", "shard.renamed",
                                           "manifest.partial", "manifest.written",
                                           "manifest.renamed", "cleanup.done"});
}

namespace {

/// Asynchronous training: save between train() calls, load into trainers built with another
/// seed: every replica has the saved state (parameters, BN statistics, optimizer buffers and
/// step count, steps, seed) and trains on. Not compared with an uninterrupted run: the order in
/// which the server applies gradients depends on their arrival, with or without a checkpoint.
template <class Sync>
void check_async_restore() {
    using dp_type = trainer_of<base_opt, Sync, reduce::per_tensor, storage::registry>;
    using net = typename dp_type::network_type;
    auto fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
    temp_dir dir;
    const fs::path path = dir.path / "async.ckpt";
    std::vector<std::vector<std::byte>> saved(3), fresh(3), loaded(3);
    std::vector<std::int64_t> steps_after(3);
    thread_group(3).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(42));
        dp.train(6, 8, fn);
        save_checkpoint(dp, path);
        saved[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
    });
    thread_group(3).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(7));
        fresh[r] = fingerprint(dp);
        load_checkpoint(dp, path);
        loaded[r] = fingerprint(dp);
        dp.train(4, 8, fn);
        steps_after[r] = dp.steps();
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO("replica " << r);
        CHECK(loaded[r] == saved[r]);
        CHECK(fresh[r] != saved[r]);
        CHECK(steps_after[r] == 10);
    }
}

} // namespace

TEST_CASE("asynchronous trainers restore every replica's state from a checkpoint",
          "[train][checkpoint][thread][async]") {
    SECTION("sync::asynchronous") {
        check_async_restore<sync::asynchronous>();
    }
    SECTION("sync::bounded_staleness<1>") {
        check_async_restore<sync::bounded_staleness<1>>();
    }
}

TEST_CASE("CRC32C matches the published check value", "[train][checkpoint]") {
    const std::string s = "123456789";
    CHECK(crc32c(std::as_bytes(std::span(s))) == 0xE3069283u);
    // Slicing-by-8 agrees with itself split at every point (the byte loop and the 8-byte loop).
    std::vector<std::byte> data(100);
    for (std::size_t i = 0; i < data.size(); ++i)
        data[i] = std::byte(i * 37 + 11);
    const std::uint32_t whole = crc32c(data);
    for (std::size_t k = 0; k <= data.size(); ++k)
        CHECK(crc32c_update(crc32c(std::span(data).first(k)), std::span(data).subspan(k)) == whole);
    // Combining the CRCs of the two parts (without their bytes) gives the whole's, at every
    // split, and over a long run of zeros (the squaring's higher powers).
    for (std::size_t k = 0; k <= data.size(); ++k)
        CHECK(crc32c_combine(crc32c(std::span(data).first(k)), crc32c(std::span(data).subspan(k)),
                             data.size() - k) == whole);
    std::vector<std::byte> zeros(1 << 20, std::byte{0});
    std::vector<std::byte> joined = data;
    joined.insert(joined.end(), zeros.begin(), zeros.end());
    CHECK(crc32c_combine(whole, crc32c(zeros), zeros.size()) == crc32c(joined));
}

TEST_CASE("the dynamic loss scale's state is checkpointed and restored", "[train][checkpoint]") {
    using dp_type =
        trainer_of<optim::sgd<float>, sync::synchronous, reduce::bucketed<>, storage::registry>;
    using net = typename dp_type::network_type;
    // Scale 4, growing every 3 applied steps: a resume at step 5 sits between two growths, so
    // only a restored growth tracker grows the scale at the same step as the uninterrupted run.
    const loss_scaling scaling{.init_scale = 4, .growth_interval = 3};
    auto run_plan = [&](std::size_t steps, std::uint64_t seed, const fs::path& load,
                        const fs::path& save, std::optional<loss_scaling> ls,
                        std::vector<double>* scales) {
        std::vector<std::vector<std::byte>> out(2);
        thread_group group(2);
        group.run([&](thread_communicator& comm) {
            train_params tp = params_for(seed);
            tp.loss_scale = ls;
            dp_type dp(
                comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05, .momentum = 0.9}, tp);
            if (!load.empty())
                load_checkpoint(dp, load);
            while (static_cast<std::size_t>(dp.steps()) < steps) {
                const auto r =
                    dp.step(batch_of(dp.steps()), [](auto& n, const shard_range& sr, auto& ctx) {
                        return n.train(sr, ctx);
                    });
                if (scales != nullptr && comm.rank() == 0)
                    scales->push_back(r.loss_scale);
            }
            if (!save.empty())
                save_checkpoint(dp, save);
            out[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
        });
        return out;
    };
    temp_dir dir;
    const fs::path path = dir.path / "scaled.ckpt";
    std::vector<double> full_scales, resumed_scales;
    const auto full = run_plan(11, 42, {}, {}, scaling, &full_scales);
    run_plan(5, 42, {}, path, scaling, nullptr);
    const auto resumed = run_plan(11, 7, path, {}, scaling, &resumed_scales);
    CHECK(resumed == full);
    // The scale grew (4, 4, 4, 8, ...) and the resumed steps used the same scales.
    REQUIRE(full_scales.size() == 11);
    CHECK(full_scales.front() == 4.0);
    CHECK(full_scales.back() > 4.0);
    CHECK(resumed_scales == std::vector<double>(full_scales.begin() + 5, full_scales.end()));
    // A trainer without loss scaling refuses the file, and a trainer with it refuses a file
    // saved without: the "loss_scale" setting differs.
    const fs::path plain = dir.path / "plain.ckpt";
    run_plan(5, 42, {}, plain, std::nullopt, nullptr);
    for (const bool scaled : {false, true}) {
        CAPTURE(scaled);
        std::optional<errc> code;
        std::string what;
        try {
            run_plan(6, 42, scaled ? plain : path, {},
                     scaled ? std::optional(scaling) : std::nullopt, nullptr);
        } catch (const error& e) {
            code = e.code();
            what = e.what();
        }
        INFO(what);
        CHECK(code == errc::checkpoint);
        CHECK(contains(what, "loss_scale"));
    }
}

namespace {

/// Two parameters of different sizes registered as (a, b), or (b, a) with BFirst: the same
/// names and shapes at other offsets of the flat buffer. Their gradients differ tenfold, so
/// optimizer state restored to the wrong tensor shows in the steps that follow.
template <bool BFirst>
struct two_tensors {
    tensor_handle<float> a, b;
    explicit two_tensors(replica_context<float, thread_communicator>& ctx) {
        if (BFirst)
            b = ctx.registry().add("b", {3});
        a = ctx.registry().add("a", {4});
        if (!BFirst)
            b = ctx.registry().add("b", {3});
        for (std::size_t k = 0; k < 4; ++k)
            a.value()[k] = 0.1f * static_cast<float>(k);
        for (std::size_t k = 0; k < 3; ++k)
            b.value()[k] = -0.2f * static_cast<float>(k);
    }
    double train(const shard_range& r) {
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const std::uint64_t g = r.sample_index(i);
            for (std::size_t k = 0; k < 4; ++k) {
                const float e = a.value()[k] - static_cast<float>(rng_stream{3, 0}.normal(g, k));
                a.grad()[k] += static_cast<float>(2 * e * r.scale);
                loss += e * e * r.scale;
            }
            for (std::size_t k = 0; k < 3; ++k) {
                const float e =
                    b.value()[k] - 10 * static_cast<float>(rng_stream{3, 0}.normal(g, 4 + k));
                b.grad()[k] += static_cast<float>(2 * e * r.scale);
                loss += e * e * r.scale;
            }
        }
        return loss;
    }
};

/// One replica's tensors by name: values, and every optimizer buffer's elements of each.
struct named_state {
    std::vector<float> a, b, opt_a, opt_b;
    std::int64_t optimizer_steps = 0;
    std::string error; ///< the load's message, when it threw
    int unchanged = 0; ///< a refused load left the parameters as they were
};

bool bitwise(const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), 4 * x.size()) == 0;
}

/// `replicas` replicas of two_tensors<BFirst> (Adam) step to `steps` steps with global batches
/// of 8, loading `load` first and saving `save` at the end when given. With reduce::sharded the
/// optimizer's part is its shard: opt_a and opt_b stay empty.
template <bool BFirst, class Reduce>
std::vector<named_state> run_ordered(int replicas, std::int64_t steps, const fs::path& load = {},
                                     const fs::path& save = {}) {
    using net = two_tensors<BFirst>;
    using dp_type =
        data_parallel<net, optim::adam<float>, sync::synchronous, Reduce, thread_communicator>;
    std::vector<named_state> out(static_cast<std::size_t>(replicas));
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05}, {.seed = 42});
        named_state& s = out[static_cast<std::size_t>(comm.rank())];
        const std::vector<float> before(dp.parameters().begin(), dp.parameters().end());
        try {
            if (!load.empty())
                load_checkpoint(dp, load);
        } catch (const lockstep::error& e) {
            s.error = e.what();
            s.unchanged = std::equal(before.begin(), before.end(), dp.parameters().begin()) ? 1 : 0;
            return;
        }
        while (dp.steps() < steps)
            dp.step(8, [](net& n, const shard_range& r, auto&) { return n.train(r); });
        if (!save.empty())
            save_checkpoint(dp, save);
        auto& n = dp.network();
        s.a.assign(n.a.value().begin(), n.a.value().end());
        s.b.assign(n.b.value().begin(), n.b.value().end());
        if constexpr (!Reduce::shards_optimizer_state)
            for (const auto& slot : dp.optimizer().state().slots) {
                const auto ta = slot.data.subspan(n.a.info().offset, n.a.size());
                const auto tb = slot.data.subspan(n.b.info().offset, n.b.size());
                s.opt_a.insert(s.opt_a.end(), ta.begin(), ta.end());
                s.opt_b.insert(s.opt_b.end(), tb.begin(), tb.end());
            }
        s.optimizer_steps = dp.optimizer().step_count();
    });
    return out;
}

} // namespace

TEST_CASE("a network that registers its tensors in another order resumes with each tensor's "
          "optimizer state",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    SECTION("the same replica count, reduce::bucketed: bitwise the uninterrupted run") {
        const fs::path path = dir.path / "order.ckpt";
        const auto full = run_ordered<false, reduce::bucketed<>>(2, 6);
        const auto saved = run_ordered<false, reduce::bucketed<>>(2, 3, {}, path);
        const auto loaded = run_ordered<true, reduce::bucketed<>>(2, 3, path);
        const auto resumed = run_ordered<true, reduce::bucketed<>>(2, 6, path);
        for (std::size_t r = 0; r < 2; ++r) {
            INFO("replica " << r);
            REQUIRE(loaded[r].error.empty());
            CHECK(bitwise(loaded[r].opt_a, saved[r].opt_a)); // moved with its tensor
            CHECK(bitwise(loaded[r].opt_b, saved[r].opt_b));
            CHECK(bitwise(resumed[r].a, full[r].a));
            CHECK(bitwise(resumed[r].b, full[r].b));
            CHECK(bitwise(resumed[r].opt_a, full[r].opt_a));
            CHECK(bitwise(resumed[r].opt_b, full[r].opt_b));
        }
    }
    SECTION("2 -> 3 replicas, reduce::reproducible: bitwise the uninterrupted run at 3") {
        using repro = reduce::reproducible<2>;
        const fs::path path = dir.path / "order_resized.ckpt";
        const auto full = run_ordered<false, repro>(3, 6);
        const auto saved = run_ordered<false, repro>(2, 3, {}, path);
        const auto loaded = run_ordered<true, repro>(3, 3, path);
        const auto resumed = run_ordered<true, repro>(3, 6, path);
        for (std::size_t r = 0; r < 3; ++r) {
            INFO("new replica " << r);
            REQUIRE(loaded[r].error.empty());
            CHECK(bitwise(loaded[r].opt_a, saved[0].opt_a));
            CHECK(bitwise(loaded[r].opt_b, saved[0].opt_b));
            CHECK(bitwise(resumed[r].a, full[r].a));
            CHECK(bitwise(resumed[r].b, full[r].b));
        }
    }
    SECTION("reduce::sharded refuses another order on every replica, nothing loaded") {
        using sharded = reduce::sharded<>;
        const fs::path path = dir.path / "order_sharded.ckpt";
        run_ordered<false, sharded>(2, 3, {}, path);
        for (int replicas : {2, 3}) {
            INFO(replicas << " replicas");
            const auto loaded = run_ordered<true, sharded>(replicas, 3, path);
            for (std::size_t r = 0; r < loaded.size(); ++r) {
                INFO("replica " << r << ": " << loaded[r].error);
                CHECK(loaded[r].error.find("replica " + std::to_string(r) +
                                           ": load_checkpoint: ") != std::string::npos);
                CHECK(loaded[r].error.find(
                          "parameter 'b' was registered at position 1 by the run that saved the "
                          "checkpoint (elements [4, 7) of the flat buffer) and at position 0 by "
                          "this trainer (elements [0, 3))") != std::string::npos);
                CHECK(loaded[r].error.find("register the tensors in the order of the run that "
                                           "saved the checkpoint") != std::string::npos);
                CHECK(loaded[r].unchanged == 1);
            }
        }
        CHECK(run_ordered<false, sharded>(2, 4, path)[0].error.empty()); // control
    }
}

namespace {

/// A four-element network for the tests of checkpoint calls made wrongly.
struct tiny_net {
    tensor_handle<float> a;
    explicit tiny_net(replica_context<float, thread_communicator>& ctx) {
        a = ctx.registry().add("a", {4});
        ctx.registry().finalize();
    }
};
using tiny_dp = data_parallel<tiny_net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>>;

double tiny_step(tiny_net& n, const shard_range& r, replica_context<float, thread_communicator>&) {
    for (float& g : n.a.grad())
        g += static_cast<float>(static_cast<double>(r.size()) * r.scale);
    return 0.0;
}

/// Each replica's error message from body(dp, comm) on 2 thread replicas ("" when none).
template <class Body>
std::vector<std::string> tiny_errors(Body body) {
    std::vector<std::string> errors;
    for (auto& e : lockstep_test::errors_of(2, [&](int, thread_communicator& comm) {
             tiny_dp dp(comm, [](auto& ctx) { return tiny_net(ctx); }, {.lr = 0.05});
             body(dp, comm);
             (void)dp.finish();
         }))
        errors.push_back(std::move(e.first));
    return errors;
}

} // namespace

TEST_CASE("replicas passing different checkpoint paths are refused on every replica",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    fs::create_directories(dir.path / "r0");
    fs::create_directories(dir.path / "r1");
    const auto mine = [&](thread_communicator& comm) {
        return dir.path / ("r" + std::to_string(comm.rank())) / "x.ckpt";
    };
    SECTION("save_checkpoint: before anything is written") {
        const auto errors = tiny_errors([&](tiny_dp& dp, thread_communicator& comm) {
            dp.step(4, tiny_step);
            save_checkpoint(dp, mine(comm));
        });
        for (const std::string& e : errors) {
            INFO(e);
            CHECK(contains(e, "invalid_argument"));
            CHECK(contains(e, "save_checkpoint: the replicas passed different paths"));
            CHECK(contains(e, "replica(s) 0 passed '" + (dir.path / "r0" / "x.ckpt").string()));
            CHECK(contains(e, "replica(s) 1 passed '" + (dir.path / "r1" / "x.ckpt").string()));
            CHECK(contains(e, "on a file system all of them share"));
        }
        CHECK(fs::is_empty(dir.path / "r0"));
        CHECK(fs::is_empty(dir.path / "r1"));
    }
    SECTION("load_checkpoint") {
        (void)tiny_errors([&](tiny_dp& dp, thread_communicator&) {
            dp.step(4, tiny_step);
            save_checkpoint(dp, dir.path / "r0" / "x.ckpt");
        });
        const auto errors = tiny_errors(
            [&](tiny_dp& dp, thread_communicator& comm) { load_checkpoint(dp, mine(comm)); });
        for (const std::string& e : errors) {
            INFO(e);
            CHECK(contains(e, "load_checkpoint: the replicas passed different paths"));
            CHECK(contains(e, "replica(s) 1 passed '" + (dir.path / "r1" / "x.ckpt").string()));
        }
    }
}

TEST_CASE("a checkpoint call made on one replica only is named on every replica",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path path = dir.path / "x.ckpt";
    SECTION("save_checkpoint") {
        const auto errors = tiny_errors([&](tiny_dp& dp, thread_communicator& comm) {
            dp.step(4, tiny_step);
            if (comm.rank() == 0)
                save_checkpoint(dp, path);
            dp.step(4, tiny_step);
        });
        for (const std::string& e : errors) {
            INFO(e);
            CHECK(contains(e, "tag 'save_checkpoint'"));
        }
    }
    SECTION("load_checkpoint") {
        (void)tiny_errors([&](tiny_dp& dp, thread_communicator&) {
            dp.step(4, tiny_step);
            save_checkpoint(dp, path);
        });
        const auto errors = tiny_errors([&](tiny_dp& dp, thread_communicator& comm) {
            if (comm.rank() == 0)
                load_checkpoint(dp, path);
            dp.step(4, tiny_step);
        });
        for (const std::string& e : errors) {
            INFO(e);
            CHECK(contains(e, "tag 'load_checkpoint'"));
        }
    }
}

TEST_CASE("a save from the step function holds the state the step started from; a load "
          "inside a training call is refused",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path before = dir.path / "before.ckpt", inside = dir.path / "inside.ckpt";
    std::vector<float> stepped(2);
    // The step function saves, then adds its gradient: the save holds the state before it.
    thread_group(2).run([&](thread_communicator& comm) {
        tiny_dp dp(comm, [](auto& ctx) { return tiny_net(ctx); }, {.lr = 0.05});
        dp.step(4, tiny_step);
        save_checkpoint(dp, before);
        dp.step(4, [&](tiny_net& n, const shard_range& r, auto& ctx) {
            save_checkpoint(dp, inside);
            return tiny_step(n, r, ctx);
        });
        stepped[static_cast<std::size_t>(comm.rank())] = dp.parameters()[0];
    });
    std::vector<std::vector<float>> got(4);
    std::vector<std::int64_t> loaded_steps(4);
    thread_group(2).run([&](thread_communicator& comm) {
        for (std::size_t k = 0; k < 2; ++k) {
            tiny_dp dp(comm, [](auto& ctx) { return tiny_net(ctx); }, {.lr = 0.05});
            load_checkpoint(dp, k == 0 ? before : inside);
            const std::size_t i = 2 * k + static_cast<std::size_t>(comm.rank());
            loaded_steps[i] = dp.steps();
            dp.step(4, tiny_step);
            const auto p = dp.parameters();
            got[i].assign(p.begin(), p.end());
        }
    });
    for (std::size_t i = 0; i < 4; ++i) {
        CHECK(loaded_steps[i] == 1);
        CHECK(got[i] == got[0]);
        CHECK(got[i][0] == stepped[0]);
    }
    // A load after (or before) the step function's gradient would have the step apply the
    // gradients of the replaced weights: refused on every replica, before anything is read.
    for (const bool hook : {false, true}) {
        INFO((hook ? "from the gradient hook" : "from the step function"));
        const auto errors = tiny_errors([&](tiny_dp& dp, thread_communicator&) {
            dp.step(4, tiny_step);
            if (hook) {
                dp.set_gradient_hook([&](std::span<float>, std::span<const tensor_info>) {
                    load_checkpoint(dp, before);
                });
                dp.step(4, tiny_step);
            } else {
                dp.step(4, [&](tiny_net& n, const shard_range& r, auto& ctx) {
                    const double loss = tiny_step(n, r, ctx);
                    load_checkpoint(dp, before);
                    return loss;
                });
            }
        });
        for (std::size_t r = 0; r < 2; ++r) {
            INFO(errors[r]);
            CHECK(contains(errors[r], "[invalid_argument] replica " + std::to_string(r) +
                                          ": load_checkpoint: called while data_parallel.step "
                                          "of this trainer runs on the same thread"));
            CHECK(contains(errors[r], "call it between training calls"));
        }
    }
}

TEST_CASE("an asynchronous trainer's save from on_apply is refused on the server, not a timeout",
          "[train][checkpoint][thread][async]") {
    using dp_type = trainer_of<base_opt, sync::asynchronous, reduce::per_tensor, storage::registry>;
    using net = dp_type::network_type;
    temp_dir dir;
    const fs::path path = dir.path / "apply.ckpt";
    std::vector<std::string> errors;
    for (auto& e : lockstep_test::errors_of(3, [&](int, thread_communicator& comm) {
             dp_type* self = nullptr;
             async_params ap;
             ap.on_apply = [&](const apply_info&, double) { save_checkpoint(*self, path); };
             dp_type dp(
                 comm, [](auto& ctx) { return net(ctx); }, base_params, params_for(42), ap);
             self = &dp;
             dp.train(4, 8,
                      [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
         }))
        errors.push_back(std::move(e.first));
    INFO(errors[0]);
    CHECK(contains(errors[0], "[invalid_argument] replica 0: save_checkpoint: called while "
                              "data_parallel.train of this trainer runs on the same thread"));
    CHECK(contains(errors[0], "the workers are computing gradients, not saving"));
    // The workers learn of it from the server's abort (directly, or echoed by the worker that
    // got it) or from the thread group's report of the server's error, not from their timeout.
    for (std::size_t r = 1; r < 3; ++r) {
        INFO(errors[r]);
        CHECK(contains(errors[r], "[peer_failure]"));
        CHECK((contains(errors[r], "parameter_server: the server (rank 0) failed while applying "
                                   "work item ") ||
               contains(errors[r], "replica 0 failed: lockstep error [invalid_argument] replica "
                                   "0: save_checkpoint: called while")));
    }
    CHECK(!fs::exists(path));
}

namespace {

/// Freezes the tensors named in `names` (train_params::frozen).
std::function<void(train_params&)> freezing(const std::vector<std::string>& names) {
    return [names](train_params& tp) {
        tp.frozen = [names](const tensor_info& t) {
            return std::find(names.begin(), names.end(), t.name) != names.end();
        };
    };
}

} // namespace

TEST_CASE("a checkpoint records the frozen tensors: another set is refused, nothing loaded",
          "[train][checkpoint][thread]") {
    // The optimizer keeps one step count: a tensor frozen at the save and trained after the load
    // would start Adam's bias correction at the run's count (torch: at its own first step).
    using opt = optim::adam<float>;
    using loader = decltype([](const fs::path& p, const std::vector<std::string>& frozen) {
        return try_load<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            2, p, {.lr = 1e-2}, {}, 8, freezing(frozen));
    });
    temp_dir dir;
    const fs::path path = dir.path / "frozen.ckpt";
    run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        {.replicas = 2, .steps = 5, .save = path, .save_at = 5, .edit = freezing({"fc1.weight"})},
        {.lr = 1e-2});
    const std::string fix = "load it with that set, then construct a new trainer with the new "
                            "set whose network starts from the loaded parameters";

    SECTION("the same set resumes bitwise as the uninterrupted run") {
        const auto full = run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            {.replicas = 2, .steps = 9, .edit = freezing({"fc1.weight"})}, {.lr = 1e-2});
        const auto resumed = run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            {.replicas = 2, .seed = 7, .steps = 9, .load = path, .edit = freezing({"fc1.weight"})},
            {.lr = 1e-2});
        for (int r = 0; r < 2; ++r) {
            INFO("replica " << r);
            CHECK(resumed[r] == full[r]);
        }
    }
    SECTION("unfreezing is refused, naming the tensor and the fix") {
        check_refused(loader{}(path, {}),
                      {"refused: every replica: frozen: checkpoint {fc1.weight}, trainer {} "
                       "(unfrozen since the save: fc1.weight)",
                       fix});
    }
    SECTION("freezing more, or another tensor, is refused, naming each change") {
        check_refused(loader{}(path, {"fc1.weight", "bn1.weight"}),
                      {"frozen: checkpoint {fc1.weight}, trainer {bn1.weight,fc1.weight} "
                       "(frozen since the save: bn1.weight)",
                       fix});
        check_refused(loader{}(path, {"fc2.bias"}),
                      {"frozen: checkpoint {fc1.weight}, trainer {fc2.bias} (unfrozen since the "
                       "save: fc1.weight; frozen since the save: fc2.bias)"});
    }
    SECTION("a checkpoint written before the frozen set was recorded loads with any set") {
        for (int r = 0; r < 2; ++r)
            rewrite_shard(path, r, [](auto& meta, auto&) {
                std::erase_if(meta, [](const auto& kv) { return kv.first == "frozen"; });
            });
        CHECK(loader{}(path, {}).messages == std::vector<std::string>(2));
        CHECK(loader{}(path, {"fc1.weight"}).messages == std::vector<std::string>(2));
    }
}

namespace {

/// A learning rate schedule read from a table of `n` entries (a run of n steps), throwing
/// std::out_of_range past its end; `scale` changes its values.
std::function<void(train_params&)> lr_table(std::size_t n, double scale = 1.0) {
    return [n, scale](train_params& tp) {
        std::vector<double> table(n);
        for (std::size_t s = 0; s < n; ++s)
            table[s] = scale * 0.05 * (1.0 - static_cast<double>(s) / static_cast<double>(n));
        tp.lr = [table](std::int64_t s) { return table.at(static_cast<std::size_t>(s)); };
    };
}

} // namespace

TEST_CASE("a schedule defined for the run's steps only saves and resumes; another is refused",
          "[train][checkpoint][thread]") {
    // The checkpoint records the schedule at steps() + 1, + 10 and + 1000, past such a table's
    // end: "undefined" there, on save and load alike; the resume step's rate is required.
    using opt = base_opt;
    using loader = decltype([](const fs::path& p, const std::function<void(train_params&)>& edit) {
        return try_load<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            2, p, base_params, {}, 8, edit);
    });
    temp_dir dir;
    const fs::path path = dir.path / "table.ckpt";
    constexpr std::size_t total = 11;
    run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
        {.replicas = 2, .steps = 5, .save = path, .save_at = 5, .edit = lr_table(total)},
        base_params);

    SECTION("the same table resumes bitwise as the uninterrupted run") {
        const auto full = run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            {.replicas = 2, .steps = total, .edit = lr_table(total)}, base_params);
        const auto resumed = run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            {.replicas = 2, .seed = 7, .steps = total, .load = path, .edit = lr_table(total)},
            base_params);
        // Control: the table matters (another one ends elsewhere).
        const auto other = run<opt, sync::synchronous, reduce::per_tensor, storage::registry>(
            {.replicas = 2, .steps = total, .edit = lr_table(total, 0.5)}, base_params);
        for (int r = 0; r < 2; ++r) {
            INFO("replica " << r);
            CHECK(resumed[r] == full[r]);
            CHECK(other[r] != full[r]);
        }
    }
    SECTION("a table changed after the save is refused") {
        // 5 + 10 < 20: defined where the saved table was not.
        check_refused(loader{}(path, lr_table(20)), {"lr.schedule: checkpoint ", " undefined"});
        check_refused(loader{}(path, lr_table(total, 0.5)), {"lr.schedule: checkpoint "});
    }
    SECTION("a table that ends before the resume step: the save fails, the load is refused, "
            "naming the step") {
        const std::string why = "the learning rate schedule threw at step 5, the step the "
                                "checkpoint resumes at";
        std::vector<std::string> errors(2);
        thread_group(2).run([&](thread_communicator& comm) {
            using dp_type =
                trainer_of<opt, sync::synchronous, reduce::per_tensor, storage::registry>;
            train_params tp = params_for(3);
            lr_table(5)(tp);
            dp_type dp(
                comm, [](auto& ctx) { return dp_type::network_type(ctx); }, base_params, tp);
            step_to(dp, 5);
            try {
                save_checkpoint(dp, dir.path / "short.ckpt");
            } catch (const lockstep::error& e) {
                if (e.code() == errc::checkpoint)
                    errors[static_cast<std::size_t>(comm.rank())] = e.what();
            }
        });
        for (const std::string& e : errors) {
            INFO(e);
            CHECK(contains(e, "save_checkpoint: saving checkpoint '"));
            CHECK(contains(e, why));
            CHECK(contains(e, "vector")); // the schedule's std::out_of_range, from at()
        }
        check_refused(loader{}(path, lr_table(5)), {why});
    }
}

namespace {

double probe_feature(std::uint64_t g, std::size_t k) {
    return rng_stream{0xC0FE, 3}.normal(g, k) * double(k + 1) + double(k);
}

/// Each replica's error from saving a bn_probe (running statistics exposed or not) after one step,
/// blocking (`background` false) or with save_checkpoint_async and wait_checkpoint.
template <bool Exposed>
std::vector<std::pair<std::string, int>> save_probe(const fs::path& path, bool background) {
    using probe = lockstep_test::bn_probe<bn::global, probe_feature, Exposed>;
    return lockstep_test::errors_of(2, [&](int, thread_communicator& comm) {
        data_parallel<probe, optim::sgd<double>> dp(comm, [](auto& ctx) { return probe(ctx); },
                                                    {.lr = 0.01});
        (void)dp.step(8, [](probe& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
        if (!background) {
            save_checkpoint(dp, path);
            return;
        }
        save_checkpoint_async(dp, path);
        (void)wait_checkpoint(dp);
    });
}

} // namespace

TEST_CASE("a save refuses to leave out running statistics a batch-norm layer keeps unexposed",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    for (const bool background : {false, true}) {
        CAPTURE(background);
        const fs::path path = dir.path / (background ? "async.ckpt" : "blocking.ckpt");
        const auto errors = save_probe<false>(path, background);
        for (std::size_t r = 0; r < errors.size(); ++r) {
            CAPTURE(r, errors[r].first);
            CHECK(errors[r].second == static_cast<int>(errc::checkpoint));
            CHECK(contains(errors[r].first, "replica " + std::to_string(r) +
                                                ": save_checkpoint: layer 0 in forward order "
                                                "(batch_norm, bn::global, 3 channels) keeps "
                                                "running statistics that the checkpoint would "
                                                "leave out"));
            CHECK(contains(errors[r].first,
                           "expose them, f(\"<layer>.running_mean\", layer.running_mean()) and "
                           "f(\"<layer>.running_var\", layer.running_var()) in for_each_state"));
        }
        for (const auto& [text, code] : save_probe<true>(path, background)) {
            INFO(text);
            CHECK(code == -1);
        }
    }
}

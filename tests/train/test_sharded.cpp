// reduce::sharded (ZeRO stage 1) on thread replicas: equal to the unsharded bucketed trainer for
// SGD, Adam, AdamW, LARS, LAMB in float and double on 1-4 replicas (uneven and empty shards),
// with clipping, skipped steps, checkpoints and the optimizer state figure.
// SPDX-License-Identifier: Apache-2.0
#include "checkpoint_support.hpp"
#include "sharded_runner.hpp"
#include "train_runner.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using namespace lockstep_test;

namespace {

// 83 parameters of 4 bytes: buckets of 64 bytes cut every tensor into its own bucket or two, and
// the shards of 2-4 replicas cut fc1.weight, bn1.weight and fc2.weight.
using sharded_policy = reduce::sharded<64, 32>;
using bucketed_policy = reduce::bucketed<64, 32>;

struct sharded_options {
    int replicas = 1;
    double max_grad_norm = 0;
    int poison_rank = -1;
    int poison_step = -1;
    overlap_mode overlap = overlap_mode::automatic;
    bool frozen_and_decay = false; ///< freeze bn1.weight, no decay on biases
};

/// Parameters of every replica after every step of the batch schedule, with the results and
/// each replica's optimizer state bytes.
template <class T>
struct sharded_record {
    std::vector<std::vector<std::vector<T>>> params; ///< [rank][step]
    std::vector<T> initial;                          ///< rank 0's, before the first step
    std::vector<std::vector<step_result>> results;   ///< [rank][step]
    std::vector<std::size_t> state_bytes;            ///< [rank]
    std::vector<tensor_info> layout;
};

template <class T, class Opt, class Reduce>
sharded_record<T> run_mlp(const sharded_options& o, typename Opt::params_type op) {
    using net = mlp<T, thread_communicator, storage::registry, bn::global>;
    const auto R = static_cast<std::size_t>(o.replicas);
    sharded_record<T> rec;
    rec.params.resize(R);
    rec.results.resize(R);
    rec.state_bytes.resize(R);
    thread_group group(o.replicas);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        train_params tp{.overlap = o.overlap, .seed = 42, .max_grad_norm = o.max_grad_norm};
        if (o.frozen_and_decay) {
            tp.frozen = [](const tensor_info& t) { return t.name == "bn1.weight"; };
            tp.decay = [](const tensor_info& t) {
                return t.name.find("bias") == std::string::npos;
            };
        }
        data_parallel<net, Opt, sync::synchronous, Reduce, thread_communicator> dp(
            comm, [](auto& ctx) { return net(ctx); }, op, tp);
        if (r == 0) {
            rec.layout = dp.registry().parameters();
            const auto p = dp.parameters();
            rec.initial.assign(p.begin(), p.end());
        }
        rec.state_bytes[r] = dp.optimizer_state_bytes();
        const auto batches = batch_schedule();
        for (std::size_t s = 0; s < batches.size(); ++s) {
            dp.network().poison =
                comm.rank() == o.poison_rank && static_cast<int>(s) == o.poison_step;
            rec.results[r].push_back(
                dp.step(batches[s], [](net& n, const shard_range& range, auto& ctx) {
                    return n.train(range, ctx);
                }));
            auto p = dp.parameters();
            rec.params[r].emplace_back(p.begin(), p.end());
        }
    });
    return rec;
}

/// The first (rank, step) whose parameters differ in any bit from rank 0's, or "".
template <class T>
std::string divergence(const sharded_record<T>& rec) {
    for (std::size_t r = 1; r < rec.params.size(); ++r)
        for (std::size_t s = 0; s < rec.params[r].size(); ++s)
            if (!same_bits(std::span<const T>(rec.params[r][s]),
                           std::span<const T>(rec.params[0][s])))
                return "replica " + std::to_string(r) + " step " + std::to_string(s);
    return "";
}

template <class T, template <class> class Case>
void check_against_bucketed(std::initializer_list<int> replica_counts, double max_grad_norm,
                            bool frozen_and_decay = false) {
    using opt = typename Case<T>::type;
    for (int replicas : replica_counts) {
        INFO("replicas " << replicas << ", max_grad_norm " << max_grad_norm);
        const sharded_options o{.replicas = replicas,
                                .max_grad_norm = max_grad_norm,
                                .frozen_and_decay = frozen_and_decay};
        const auto ref = run_mlp<T, opt, bucketed_policy>(o, Case<T>::params());
        const auto run = run_mlp<T, opt, sharded_policy>(o, Case<T>::params());
        // The reference trained: weights moved away from the first step's.
        REQUIRE(rel_error(ref.params[0].back(), ref.params[0].front()) > 1e-3);
        CHECK(divergence(run).empty());
        for (std::size_t s = 0; s < run.params[0].size(); ++s) {
            INFO("step " << s);
            CHECK(max_tensor_rel_error(run.params[0][s], ref.params[0][s], ref.layout) <=
                  sharded_tolerance<T>);
            // The loss within the parameters' bound: it is computed from the previous step's
            // parameters (within that bound), and a float sum's rounding (37 terms) is below it.
            CHECK(run.results[0][s].loss ==
                  Approx(ref.results[0][s].loss).epsilon(sharded_tolerance<T>));
            CHECK_FALSE(run.results[0][s].skipped);
        }
        if (frozen_and_decay) { // frozen: never updated, from the start
            const auto bn1 =
                std::find_if(run.layout.begin(), run.layout.end(),
                             [](const tensor_info& t) { return t.name == "bn1.weight"; });
            REQUIRE(bn1 != run.layout.end());
            CHECK(
                same_bits(std::span<const T>(run.params[0].back()).subspan(bn1->offset, bn1->size),
                          std::span<const T>(run.initial).subspan(bn1->offset, bn1->size)));
        }
        // The optimizer state: the shards' bytes add up to the unsharded figure, and each
        // replica holds at most its balanced share.
        std::size_t sum = 0;
        for (std::size_t r = 0; r < run.state_bytes.size(); ++r) {
            sum += run.state_bytes[r];
            CHECK(run.state_bytes[r] <=
                  (ref.state_bytes[r] + ref.state_bytes[r] / 83 * (replicas - 1)) / replicas);
        }
        CHECK(sum == ref.state_bytes[0]);
    }
}

template <class T>
void check_all_optimizers(double max_grad_norm) {
    SECTION("sgd") {
        check_against_bucketed<T, sgd_case>({1, 2, 3, 4}, max_grad_norm);
    }
    SECTION("adam") {
        check_against_bucketed<T, adam_case>({1, 2, 3, 4}, max_grad_norm);
    }
    SECTION("adamw") {
        check_against_bucketed<T, adamw_case>({1, 2, 3, 4}, max_grad_norm);
    }
    SECTION("lars") {
        check_against_bucketed<T, lars_case>({1, 2, 3, 4}, max_grad_norm);
    }
    SECTION("lamb") {
        check_against_bucketed<T, lamb_case>({1, 2, 3, 4}, max_grad_norm);
    }
}

} // namespace

TEST_CASE("reduce::sharded trains like the unsharded bucketed trainer", "[train][thread]") {
    SECTION("float") {
        check_all_optimizers<float>(0);
    }
    SECTION("double") {
        check_all_optimizers<double>(0);
    }
}

TEST_CASE("reduce::sharded clips by the norm of the whole reduced gradient", "[train][thread]") {
    // 0.05 is below the gradient norm of most steps: the factor is < 1 and varies per step.
    SECTION("float") {
        check_all_optimizers<float>(0.05);
    }
    SECTION("double") {
        check_all_optimizers<double>(0.05);
    }
}

TEST_CASE("reduce::sharded with frozen tensors and per-tensor decay", "[train][thread]") {
    // bn1.weight [40, 48) frozen: the segments skip it, so LARS/LAMB's shard segments map to
    // tensor indices that skip it too.
    SECTION("lars") {
        check_against_bucketed<double, lars_case>({3, 4}, 0.05, true);
    }
    SECTION("lamb") {
        check_against_bucketed<float, lamb_case>({3, 4}, 0, true);
    }
    SECTION("adamw") {
        check_against_bucketed<double, adamw_case>({4}, 0, true);
    }
}

TEST_CASE("reduce::sharded with overlap off and on gives the same bits", "[train][thread]") {
    using opt = optim::lamb<double>;
    const auto on = run_mlp<double, opt, sharded_policy>(
        {.replicas = 3, .overlap = overlap_mode::always}, lamb_case<double>::params());
    const auto off = run_mlp<double, opt, sharded_policy>(
        {.replicas = 3, .overlap = overlap_mode::never}, lamb_case<double>::params());
    for (std::size_t s = 0; s < on.params[0].size(); ++s)
        CHECK(same_bits(std::span<const double>(on.params[0][s]),
                        std::span<const double>(off.params[0][s])));
}

TEST_CASE("reduce::sharded skips a step with a non-finite gradient on every replica",
          "[train][thread]") {
    using opt = optim::adam<float>;
    const auto run = run_mlp<float, opt, sharded_policy>(
        {.replicas = 3, .poison_rank = 2, .poison_step = 4}, adam_case<float>::params());
    CHECK(divergence(run).empty());
    for (int r = 0; r < 3; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        CHECK(run.results[ur][4].skipped);
        CHECK_FALSE(run.results[ur][3].skipped);
        // Nothing applied: the parameters after step 4 are those after step 3.
        CHECK(same_bits(std::span<const float>(run.params[ur][4]),
                        std::span<const float>(run.params[ur][3])));
    }
}

namespace {

/// tiny_net (3 parameters) on `replicas` threads for 20 steps: parameters after each step.
template <class Opt, class Reduce>
std::vector<std::vector<std::vector<double>>> run_tiny(int replicas, typename Opt::params_type op) {
    using net = tiny_net<double, thread_communicator>;
    std::vector<std::vector<std::vector<double>>> out(static_cast<std::size_t>(replicas));
    std::size_t last_shard_bytes = 0;
    thread_group group(replicas);
    group.run([&](thread_communicator& comm) {
        data_parallel<net, Opt, sync::synchronous, Reduce, thread_communicator> dp(
            comm, [](auto& ctx) { return net(ctx); }, op, {.max_grad_norm = 1.0});
        // 3 elements over 4 replicas: the last shard is empty (checked after the run: Catch2
        // assertions are not thread-safe).
        if (Reduce::shards_optimizer_state && comm.rank() == 3)
            last_shard_bytes = dp.optimizer_state_bytes();
        for (std::size_t b : batch_schedule()) {
            dp.step(
                b, [](net& n, const shard_range& range, auto& ctx) { return n.train(range, ctx); });
            auto p = dp.parameters();
            out[static_cast<std::size_t>(comm.rank())].emplace_back(p.begin(), p.end());
        }
    });
    CHECK(last_shard_bytes == 0);
    return out;
}

template <template <class> class Case>
void check_tiny() {
    using opt = typename Case<double>::type;
    for (int replicas : {3, 4}) {
        INFO("replicas " << replicas);
        const auto ref = run_tiny<opt, reduce::per_tensor>(replicas, Case<double>::params());
        const auto run = run_tiny<opt, reduce::sharded<4, 4>>(replicas, Case<double>::params());
        REQUIRE(rel_error(ref[0].back(), ref[0].front()) > 1e-3);
        for (std::size_t s = 0; s < run[0].size(); ++s) {
            INFO("step " << s);
            CHECK(rel_error(run[0][s], ref[0][s]) <= 1e-10);
            for (std::size_t r = 1; r < run.size(); ++r)
                CHECK(same_bits(std::span<const double>(run[r][s]),
                                std::span<const double>(run[0][s])));
        }
    }
}

} // namespace

TEST_CASE("reduce::sharded with an empty shard (3 parameters over 4 replicas)", "[train][thread]") {
    SECTION("sgd") {
        check_tiny<sgd_case>();
    }
    SECTION("adam") {
        check_tiny<adam_case>();
    }
    SECTION("lars") {
        check_tiny<lars_case>();
    }
    SECTION("lamb") {
        check_tiny<lamb_case>();
    }
}

TEST_CASE("reduce::sharded holds about 1/N of the optimizer state", "[train][thread]") {
    using net = mlp<float, thread_communicator, storage::registry, bn::global>;
    const mlp_shape big{.in = 64, .hidden = 256, .out = 10};
    for (int replicas : {2, 4}) {
        std::vector<std::size_t> sharded(static_cast<std::size_t>(replicas)),
            whole(static_cast<std::size_t>(replicas));
        std::size_t params = 0;
        thread_group group(replicas);
        group.run([&](thread_communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            auto make = [&](auto& ctx) { return net(ctx, big); };
            data_parallel<net, optim::adam<float>, sync::synchronous, reduce::sharded<>,
                          thread_communicator>
                a(comm, make);
            data_parallel<net, optim::adam<float>, sync::synchronous, reduce::bucketed<>,
                          thread_communicator>
                b(comm, make);
            sharded[r] = a.optimizer_state_bytes();
            whole[r] = b.optimizer_state_bytes();
            if (r == 0)
                params = a.parameters().size();
        });
        std::size_t sum = 0;
        for (int r = 0; r < replicas; ++r) {
            const auto ur = static_cast<std::size_t>(r);
            std::printf("adam<float>, %zu parameters, %d replicas: optimizer state on replica "
                        "%d: sharded %zu bytes, unsharded %zu bytes (ratio %.4f)\n",
                        params, replicas, r, sharded[ur], whole[ur],
                        static_cast<double>(sharded[ur]) / static_cast<double>(whole[ur]));
            CHECK(whole[ur] == 2 * params * sizeof(float));
            // Balanced: at most one element per buffer above the exact 1/N share.
            CHECK(sharded[ur] * static_cast<std::size_t>(replicas) <=
                  whole[ur] + 2 * sizeof(float) * static_cast<std::size_t>(replicas));
            sum += sharded[ur];
        }
        CHECK(sum == whole[0]);
    }
}

TEST_CASE("reduce::sharded checkpoints: per-shard state, bit-identical resume, refusals",
          "[train][thread][checkpoint]") {
    using net = mlp<double, thread_communicator, storage::registry, bn::global>;
    using opt = optim::lamb<double>;
    using dp_type = data_parallel<net, opt, sync::synchronous, sharded_policy, thread_communicator>;
    temp_dir dir("sharded");
    const auto path = dir.path / "ck";
    const auto batches = batch_schedule();
    const train_params tp{.seed = 42, .max_grad_norm = 0.05};
    auto fn = [](net& n, const shard_range& range, auto& ctx) { return n.train(range, ctx); };
    std::vector<std::vector<std::byte>> straight(3), resumed(3);
    std::vector<double> straight_params;
    std::vector<std::int64_t> steps_after_load(3, -1);
    {
        thread_group group(3);
        group.run([&](thread_communicator& comm) {
            dp_type dp(
                comm, [](auto& ctx) { return net(ctx); }, lamb_case<double>::params(), tp);
            for (std::size_t s = 0; s < 10; ++s)
                dp.step(batches[s], fn);
            save_checkpoint(dp, path);
            for (std::size_t s = 10; s < 20; ++s)
                dp.step(batches[s], fn);
            straight[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
            if (comm.rank() == 0)
                straight_params.assign(dp.parameters().begin(), dp.parameters().end());
        });
    }
    {
        thread_group group(3);
        group.run([&](thread_communicator& comm) {
            dp_type dp(
                comm, [](auto& ctx) { return net(ctx); }, lamb_case<double>::params(), tp);
            load_checkpoint(dp, path);
            steps_after_load[static_cast<std::size_t>(comm.rank())] = dp.steps();
            for (std::size_t s = 10; s < 20; ++s)
                dp.step(batches[s], fn);
            resumed[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
        });
    }
    for (std::size_t r = 0; r < 3; ++r) {
        INFO("replica " << r);
        CHECK(steps_after_load[r] == 10);
        CHECK(straight[r] == resumed[r]);
    }
    // Catch2 assertions are not thread-safe: each replica records what load_checkpoint threw,
    // the test checks after the run.
    struct refusal {
        bool thrown = false;
        errc code = errc::invalid_argument;
        std::string what;
    };
    SECTION("another replica count loads: the optimizer state is resplit (LAMB)") {
        // test_checkpoint_resize.cpp checks the regathered state bitwise; here LAMB's
        // cross-shard trust ratios continue on the new layout, within 1e-12 of the 3-replica
        // run (double precision: the 2-replica steps sum in another order).
        std::vector<refusal> got(2);
        std::vector<std::int64_t> steps(2, -1);
        std::vector<std::vector<double>> params(2);
        thread_group group(2);
        group.run([&](thread_communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            dp_type dp(
                comm, [](auto& ctx) { return net(ctx); }, lamb_case<double>::params(), tp);
            try {
                load_checkpoint(dp, path);
            } catch (const lockstep::error& e) {
                got[r] = {true, e.code(), e.what()};
                return;
            }
            steps[r] = dp.steps();
            for (std::size_t s = 10; s < 20; ++s)
                dp.step(batches[s], fn);
            params[r].assign(dp.parameters().begin(), dp.parameters().end());
        });
        for (std::size_t r = 0; r < 2; ++r) {
            INFO("replica " << r << ": " << got[r].what);
            CHECK(!got[r].thrown);
            CHECK(steps[r] == 10);
            REQUIRE(params[r].size() == straight_params.size());
            double diff = 0;
            for (std::size_t i = 0; i < params[r].size(); ++i)
                diff = std::max(diff, std::abs(params[r][i] - straight_params[i]));
            CHECK(diff <= 1e-12);
        }
    }
    SECTION("the unsharded trainer is refused, naming both layouts") {
        std::vector<refusal> got(3);
        thread_group group(3);
        group.run([&](thread_communicator& comm) {
            data_parallel<net, opt, sync::synchronous, bucketed_policy, thread_communicator> dp(
                comm, [](auto& ctx) { return net(ctx); }, lamb_case<double>::params(), tp);
            try {
                load_checkpoint(dp, path);
            } catch (const lockstep::error& e) {
                got[static_cast<std::size_t>(comm.rank())] = {true, e.code(), e.what()};
            }
        });
        for (const refusal& r : got) {
            REQUIRE(r.thrown); // loading a sharded checkpoint into an unsharded trainer
            CHECK(r.code == errc::checkpoint);
            CHECK_THAT(r.what, Catch::Contains("reduce: checkpoint reduce::sharded<64, 32>, "
                                               "trainer reduce::bucketed<64, 32>"));
            CHECK_THAT(r.what, Catch::Contains("reduce.shard: [0, 28) of 83 in the "
                                               "checkpoint, unknown to the trainer"));
            // Replica 0's shard file holds the optimizer state of its 28 elements only.
            CHECK_THAT(r.what, Catch::Contains("section 'optimizer.exp_avg': checkpoint "
                                               "f64 {28}, trainer f64 {83}"));
        }
    }
}

// train_params::max_consecutive_skips on thread replicas: a replica whose gradient is NaN at every
// step stops training on every replica at the limit, naming the replica and the tensor; isolated
// skips, limit 0 and a loss scale backing off never throw; read_result = false throws at the next
// read; skipped_steps() counts. SPDX-License-Identifier: Apache-2.0
#include "mixed_fixture.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

using namespace lockstep_test;

namespace {

using net = mlp<float, thread_communicator, storage::registry>;
auto train_fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };

/// What one replica saw of a run: each step's skip flag until it threw, the error and its code,
/// the step it threw at (-1: none), finish()'s result and skipped_steps().
struct outcome {
    std::vector<bool> skipped;
    std::string error;
    int code = -1;
    int thrown_at = -1;
    std::int64_t finished = -1;
    std::int64_t skipped_steps = -1;
};

struct run_options {
    int replicas = 3;
    int steps = 10;
    train_params tp = {};
    std::set<std::pair<int, int>> poison = {}; ///< (step, replica): a NaN gradient element
    /// read_result = false: read_result() after the steps in this set (finish() reads the rest).
    std::set<int> read_after = {};
};

/// `steps` steps of 12 samples (a different shard of them on each replica) under
/// data_parallel<net, sgd, synchronous, bucketed>; stops at the first error, else finish().
std::vector<outcome> run(const run_options& o) {
    std::vector<outcome> out(static_cast<std::size_t>(o.replicas));
    thread_group(o.replicas, {.timeout = std::chrono::seconds(30)})
        .run([&](thread_communicator& comm) {
            outcome& me = out[static_cast<std::size_t>(comm.rank())];
            int k = 0;
            try {
                data_parallel<net, optim::sgd<float>> dp(
                    comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, o.tp);
                for (; k < o.steps; ++k) {
                    dp.network().poison = o.poison.count({k, comm.rank()}) != 0;
                    step_result r = dp.step(12, train_fn);
                    if (!r.ready && o.read_after.count(k) != 0)
                        r = dp.read_result();
                    if (r.ready)
                        me.skipped.push_back(r.skipped);
                }
                me.finished = dp.finish();
                me.skipped_steps = dp.skipped_steps();
            } catch (const error& e) {
                me.error = e.what();
                me.code = static_cast<int>(e.code());
                me.thrown_at = k;
            }
        });
    return out;
}

std::set<std::pair<int, int>> every_step(int replica, int steps) {
    std::set<std::pair<int, int>> s;
    for (int k = 0; k < steps; ++k)
        s.insert({k, replica});
    return s;
}

} // namespace

TEST_CASE("a replica with a NaN gradient at every step stops every replica at the limit",
          "[train][thread][non_finite]") {
    for (const int replicas : {2, 3}) {
        const auto out = run({.replicas = replicas,
                              .steps = 10,
                              .tp = {.max_consecutive_skips = 4},
                              .poison = every_step(1, 10)});
        for (const outcome& o : out) {
            INFO("replicas " << replicas << ": " << o.error);
            CHECK(o.code == static_cast<int>(errc::non_finite));
            CHECK(o.thrown_at == 3); // the 4th step, not before
            CHECK(o.skipped == std::vector<bool>(3, true));
            CHECK_THAT(o.error, Catch::Contains("data_parallel.step: step 3: 4 consecutive steps "
                                                "skipped, the limit "
                                                "(train_params::max_consecutive_skips)"));
            CHECK_THAT(o.error, Catch::Contains(" 1 non-finite gradient element(s) on replica 1, "
                                                "the first in 'fc2.weight' (element 0);"));
            CHECK_THAT(o.error, Catch::Contains("4 step(s) skipped in all"));
            CHECK_THAT(o.error,
                       !Catch::Contains("on replica 0") && !Catch::Contains("on replica 2"));
        }
        if (replicas == 3)
            WARN("the message of replica 0: " << out[0].error); // pasted into troubleshooting.md
    }
}

TEST_CASE("the default limit is on: 20 consecutive skips stop training",
          "[train][thread][non_finite]") {
    const auto out = run({.replicas = 2, .steps = 25, .poison = every_step(0, 25)});
    for (const outcome& o : out) {
        INFO(o.error);
        CHECK(o.code == static_cast<int>(errc::non_finite));
        CHECK(o.thrown_at == 19);
        CHECK_THAT(o.error, Catch::Contains("on replica 0, the first in 'fc2.weight'"));
    }
}

TEST_CASE("isolated NaN steps never reach the limit; skipped_steps counts them",
          "[train][thread][non_finite]") {
    // Runs of 2 skips with the limit 3, on different replicas; an applied step ends each run.
    const std::set<std::pair<int, int>> poison = {{0, 1}, {1, 2}, {3, 0}, {4, 0}, {6, 1}, {7, 1}};
    const auto out =
        run({.replicas = 3, .steps = 9, .tp = {.max_consecutive_skips = 3}, .poison = poison});
    const std::vector<bool> want{true, true, false, true, true, false, true, true, false};
    for (const outcome& o : out) {
        INFO(o.error);
        CHECK(o.error.empty());
        CHECK(o.skipped == want);
        CHECK(o.finished == 9);
        CHECK(o.skipped_steps == 6);
    }
}

TEST_CASE("local SGD: the replica whose own steps keep skipping throws, its peer fails at the "
          "average",
          "[train][thread][non_finite]") {
    using local_net = mlp<float, thread_communicator, storage::registry, bn::local>;
    std::vector<outcome> out(2);
    thread_group group(2, {.timeout = std::chrono::seconds(30)});
    // The replica that throws fails the run (as it would uncaught), so its peer is woken.
    CHECK_THROWS(group.run([&](thread_communicator& comm) {
        outcome& me = out[static_cast<std::size_t>(comm.rank())];
        int k = 0;
        try {
            data_parallel<local_net, optim::sgd<float>, sync::local_sgd<2>> dp(
                comm, [](auto& ctx) { return local_net(ctx); }, {.lr = 0.1},
                {.max_consecutive_skips = 3});
            dp.network().poison = comm.rank() == 1;
            for (; k < 6; ++k)
                me.skipped.push_back(dp.step(12, [](local_net& n, const shard_range& r, auto& ctx) {
                                           return n.train(r, ctx);
                                       }).skipped);
            dp.finish();
        } catch (const error& e) {
            me.error = e.what();
            me.code = static_cast<int>(e.code());
            me.thrown_at = k;
            throw;
        }
    }));
    INFO(out[1].error);
    CHECK(out[1].code == static_cast<int>(errc::non_finite));
    CHECK(out[1].thrown_at == 2);
    CHECK_THAT(out[1].error,
               Catch::Contains("step 2: 3 consecutive steps skipped") &&
                   Catch::Contains("on replica 1 (local SGD), the first in 'fc2.weight'"));
    INFO(out[0].error);
    CHECK(out[0].code == static_cast<int>(errc::peer_failure)); // at the average after step 3
    CHECK(out[0].skipped == std::vector<bool>(3, false));
}

TEST_CASE("max_consecutive_skips = 0 never throws", "[train][thread][non_finite]") {
    const auto out = run({.replicas = 2,
                          .steps = 25,
                          .tp = {.max_consecutive_skips = 0},
                          .poison = every_step(1, 25)});
    for (const outcome& o : out) {
        INFO(o.error);
        CHECK(o.error.empty());
        CHECK(o.skipped == std::vector<bool>(25, true));
        CHECK(o.skipped_steps == 25);
    }
}

TEST_CASE("a negative limit is refused at construction", "[train][thread][non_finite]") {
    const auto out = run({.replicas = 2, .steps = 1, .tp = {.max_consecutive_skips = -1}});
    for (const outcome& o : out) {
        CHECK(o.code == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.error, Catch::Contains("max_consecutive_skips = -1 (must be >= 0"));
    }
}

TEST_CASE("read_result = false: the run is counted on the device, the error comes at the next "
          "read",
          "[train][thread][non_finite]") {
    SECTION("at read_result()") {
        // The limit (3) is reached at step 2; nothing is read until after step 5, whose state
        // names step 2 (steps 3..5 ran on, skipped).
        const auto out = run({.replicas = 2,
                              .steps = 8,
                              .tp = {.max_consecutive_skips = 3, .read_result = false},
                              .poison = every_step(1, 8),
                              .read_after = {5}});
        for (const outcome& o : out) {
            INFO(o.error);
            CHECK(o.code == static_cast<int>(errc::non_finite));
            CHECK(o.thrown_at == 5);
            CHECK(o.skipped.empty());
            CHECK_THAT(o.error, Catch::Contains("step 2: 3 consecutive steps skipped"));
            CHECK_THAT(o.error, Catch::Contains("on replica 1, the first in 'fc2.weight'"));
            CHECK_THAT(o.error, Catch::Contains("6 step(s) skipped in all"));
        }
    }
    SECTION("at finish(), also when the NaN went away after the limit") {
        std::set<std::pair<int, int>> poison = every_step(0, 4);
        const auto out = run({.replicas = 2,
                              .steps = 7,
                              .tp = {.max_consecutive_skips = 4, .read_result = false},
                              .poison = poison});
        for (const outcome& o : out) {
            INFO(o.error);
            CHECK(o.code == static_cast<int>(errc::non_finite));
            CHECK(o.thrown_at == 7); // in finish()
            CHECK_THAT(o.error, Catch::Contains("step 3: 4 consecutive steps skipped"));
            CHECK_THAT(o.error, Catch::Contains("on replica 0, the first in 'fc2.weight'"));
        }
    }
    SECTION("finish() reads the last step: the skipped count without a throw") {
        const auto out = run({.replicas = 2,
                              .steps = 6,
                              .tp = {.max_consecutive_skips = 3, .read_result = false},
                              .poison = {{1, 0}, {2, 1}, {4, 1}}});
        for (const outcome& o : out) {
            INFO(o.error);
            CHECK(o.error.empty());
            CHECK(o.finished == 6);
            CHECK(o.skipped_steps == 3);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Loss scaling: a 16-bit network whose backward overflows at the first scales backs off without
// counting those skips; one held at a floor where it still overflows throws.

namespace {

template <class Compute>
using scaled_trainer = data_parallel<linreg<Compute>, optim::sgd<float>, sync::synchronous,
                                     reduce::per_tensor, thread_communicator>;

struct scaled_outcome {
    std::vector<bool> skipped;
    std::vector<double> scales;
    std::string error;
    int code = -1;
    int thrown_at = -1;
};

/// `steps` full-batch steps on 2 thread replicas of the trainer make(comm) returns (a
/// std::unique_ptr<scaled_trainer<Compute>>), before(comm, dp) ahead of each: each replica's
/// skips and scales, and the error that stopped it (construction included) with its step.
template <class Compute, class Make, class Before>
std::vector<scaled_outcome> run_scaled_with(int steps, Make make, Before before) {
    std::vector<scaled_outcome> out(2);
    thread_group(2, {.timeout = std::chrono::seconds(30)}).run([&](thread_communicator& comm) {
        scaled_outcome& me = out[static_cast<std::size_t>(comm.rank())];
        int k = 0;
        try {
            const auto dp = make(comm);
            for (; k < steps; ++k) {
                before(comm, *dp);
                const step_result r =
                    dp->step(n_samples, [](linreg<Compute>& n, shard_range sr, auto& ctx) {
                        return n.train(sr, ctx);
                    });
                me.skipped.push_back(r.skipped);
                me.scales.push_back(r.loss_scale);
            }
            dp->finish();
        } catch (const error& e) {
            me.error = e.what();
            me.code = static_cast<int>(e.code());
            me.thrown_at = k;
        }
    });
    return out;
}

/// `steps` full-batch steps of linreg<Compute> (loss weight `weight`, lr / weight) on 2 thread
/// replicas with loss scaling `cfg` and the limit 3.
template <class Compute>
std::vector<scaled_outcome> run_scaled(loss_scaling cfg, double weight, int steps) {
    return run_scaled_with<Compute>(
        steps,
        [&](thread_communicator& comm) {
            return std::make_unique<scaled_trainer<Compute>>(
                comm, [](auto& ctx) { return linreg<Compute>(ctx); },
                optim::sgd_params{.lr = lr / weight},
                train_params{.max_consecutive_skips = 3, .loss_scale = cfg});
        },
        [&](thread_communicator&, scaled_trainer<Compute>& dp) { dp.network().weight = weight; });
}

/// The type's init scale and loss weight for a backward that overflows (as infinity) until
/// the scale has halved at least 6 times: half overflows past 65504, bfloat16 (and float,
/// through which both are rounded) past 2^128, so the weight takes the scale's seed there
/// (scales stop at max_loss_scale<float>() = 2^126).
template <class Compute>
struct overflowing {
    static constexpr double init = 65536.0, weight = 4096.0;
};
template <>
struct overflowing<bfloat16> {
    static inline const double init = std::ldexp(1.0, 126), weight = 256.0;
};

} // namespace

TEMPLATE_TEST_CASE("loss scaling: a scale backing off skips many steps in a row without throwing; "
                   "held at a floor where it still overflows, it throws",
                   "[train][thread][mixed][non_finite]", lockstep::half, bfloat16) {
    const double init = overflowing<TestType>::init, weight = overflowing<TestType>::weight;
    const auto free = run_scaled<TestType>({.init_scale = init}, weight, 20);
    int backoffs = 0;
    for (const scaled_outcome& o : free) {
        INFO(o.error);
        REQUIRE(o.error.empty());
        CHECK(o.skipped == free[0].skipped);
        CHECK(o.scales == free[0].scales);
    }
    while (backoffs < 20 && free[0].skipped[std::size_t(backoffs)])
        ++backoffs;
    INFO("skips while backing off: " << backoffs);
    CHECK(backoffs >= 6); // far past the limit 3
    CHECK(backoffs <= 16);
    // Then it trains: no skip once the scale fits.
    for (std::size_t k = std::size_t(backoffs); k < free[0].skipped.size(); ++k)
        CHECK_FALSE(free[0].skipped[k]);

    // The floor 4 halvings down, where it still overflows: 4 uncounted back-offs, then 3
    // counted skips at the floor.
    const double floor = init / 16;
    const auto held = run_scaled<TestType>({.init_scale = init, .min_scale = floor}, weight, 14);
    for (const scaled_outcome& o : held) {
        INFO(o.error);
        CHECK(o.code == static_cast<int>(errc::non_finite));
        CHECK(o.thrown_at == 6);
        CHECK(o.scales == std::vector<double>{init, init / 2, init / 4, init / 8, floor, floor});
        CHECK_THAT(o.error, Catch::Contains("step 6: 3 consecutive steps skipped at loss scale " +
                                            lockstep::detail::concat(floor) +
                                            ", the floor (loss_scaling::min_scale = " +
                                            lockstep::detail::concat(floor) + "), the limit"));
        CHECK_THAT(o.error, Catch::Contains("non-finite gradient element(s) on replica 0, the "
                                            "first in 'w' (element "));
        CHECK_THAT(o.error, Catch::Contains("7 step(s) skipped in all"));
    }
}

TEST_CASE("loss_scaling::min_scale: the scale backs off to the floor and stays; a floor above "
          "init_scale is refused",
          "[train][mixed]") {
    host_system sys{1};
    loss_scaler<host_system> s(loss_scaling{.init_scale = 64, .min_scale = 16}, sys);
    double overflow = 1, skipped = 1;
    kernels::loss_scale_record report{};
    std::vector<double> used;
    for (int k = 0; k < 4; ++k) {
        s.update(&overflow, &skipped, &report);
        used.push_back(report.used);
    }
    CHECK(used == std::vector<double>{64, 32, 16, 16});
    CHECK(s.state() == loss_scaler_state{16, 0});
    CHECK_THROWS_WITH(
        loss_scaler<host_system>(loss_scaling{.init_scale = 8, .min_scale = 16}, sys),
        Catch::Contains("min_scale = 16 (must be finite, > 0 and <= init_scale = 8)"));
}

TEST_CASE("loss scaling: a scale restored below min_scale starts at min_scale, and the runaway "
          "at the floor names min_scale and the scale",
          "[train][thread][mixed][non_finite]") {
    // As a resume with min_scale raised from 1 to 1024 after the scale backed off to 2: the old
    // code kept 2 and called it the floor.
    std::vector<loss_scaler_state> restored(2);
    const auto out = run_scaled_with<float>(
        6,
        [&](thread_communicator& comm) {
            auto dp = std::make_unique<scaled_trainer<float>>(
                comm, [](auto& ctx) { return linreg<float>(ctx); }, optim::sgd_params{.lr = lr},
                train_params{.max_consecutive_skips = 3,
                             .loss_scale = loss_scaling{
                                 .init_scale = 4096, .growth_interval = 100, .min_scale = 1024}});
            dp->scaler().restore({2.0, 0});
            restored[static_cast<std::size_t>(comm.rank())] = dp->scaler().state();
            return dp;
        },
        [](thread_communicator& comm, scaled_trainer<float>& dp) {
            dp.network().poison = comm.rank() == 1; // overflows at every scale
        });
    for (std::size_t r = 0; r < 2; ++r) {
        INFO(out[r].error);
        CHECK(restored[r] == loss_scaler_state{1024, 0});
        CHECK(out[r].scales == std::vector<double>{1024, 1024});
        CHECK(out[r].code == static_cast<int>(errc::non_finite));
        CHECK(out[r].thrown_at == 2);
        CHECK_THAT(out[r].error,
                   Catch::Contains("replica " + std::to_string(r) +
                                   ": data_parallel.step: step 2: 3 consecutive steps skipped at "
                                   "loss scale 1024, the floor (loss_scaling::min_scale = 1024), "
                                   "the limit (train_params::max_consecutive_skips)"));
    }
}

TEST_CASE("loss scaling: a reduced sum that overflows (each replica's gradient finite) backs the "
          "scale off too, instead of skipping at the same scale until the limit",
          "[train][thread][mixed][non_finite]") {
    // bfloat16 from 2^126 with the loss weight 2^6 (a seed as from S = 2^132): at S 2^122 each
    // replica's scaled gradient is finite in float, their sum is not.
    const double init = std::ldexp(1.0, 126), weight = 64.0;
    const auto out = run_scaled<bfloat16>({.init_scale = init}, weight, 20);
    for (const scaled_outcome& o : out) {
        INFO(o.error);
        REQUIRE(o.error.empty());
        CHECK(o.scales == out[0].scales);
        CHECK(o.scales.back() * weight < std::ldexp(1.0, 128));
        CHECK_FALSE(o.skipped.back());
    }
}

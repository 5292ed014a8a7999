// train_params::report_stragglers_every on thread replicas: a replica that sleeps in every step is
// named, with its delay within 20 %, by the same report on every replica, every K steps and not
// between; off, nothing is reported; a negative K or an asynchronous trainer is refused; a
// communicator timed on its device (as nccl_communicator) is read as the meter promises.
// SPDX-License-Identifier: Apache-2.0
#include "checkpoint_support.hpp"
#include "straggler_cases.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/train/checkpoint.hpp"
#include "support/counting_communicator.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

using namespace lockstep_test;

TEST_CASE("the replica that sleeps in every step is named with its delay",
          "[train][thread][straggler]") {
    const double delay = std::chrono::duration<double>(straggler_delay).count();
    for (const int replicas : {2, 3}) {
        for (const int slow : {0, replicas - 1}) {
            CAPTURE(replicas, slow);
            std::vector<std::vector<std::optional<straggler_report>>> seen(
                static_cast<std::size_t>(replicas));
            thread_group(replicas).run([&](thread_communicator& comm) {
                seen[static_cast<std::size_t>(comm.rank())] = run_straggler(comm, slow, 6, 3);
            });
            for (const auto& mine : seen) {
                REQUIRE(mine.size() == 6);
                CHECK(!mine[0]);
                CHECK(!mine[1]);
                REQUIRE(mine[2]); // after steps 1..2 (the first step is in no window)
                CHECK(mine[2]->first_step == 1);
                CHECK(mine[2]->last_step == 2);
                REQUIRE(mine[5]);
                const straggler_report& r = *mine[5];
                CHECK(r.first_step == 3);
                CHECK(r.last_step == 5);
                CHECK(r.slowest == slow);
                CHECK(r.lag_seconds == Approx(delay).epsilon(0.2));
                REQUIRE(r.own_seconds.size() == static_cast<std::size_t>(replicas));
                CHECK(r.own_seconds[static_cast<std::size_t>(slow)] >= delay);
                // The same report on every replica.
                CHECK(r.own_seconds == seen[0][5]->own_seconds);
                CHECK(r.lag_seconds == seen[0][5]->lag_seconds);
            }
        }
    }
}

TEST_CASE("what a replica does before its first step is in no window",
          "[train][thread][straggler]") {
    // Replica 1 spends 300 ms between the trainer's construction and its first step (loading
    // data, say); no replica is slow in its steps. Were the first step measured from the
    // construction, replica 1's own time would read about 300 ms / 2 steps = 150 ms per step in
    // the first window; every window must instead show a lag far below that (50 ms: step times
    // here are a few ms, with the noise of a shared machine).
    std::vector<std::vector<std::optional<straggler_report>>> seen(2);
    thread_group(2).run([&](thread_communicator& comm) {
        seen[static_cast<std::size_t>(comm.rank())] =
            run_straggler(comm, -1, 4, 2, 1, std::chrono::milliseconds(300));
    });
    for (const auto& mine : seen) {
        REQUIRE(mine.size() == 4);
        CHECK(!mine[0]);
        REQUIRE(mine[1]); // after step 1: the window [1, 1]
        CHECK(mine[1]->first_step == 1);
        CHECK(mine[1]->last_step == 1);
        CHECK(mine[1]->lag_seconds < 0.05);
        REQUIRE(mine[3]);
        CHECK(mine[3]->first_step == 2);
        CHECK(mine[3]->lag_seconds < 0.05);
    }
}

TEST_CASE("after load_checkpoint of an earlier step the window starts again",
          "[train][thread][straggler]") {
    // K = 5: 10 steps with a save after step 5, the checkpoint loaded (steps() 10 -> 5), then
    // steps 5..9 again. The report after the last step must cover steps 6..9 (the first step
    // after the load is in no window, as a trainer's first step), with finite times naming the
    // sleeping replica 1; a window measured from the report before the load (step 10) would be
    // empty or negative (inf or NaN seconds).
    const double delay = std::chrono::duration<double>(straggler_delay).count();
    using net = mlp<float, thread_communicator, storage::registry>;
    const temp_dir dir("straggler");
    const auto path = dir.path / "run.ckpt";
    std::vector<std::optional<straggler_report>> before_load(2), last(2);
    std::vector<std::int64_t> steps_after_load(2);
    thread_group(2).run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>,
                      thread_communicator>
            dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1},
               {.report_stragglers_every = 5});
        auto fn = [&](net& n, const shard_range& r, auto& ctx) {
            if (comm.rank() == 1)
                std::this_thread::sleep_for(straggler_delay);
            return n.train(r, ctx);
        };
        while (dp.steps() < 10) {
            dp.step(12, fn);
            if (dp.steps() == 5)
                save_checkpoint(dp, path);
        }
        const auto me = static_cast<std::size_t>(comm.rank());
        before_load[me] = dp.straggler();
        load_checkpoint(dp, path);
        steps_after_load[me] = dp.steps();
        while (dp.steps() < 10)
            dp.step(12, fn);
        last[me] = dp.straggler();
        dp.finish();
    });
    for (std::size_t me = 0; me < 2; ++me) {
        CAPTURE(me);
        REQUIRE(before_load[me]);
        CHECK(before_load[me]->first_step == 5);
        CHECK(steps_after_load[me] == 5);
        REQUIRE(last[me]);
        const straggler_report& r = *last[me];
        CHECK(r.first_step == 6);
        CHECK(r.last_step == 9);
        REQUIRE(r.own_seconds.size() == 2);
        for (double s : r.own_seconds) {
            CHECK(std::isfinite(s));
            CHECK(s >= 0);
        }
        CHECK(r.slowest == 1);
        CHECK(r.lag_seconds == Approx(delay).epsilon(0.2));
        CHECK(r.own_seconds == last[0]->own_seconds);
    }
}

TEST_CASE("without report_stragglers_every nothing is reported", "[train][thread][straggler]") {
    std::vector<std::vector<std::optional<straggler_report>>> seen(2);
    thread_group(2).run([&](thread_communicator& comm) {
        seen[static_cast<std::size_t>(comm.rank())] = run_straggler(comm, -1, 3, 0);
    });
    for (const auto& mine : seen) {
        REQUIRE(mine.size() == 3);
        for (const auto& r : mine)
            CHECK(!r);
    }
}

namespace {
/// The error every replica of 2 threads got from constructing a trainer with train_params tp:
/// (code, message), code -1 when none.
template <class Trainer>
std::vector<std::pair<int, std::string>> refusals(train_params tp) {
    std::vector<std::pair<int, std::string>> out(2, {-1, ""});
    thread_group(2).run([&](thread_communicator& comm) {
        using net = typename Trainer::network_type;
        try {
            Trainer dp(
                comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, tp);
        } catch (const error& e) {
            out[static_cast<std::size_t>(comm.rank())] = {static_cast<int>(e.code()), e.what()};
        }
    });
    return out;
}
} // namespace

TEST_CASE("a negative report_stragglers_every is refused on every replica",
          "[train][thread][straggler]") {
    using net = mlp<float, thread_communicator, storage::registry>;
    const auto out =
        refusals<data_parallel<net, optim::sgd<float>>>({.report_stragglers_every = -2});
    for (std::size_t rank = 0; rank < out.size(); ++rank) {
        CHECK(out[rank].first == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(out[rank].second,
                   Catch::Contains("replica " + std::to_string(rank) +
                                   ": data_parallel: report_stragglers_every = -2 (must be >= 0; "
                                   "0 is off)"));
    }
}

TEST_CASE("the asynchronous trainers refuse report_stragglers_every",
          "[train][thread][straggler]") {
    using net = mlp<float, thread_communicator, storage::registry, bn::local>;
    const auto out =
        refusals<data_parallel<net, optim::sgd<float>, sync::asynchronous, reduce::bucketed<>>>(
            {.report_stragglers_every = 5});
    for (const auto& [code, msg] : out) {
        CHECK(code == static_cast<int>(errc::unsupported));
        CHECK_THAT(msg, Catch::Contains("report_stragglers_every = 5: the asynchronous trainers' "
                                        "replicas do not wait for each other (use 0)"));
    }
}

TEST_CASE("a communicator whose collectives are not timed refuses report_stragglers_every",
          "[train][thread][straggler]") {
    // counting_communicator has no flight recorder (trace()): nothing times its collectives.
    using comm_type = lockstep::testing::counting_communicator<thread_communicator>;
    using net = mlp<float, comm_type, storage::registry>;
    std::vector<std::pair<int, std::string>> out(2, {-1, ""});
    thread_group(2).run([&](thread_communicator& inner) {
        comm_type comm(inner);
        try {
            data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>, comm_type>
                dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1},
                   {.report_stragglers_every = 3});
        } catch (const error& e) {
            out[static_cast<std::size_t>(inner.rank())] = {static_cast<int>(e.code()), e.what()};
        }
    });
    for (const auto& [code, msg] : out) {
        CHECK(code == static_cast<int>(errc::unsupported));
        CHECK_THAT(msg, Catch::Contains("report_stragglers_every = 3: this communicator's "
                                        "collectives are not timed"));
    }
}

namespace {
/// A thread communicator that claims to time its replica on a device (as nccl_communicator
/// does): its "device time between collectives" is a clock the step function advances, so the
/// report's figures are exact; it counts how often the meter turned the timing on and waited
/// for the stream.
class device_clock_communicator
    : public lockstep::testing::counting_communicator<thread_communicator> {
public:
    using counting_communicator::counting_communicator;
    explicit device_clock_communicator(counting_communicator&& c)
        : counting_communicator(std::move(c)) {}
    device_clock_communicator split(int color, int key) {
        return device_clock_communicator(counting_communicator::split(color, key));
    }
    void time_between_on_device() { ++turned_on; }
    std::int64_t device_between_ns() const { return clock_ns; }
    void synchronize() { ++synchronized; }

    std::int64_t clock_ns = 0;
    int turned_on = 0;
    int synchronized = 0;
};
} // namespace

// The device path of the meter, exactly: replica 1's clock advances 50 ms per step, the others'
// 1 ms. The reports after steps 3 and 6 (windows 1..2 and 3..5) give those times per step and a
// lag of 49 ms, the same on every replica; the timing was turned on once, and the meter waited
// for the stream at the first step and at each report (3 times in 6 steps), never between (the
// trainer's construction waits once more, as on any communicator that can).
TEST_CASE("a communicator timed on its device is read at the first step and at each report",
          "[train][thread][straggler]") {
    using comm_type = device_clock_communicator;
    using net = mlp<float, comm_type, storage::registry>;
    struct seen_by {
        std::vector<std::optional<straggler_report>> reports;
        int turned_on = 0, synchronized = 0;
    };
    std::vector<seen_by> seen(3);
    thread_group(3).run([&](thread_communicator& inner) {
        comm_type comm(inner);
        const std::int64_t per_step = comm.rank() == 1 ? 50'000'000 : 1'000'000;
        data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>, comm_type> dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, {.report_stragglers_every = 3});
        seen_by& mine = seen[static_cast<std::size_t>(inner.rank())];
        const int built = comm.synchronized; // the construction's own wait
        for (int k = 0; k < 6; ++k) {
            dp.step(12, [&](net& n, const shard_range& r, auto& ctx) {
                comm.clock_ns += per_step;
                return n.train(r, ctx);
            });
            mine.reports.push_back(dp.straggler());
        }
        mine.turned_on = comm.turned_on;
        mine.synchronized = comm.synchronized - built;
        dp.finish();
    });
    for (const seen_by& mine : seen) {
        CHECK(mine.turned_on == 1);
        CHECK(mine.synchronized == 3);
        REQUIRE(mine.reports.size() == 6);
        CHECK(!mine.reports[1]);
        REQUIRE(mine.reports[2]);
        CHECK(mine.reports[2]->first_step == 1);
        CHECK(mine.reports[2]->last_step == 2);
        REQUIRE(mine.reports[5]);
        const straggler_report& r = *mine.reports[5];
        CHECK(r.first_step == 3);
        CHECK(r.last_step == 5);
        REQUIRE(r.own_seconds.size() == 3);
        CHECK(r.own_seconds[0] == Approx(0.001).epsilon(1e-12));
        CHECK(r.own_seconds[1] == Approx(0.05).epsilon(1e-12));
        CHECK(r.own_seconds[2] == Approx(0.001).epsilon(1e-12));
        CHECK(r.slowest == 1);
        CHECK(r.lag_seconds == Approx(0.049).epsilon(1e-12));
    }
}

// train_params::report_stragglers_every on thread replicas: a replica that sleeps in every step is
// named, with its delay within 20 %, by the same report on every replica, every K steps and not
// between; off, nothing is reported; a negative K or an asynchronous trainer is refused.
// SPDX-License-Identifier: Apache-2.0
#include "straggler_cases.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "support/counting_communicator.hpp"

#include <catch2/catch.hpp>

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

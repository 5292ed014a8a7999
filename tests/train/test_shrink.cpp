// train_params::on_replica_failure = shrink on the thread group: a replica lost at a named step
// and point (tests/support/replica_loss.hpp) leaves survivors that continue with the same global
// batch; with reduce::reproducible + bn::ghost their weights, optimizer state, BN statistics and
// losses equal an undisturbed run's bit for bit, and with other policies within rounding.
// SPDX-License-Identifier: Apache-2.0
#include "checkpoint_support.hpp"
#include "repro_runner.hpp"

#include "../support/replica_loss.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/async_checkpoint.hpp"
#include "support/contains.hpp"
#include "support/replica_errors.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

using namespace lockstep_test;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t shrink_steps = 8;
constexpr std::size_t shrink_batch = 37;

/// One replica's view of a run: its record, the lost counts its steps reported, and what it saw
/// when it was the one lost.
struct shrink_run {
    std::vector<repro_record<float>> records; ///< by thread index (the lost one's stays empty)
    std::vector<int> lost_reported;           ///< by thread index: the sum of step_result::lost
    std::vector<int> final_size;              ///< by thread index: size() after the last step
    std::vector<std::vector<double>> scales;  ///< by thread index: each step's loss_scale
    std::vector<lockstep::lost_replica> lost;
    std::size_t per_step = 0;
    std::string victim_saw; ///< the stalled victim's error once it called into the old group
};

/// A second replica lost: thread index `replica`'s step function throws in step `step`.
struct second_loss {
    int replica = -1;
    std::int64_t step = -1;
};

/// Trains shrink_steps steps of shrink_batch samples on `replicas` thread replicas with Reduce
/// and BN, losing `loss` (none: undisturbed), then `then` (none by default).
template <class Reduce = repro_reduce, class BN = repro_bn, class Opt = optim::adam<float>>
shrink_run train_losing(int replicas, std::optional<replica_loss> loss,
                        train_params tp = {.seed = 42}, std::chrono::milliseconds timeout = 20s,
                        second_loss then = {}) {
    using net = mlp<float, thread_communicator, storage::registry, BN>;
    tp.on_replica_failure = replica_failure::shrink;
    loss_injector inject(replicas, loss);
    thread_group group(replicas, {.timeout = timeout, .on_collective = inject.hook()});
    shrink_run out;
    const auto count = static_cast<std::size_t>(replicas);
    out.records.resize(count);
    out.lost_reported.assign(count, 0);
    out.final_size.assign(count, 0);
    out.scales.resize(count);
    std::mutex m;
    group.run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.replica());
        try {
            data_parallel<net, Opt, sync::synchronous, Reduce, thread_communicator> dp(
                comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05f}, tp);
            repro_record<float> rec;
            int lost = 0;
            std::vector<double> scales;
            for (std::size_t s = 0; s < shrink_steps; ++s) {
                const step_result r =
                    dp.step(shrink_batch, [&](net& n, const shard_range& range, auto& ctx) {
                        if (static_cast<int>(me) == then.replica && ctx.step() == then.step)
                            throw replica_killed("the second replica lost");
                        return n.train(range, ctx);
                    });
                lost += r.lost;
                rec.losses.push_back(r.loss);
                scales.push_back(r.loss_scale);
            }
            (void)dp.finish();
            if (loss && loss->point == loss_point::stall)
                inject.release(); // the stalled thread may go on: it learns it was left out
            record_final(rec, dp);
            std::lock_guard lock(m);
            out.records[me] = std::move(rec);
            out.lost_reported[me] = lost;
            out.final_size[me] = comm.size();
            out.scales[me] = std::move(scales);
        } catch (const replica_killed&) {
            inject.mark_dead(); // this thread ends: the replica is lost
        } catch (const lockstep::error& e) {
            if (!(loss && loss->point == loss_point::stall &&
                  static_cast<int>(me) == loss->replica))
                throw;
            std::lock_guard lock(m);
            out.victim_saw = e.what();
        }
    });
    out.lost = group.lost();
    out.per_step = inject.per_step();
    return out;
}

} // namespace

TEST_CASE("reproducible + ghost: survivors end with an undisturbed run's bits", "[shrink]") {
    struct scenario {
        int replicas;
        int victim;
        std::int64_t step;
        loss_point point;
    };
    const scenario cases[] = {
        {2, 1, 3, loss_point::exchange},
        {3, 0, 2, loss_point::checks},
        {3, 2, 4, loss_point::after_checks_on_some},
        {4, 1, 5, loss_point::fence},
        {5, 3, 1, loss_point::exchange},
        {4, 0, 0, loss_point::exchange},
        {3, 1, 3, loss_point::stall},
    };
    const shrink_run ref = train_losing(3, std::nullopt);
    REQUIRE(ref.per_step >= 3); // fence, exchange, checks at least
    for (const scenario& c : cases) {
        DYNAMIC_SECTION(c.replicas << " replicas, replica " << c.victim << " lost in step "
                                   << c.step << " at point " << static_cast<int>(c.point)) {
            const shrink_run counted = train_losing(c.replicas, std::nullopt);
            const auto timeout = c.point == loss_point::stall ? 2000ms : 20000ms;
            const shrink_run run =
                train_losing(c.replicas, replica_loss{c.victim, c.step, c.point, counted.per_step},
                             {.seed = 42}, timeout);
            REQUIRE(run.lost.size() == 1);
            CHECK(run.lost[0].replica == c.victim);
            for (int r = 0; r < c.replicas; ++r) {
                if (r == c.victim)
                    continue;
                const auto i = static_cast<std::size_t>(r);
                CHECK(run.lost_reported[i] == 1);
                CHECK(run.final_size[i] == c.replicas - 1);
                const std::string differs = repro_difference(run.records[i], ref.records[0]);
                INFO("replica " << r << " differs from the undisturbed run in: " << differs);
                CHECK(differs.empty());
            }
            if (c.point == loss_point::stall) {
                CHECK(contains(run.lost[0].reason, "did not join the shrink"));
                INFO(run.victim_saw);
                CHECK(contains(run.victim_saw, "it cannot rejoin"));
            }
        }
    }
}

TEST_CASE("a loss in the step after a shrink continues whichever survivors had completed the "
          "first loss's step",
          "[shrink]") {
    // Replica 2 of 5 is lost in step 3; at after_checks_on_some replica 0 had completed step 3
    // and computes it again inside its call for step 4, in which replica 4 is lost. That is step
    // 4's first failure on every survivor, as it is when nobody had completed step 3.
    const shrink_run ref = train_losing(3, std::nullopt);
    const shrink_run counted = train_losing(5, std::nullopt);
    for (const loss_point p :
         {loss_point::exchange, loss_point::checks, loss_point::after_checks_on_some}) {
        DYNAMIC_SECTION("replica 2 lost in step 3 at point " << static_cast<int>(p)
                                                             << ", replica 4 in step 4") {
            const shrink_run run = train_losing(5, replica_loss{2, 3, p, counted.per_step},
                                                {.seed = 42}, 20s, {.replica = 4, .step = 4});
            REQUIRE(run.lost.size() == 2);
            for (int r : {0, 1, 3}) {
                const auto i = static_cast<std::size_t>(r);
                CHECK(run.lost_reported[i] == 2);
                CHECK(run.final_size[i] == 3);
                const std::string differs = repro_difference(run.records[i], ref.records[0]);
                INFO("replica " << r << " differs from the undisturbed run in: " << differs);
                CHECK(differs.empty());
            }
        }
    }
}

TEST_CASE("a trainer with shrink is the only live trainer on its communicator", "[shrink]") {
    // A shrink changes the communicator under every trainer on it, and only the trainer whose
    // step found the loss recovers: the other would meet the shrunk group with its old size.
    using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
    using trainer =
        data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce, thread_communicator>;
    const auto factory = [](auto& ctx) { return net(ctx); };
    const train_params shrinks{.on_replica_failure = replica_failure::shrink};
    for (const bool shrink_first : {true, false}) {
        DYNAMIC_SECTION((shrink_first ? "shrink first" : "shrink second")) {
            const auto errors = errors_of(3, [&](int, thread_communicator& comm) {
                trainer a(comm, factory, {.lr = 0.05f}, shrink_first ? shrinks : train_params{});
                trainer b(comm, factory, {.lr = 0.05f}, shrink_first ? train_params{} : shrinks);
            });
            for (std::size_t r = 0; r < 3; ++r) {
                INFO("replica " << r << ": " << errors[r].first);
                CHECK(errors[r].second == static_cast<int>(errc::unsupported));
                CHECK(contains(errors[r].first, "replica " + std::to_string(r)));
                CHECK(contains(errors[r].first, "1 live"));
                CHECK(contains(errors[r].first, "comm.split(0, comm.rank())"));
            }
        }
    }
    // One after the other, or on a communicator of its own, is accepted.
    const auto errors = errors_of(3, [&](int, thread_communicator& comm) {
        { trainer a(comm, factory, {.lr = 0.05f}); }
        trainer b(comm, factory, {.lr = 0.05f}, shrinks);
        thread_communicator own = comm.split(0, comm.rank());
        trainer c(own, factory, {.lr = 0.05f});
        (void)b.step(shrink_batch, [](net& n, const shard_range& range, auto& ctx) {
            return n.train(range, ctx);
        });
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO("replica " << r);
        CHECK(errors[r].first.empty());
    }
}

TEST_CASE("the loss scale continues from the step's start, not from init_scale", "[shrink]") {
    // Growing every step from 8: a scale restarted by the rebuild would compute step 4 again
    // with 8 instead of 128 (the weights are the same either way: powers of two are exact).
    train_params tp{.seed = 42};
    tp.loss_scale = loss_scaling{.init_scale = 8, .growth_interval = 1};
    const shrink_run counted = train_losing(3, std::nullopt, tp);
    const shrink_run run =
        train_losing(3, replica_loss{1, 4, loss_point::exchange, counted.per_step}, tp);
    REQUIRE(run.lost.size() == 1);
    REQUIRE(counted.scales[0].size() == shrink_steps);
    CHECK(counted.scales[0][4] == 128.0);
    for (std::size_t r : {std::size_t{0}, std::size_t{2}}) {
        INFO("replica " << r);
        CHECK(run.scales[r] == counted.scales[0]);
    }
}

TEST_CASE("other policies continue with the global batch within rounding", "[shrink]") {
    using bucketed = reduce::bucketed<256>;
    const shrink_run ref = train_losing<bucketed, bn::global>(3, std::nullopt);
    const shrink_run counted = train_losing<bucketed, bn::global>(3, std::nullopt);
    const shrink_run run = train_losing<bucketed, bn::global>(
        3, replica_loss{1, 4, loss_point::exchange, counted.per_step});
    REQUIRE(run.lost.size() == 1);
    // The survivors hold identical weights; against the undisturbed 3-replica run, only the
    // order of the sums over replicas differs (2 instead of 3 partial gradients and BN
    // moments): 8 Adam steps of lr 0.05 stay within 1e-4 absolute of it.
    const std::string differs = repro_difference(run.records[0], run.records[2]);
    INFO("the survivors differ in: " << differs);
    CHECK(differs.empty());
    for (std::size_t k = 0; k < ref.records[0].params.size(); ++k)
        CHECK(run.records[0].params[k] == Approx(ref.records[0].params[k]).margin(1e-4).epsilon(0));
    CHECK(run.lost_reported[0] == 1);

    // The same with the buckets reduced by a communication thread over a split of the
    // communicator (train_params::overlap): the split is made again from the shrunk one.
    const train_params overlap{.overlap = overlap_mode::always, .seed = 42};
    const shrink_run counted_overlapped =
        train_losing<bucketed, bn::global>(3, std::nullopt, overlap);
    const shrink_run overlapped = train_losing<bucketed, bn::global>(
        3, replica_loss{1, 4, loss_point::exchange, counted_overlapped.per_step}, overlap);
    REQUIRE(overlapped.lost.size() == 1);
    CHECK(overlapped.final_size[2] == 2);
    for (std::size_t k = 0; k < ref.records[0].params.size(); ++k)
        CHECK(overlapped.records[2].params[k] ==
              Approx(ref.records[0].params[k]).margin(1e-4).epsilon(0));
}

TEST_CASE("what does not shrink: deterministic errors, a second loss, min_replicas, policies",
          "[shrink]") {
    using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
    SECTION("a replica's own deterministic error is thrown as without shrink") {
        thread_group group(3, {.timeout = 20s});
        REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
            data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce,
                          thread_communicator>
                dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05f},
                   {.on_replica_failure = replica_failure::shrink});
            for (int s = 0; s < 3; ++s)
                dp.step(shrink_batch, [&](net& n, const shard_range& range, auto& ctx) {
                    if (s == 1 && comm.replica() == 2)
                        lockstep::fail(errc::invalid_argument, comm.replica(), "load_batch",
                                       "sample ", range.begin, " is corrupt");
                    return n.train(range, ctx);
                });
        }),
                            Catch::Contains("is corrupt"));
        CHECK(group.lost().empty());
    }
    SECTION("fewer survivors than min_replicas stop the run") {
        // Replica 0 of 2 is lost: the survivor, replica 1, is rank 0 after the shrink; its error
        // names it by its thread index, as it names the lost one.
        const shrink_run counted = train_losing(2, std::nullopt);
        try {
            (void)train_losing(2, replica_loss{0, 2, loss_point::exchange, counted.per_step},
                               {.seed = 42, .min_replicas = 2});
            FAIL("the run should have stopped");
        } catch (const lockstep::error& e) {
            INFO(e.what());
            CHECK(e.code() == errc::peer_failure);
            CHECK(e.replica() == 1);
            CHECK(contains(
                e.what(),
                "replica 1: data_parallel.step: replica(s) 0 lost in step 2 leave 1 of 2"));
            CHECK(contains(e.what(), "fewer than train_params::min_replicas = 2"));
        }
    }
    SECTION("min_replicas above the replica count is refused at construction") {
        thread_group group(3, {.timeout = 20s});
        REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
            data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce,
                          thread_communicator>
                dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05f},
                   {.on_replica_failure = replica_failure::shrink, .min_replicas = 5});
        }),
                            Catch::Contains("min_replicas = 5, more than the 3 replicas"));
    }
    SECTION("bn::tower<2> with min_replicas 2 is refused at construction, 3 accepted") {
        using tower_net = mlp<float, thread_communicator, storage::registry, bn::tower<2>>;
        for (const int min : {2, 3}) {
            const auto errors = errors_of(4, [&](int, thread_communicator& comm) {
                data_parallel<tower_net, optim::sgd<float>, sync::synchronous, reduce::per_tensor,
                              thread_communicator>
                    dp(comm, [](auto& ctx) { return tower_net(ctx); }, {.lr = 0.05f},
                       {.on_replica_failure = replica_failure::shrink, .min_replicas = min});
            });
            for (std::size_t r = 0; r < 4; ++r) {
                INFO("min_replicas " << min << ", replica " << r << ": " << errors[r].first);
                if (min == 3) {
                    CHECK(errors[r].first.empty());
                    continue;
                }
                CHECK(errors[r].second == static_cast<int>(errc::invalid_argument));
                CHECK(contains(errors[r].first, "bn::tower<2> and min_replicas = 2: a shrink to 2 "
                                                "or fewer replicas leaves no replica 2"));
                CHECK(contains(errors[r].first, "set min_replicas to at least 3"));
            }
        }
    }
    SECTION("a second loss while the step is computed again stops the run") {
        const shrink_run counted = train_losing(4, std::nullopt);
        // Replica 1 is lost in step 2; in the step computed again (generation 1) replica 3's
        // thread ends too.
        std::atomic<bool> second{false}; // the hook killed replica 3 in generation 1
        std::atomic<int> killed{0};      // bodies that saw their replica killed
        thread_group::params p{.timeout = 20s};
        loss_injector inject(4, replica_loss{1, 2, loss_point::exchange, counted.per_step});
        auto hook = inject.hook();
        p.on_collective = [&](const collective_event& e) {
            hook(e);
            if (e.generation == 1 && e.replica == 3 && e.tag == "data_parallel.fence") {
                second.store(true);
                throw replica_killed("replica 3 lost in the step computed again");
            }
        };
        thread_group group(4, p);
        std::optional<errc> code;
        std::string what;
        try {
            group.run([&](thread_communicator& comm) {
                data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce,
                              thread_communicator>
                    dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05f},
                       {.on_replica_failure = replica_failure::shrink});
                try {
                    for (int s = 0; s < 4; ++s)
                        dp.step(shrink_batch, [](net& n, const shard_range& range, auto& ctx) {
                            return n.train(range, ctx);
                        });
                } catch (const replica_killed&) {
                    killed.fetch_add(1);
                }
            });
        } catch (const lockstep::error& e) {
            code = e.code();
            what = e.what();
        }
        INFO(what);
        CHECK(second.load());
        CHECK(killed.load() == 2);
        CHECK(code == errc::peer_failure);
        CHECK(contains(what, "replica 3"));
    }
    SECTION("policies whose state is not replicated refuse shrink at construction") {
        using global_net = mlp<float, thread_communicator, storage::registry, bn::global>;
        thread_group group(2);
        REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
            data_parallel<global_net, optim::sgd<float>, sync::synchronous, reduce::sharded<>,
                          thread_communicator>
                dp(comm, [](auto& ctx) { return global_net(ctx); }, {.lr = 0.05f},
                   {.on_replica_failure = replica_failure::shrink});
        }),
                            Catch::Contains("cannot be rebuilt from the survivors"));
    }
}

TEST_CASE("reduce::sharded rolls back to the last checkpoint on the shrunk communicator",
          "[shrink]") {
    // What fault_tolerance.md says sharded trainers do: the step throws (stop), the survivors
    // shrink the communicator themselves, build a trainer on it and load the last checkpoint at
    // the new count. Against a reference that saves at step 3 on 3 replicas and resumes on 2:
    // the same operations, so the same bits.
    using net = mlp<float, thread_communicator, storage::registry, bn::global>;
    using trainer = data_parallel<net, optim::adam<float>, sync::synchronous, reduce::sharded<256>,
                                  thread_communicator>;
    const temp_dir dir("shrink");
    const auto factory = [](auto& ctx) { return net(ctx); };
    std::atomic<bool> kill{false}; // the reference runs lose nothing
    const auto fn = [&](net& n, const shard_range& range, auto& ctx) {
        if (kill.load() && ctx.step() == 5 && ctx.comm().replica() == 1)
            throw replica_killed("replica 1 lost in step 5");
        return n.train(range, ctx);
    };
    const auto train = [&](trainer& dp, std::int64_t until) {
        while (dp.steps() < until)
            (void)dp.step(shrink_batch, fn);
    };
    std::vector<float> reference;
    thread_group(3).run([&](thread_communicator& comm) {
        trainer dp(comm, factory, {.lr = 0.05f});
        train(dp, 3);
        save_checkpoint(dp, dir.path / "reference");
    });
    thread_group(2).run([&](thread_communicator& comm) {
        trainer dp(comm, factory, {.lr = 0.05f});
        load_checkpoint(dp, dir.path / "reference");
        train(dp, shrink_steps);
        if (comm.rank() == 0)
            reference.assign(dp.parameters().begin(), dp.parameters().end());
    });

    kill.store(true);
    std::vector<std::vector<float>> survivors(3);
    std::vector<int> sizes(3, 0);
    thread_group group(3, {.timeout = 20s});
    group.run([&](thread_communicator& comm) {
        try {
            auto dp = std::make_unique<trainer>(comm, factory, optim::adam_params{.lr = 0.05f});
            train(*dp, 3);
            save_checkpoint(*dp, dir.path / "run");
            try {
                train(*dp, shrink_steps);
            } catch (const lockstep::error& e) {
                if (e.code() != errc::peer_failure)
                    throw;
                dp.reset(); // the old trainer goes first: it refers to the communicator
                (void)comm.shrink();
                dp = std::make_unique<trainer>(comm, factory, optim::adam_params{.lr = 0.05f});
                load_checkpoint(*dp, dir.path / "run");
                train(*dp, shrink_steps);
            }
            const auto me = static_cast<std::size_t>(comm.replica());
            survivors[me].assign(dp->parameters().begin(), dp->parameters().end());
            sizes[me] = comm.size();
        } catch (const replica_killed&) {
            // the lost replica's thread ends
        }
    });
    REQUIRE(group.lost().size() == 1);
    CHECK(group.lost()[0].replica == 1);
    for (std::size_t r : {std::size_t{0}, std::size_t{2}}) {
        CHECK(sizes[r] == 2);
        CHECK(survivors[r] == reference);
    }
}

TEST_CASE("bn::group layers split the shrunk communicator again", "[shrink]") {
    // bn::group<2> on 4 replicas normalizes over replicas {0, 1} and {2, 3}; replica 1 is lost
    // in the gradient exchange of step 3, and the survivors 0, 2, 3 (ranks 0, 1, 2) normalize
    // over {0, 2} and {3} from then on (the last group is smaller). Every survivor had passed
    // step 3's fence, so step 3 is the first computed on 3 (a loss at the fence could leave
    // one survivor failing in step 2's last collective, and step 2 computed again on 3: under
    // bn::group the grouping changes the weights). Against a reference that saves at step 3 on
    // 4 replicas and resumes on 3: the same operations in the same order, so the weights have
    // the same bits. (The running statistics are not compared: each replica keeps its own under
    // bn::group, and a resumed run starts every replica from replica 0's.)
    using group_bn = bn::group<2>;
    using net = mlp<float, thread_communicator, storage::registry, group_bn>;
    using trainer = data_parallel<net, optim::adam<float>, sync::synchronous, reduce::bucketed<256>,
                                  thread_communicator>;
    const temp_dir dir("shrink_group");
    const auto factory = [](auto& ctx) { return net(ctx); };
    const auto fn = [](net& n, const shard_range& range, auto& ctx) { return n.train(range, ctx); };
    const train_params tp{.seed = 42, .on_replica_failure = replica_failure::shrink};
    const auto train = [&](trainer& dp, std::int64_t until) {
        while (dp.steps() < until)
            (void)dp.step(shrink_batch, fn);
    };
    std::vector<float> reference;
    thread_group(4).run([&](thread_communicator& comm) {
        trainer dp(comm, factory, {.lr = 0.05f}, tp);
        train(dp, 3);
        save_checkpoint(dp, dir.path / "reference");
    });
    thread_group(3).run([&](thread_communicator& comm) {
        trainer dp(comm, factory, {.lr = 0.05f}, tp);
        load_checkpoint(dp, dir.path / "reference");
        train(dp, shrink_steps);
        if (comm.rank() == 0)
            reference.assign(dp.parameters().begin(), dp.parameters().end());
    });

    const shrink_run counted = train_losing<reduce::bucketed<256>, group_bn>(4, std::nullopt);
    const shrink_run run = train_losing<reduce::bucketed<256>, group_bn>(
        4, replica_loss{1, 3, loss_point::exchange, counted.per_step});
    REQUIRE(run.lost.size() == 1);
    CHECK(run.lost[0].replica == 1);
    for (std::size_t r : {std::size_t{0}, std::size_t{2}, std::size_t{3}}) {
        CHECK(run.final_size[r] == 3);
        CHECK(run.lost_reported[r] == 1);
        CHECK(run.records[r].params == reference);
    }
}

TEST_CASE("a loss inside the last micro-batch's bucket launch: the step is computed again on the "
          "new collective",
          "[shrink]") {
    // micro_batches = 2, reduce::bucketed and bn::local (no collective in forward or backward):
    // the first collective after step 3's fence is a bucket that mark_ready launches inside
    // fn's last micro-batch, so replica 1's loss there makes fn throw on the survivors with the
    // trainer's ready hook installed. Computed again, the step must launch its buckets on the
    // collective rebuilt for 2 replicas, only from the last micro-batch (a hook left behind
    // would call into the destroyed one from the first). Against a reference that saves at
    // step 3 on 3 replicas and resumes on 2: the same operations in the same order, so the
    // weights have the same bits (each replica keeps its own running statistics under
    // bn::local: they are not compared).
    using local_net = mlp<float, thread_communicator, storage::registry, bn::local>;
    using trainer = data_parallel<local_net, optim::adam<float>, sync::synchronous,
                                  reduce::bucketed<256>, thread_communicator>;
    const temp_dir dir("shrink_micro");
    const auto factory = [](auto& ctx) { return local_net(ctx); };
    const auto fn = [](local_net& n, const shard_range& range, auto& ctx) {
        return n.train(range, ctx);
    };
    const train_params tp{
        .micro_batches = 2, .seed = 42, .on_replica_failure = replica_failure::shrink};
    const auto train = [&](trainer& dp, std::int64_t until) {
        while (dp.steps() < until)
            (void)dp.step(shrink_batch, fn);
    };
    std::vector<float> reference;
    thread_group(3).run([&](thread_communicator& comm) {
        trainer dp(comm, factory, {.lr = 0.05f}, tp);
        train(dp, 3);
        save_checkpoint(dp, dir.path / "reference");
    });
    thread_group(2).run([&](thread_communicator& comm) {
        trainer dp(comm, factory, {.lr = 0.05f}, tp);
        load_checkpoint(dp, dir.path / "reference");
        train(dp, shrink_steps);
        if (comm.rank() == 0)
            reference.assign(dp.parameters().begin(), dp.parameters().end());
    });

    const shrink_run counted = train_losing<reduce::bucketed<256>, bn::local>(3, std::nullopt, tp);
    const shrink_run run = train_losing<reduce::bucketed<256>, bn::local>(
        3, replica_loss{1, 3, loss_point::exchange, counted.per_step}, tp);
    REQUIRE(run.lost.size() == 1);
    CHECK(run.lost[0].replica == 1);
    for (std::size_t r : {std::size_t{0}, std::size_t{2}}) {
        CHECK(run.final_size[r] == 2);
        CHECK(run.lost_reported[r] == 1);
        CHECK(run.records[r].params == reference);
    }
}

TEST_CASE("a replica that times out but joins the shrink at every try ends the run", "[shrink]") {
    // Replica 1 stalls in step 1's step function longer than the group's timeout, at every
    // try. The others time out and shrink; replica 1 still arrives at the shrink within its
    // wait, so nobody is removed, and the step computed again times out the same way. The
    // second failure of the call must end the run with the timeout instead of shrinking again
    // (without end): at most two runs of step 1 on replica 1.
    using net = mlp<float, thread_communicator, storage::registry, bn::local>;
    std::atomic<int> attempts{0};
    std::optional<errc> code;
    std::string what;
    thread_group group(3, {.timeout = 300ms});
    try {
        group.run([&](thread_communicator& comm) {
            data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<256>,
                          thread_communicator>
                dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05f},
                   {.on_replica_failure = replica_failure::shrink});
            for (int s = 0; s < 3; ++s)
                (void)dp.step(shrink_batch, [&](net& n, const shard_range& range, auto& ctx) {
                    if (ctx.step() == 1 && comm.replica() == 1) {
                        // A bound for the unfixed trainer, which would shrink forever.
                        if (attempts.fetch_add(1) >= 3)
                            throw std::runtime_error("step 1 computed again too often");
                        std::this_thread::sleep_for(450ms);
                    }
                    return n.train(range, ctx);
                });
        });
    } catch (const lockstep::error& e) {
        code = e.code();
        what = e.what();
    }
    INFO(what);
    CHECK(attempts.load() <= 2);
    CHECK(code == errc::timeout);
    CHECK(group.lost().empty());
}

namespace {

/// The step count that a load of the checkpoint `path` into a Trainer on 2 fresh thread replicas
/// restores.
template <class Trainer>
std::int64_t steps_loaded(const fs::path& path) {
    std::int64_t steps = -1;
    thread_group(2).run([&](thread_communicator& comm) {
        Trainer dp(comm, [](auto& ctx) { return typename Trainer::network_type(ctx); },
                   {.lr = 0.05f}, {.seed = 7});
        load_checkpoint(dp, path);
        if (comm.rank() == 0)
            steps = dp.steps();
    });
    return steps;
}

/// A background save (save_checkpoint_async) begun at step 3 on 3 replicas, with replica 2 lost
/// in step `die_at` (-1: the step after the one that reported the save's end), in its step
/// function or, given `at`, at that point of the step. Per replica (by thread index): the events
/// its steps reported, what wait_checkpoint returned (as an int) or threw, and the step count a
/// load of the checkpoint afterwards restores.
struct save_lost_run {
    std::vector<std::vector<int>> events = std::vector<std::vector<int>>(3);
    std::vector<int> waited = std::vector<int>(3, -1);
    std::vector<std::string> wait_error = std::vector<std::string>(3);
    std::int64_t loaded_steps = -1;
    std::size_t per_step = 0;
};

save_lost_run save_then_lose(std::int64_t die_at, bool hold_writers,
                             std::optional<replica_loss> at = std::nullopt) {
    using net = mlp<float, thread_communicator, storage::registry, bn::global>;
    using trainer = data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::per_tensor,
                                  thread_communicator>;
    const temp_dir dir("shrink_save");
    const fs::path path = dir.path / "x.ckpt";
    const auto factory = [](auto& ctx) { return net(ctx); };
    // Held writers never finish their shard before the loss: the save cannot have committed.
    // (The lost replica's trainer waits for its writer as it goes.)
    std::atomic<bool> released{!hold_writers};
    loss_injector inject(3, at);
    const save_options held{.on_stage = [&](std::string_view stage, int) {
        const auto until = std::chrono::steady_clock::now() + 10s;
        while (stage == "shard.partial" && !released.load() && !inject.fired() &&
               std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(1ms);
    }};
    save_lost_run out;
    thread_group group(3, {.timeout = 20s, .on_collective = inject.hook()});
    group.run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.replica());
        std::int64_t dies = die_at;
        const auto fn = [&](net& n, const shard_range& range, auto& ctx) {
            if (ctx.step() == dies && me == 2 && !at) {
                released.store(true);
                throw replica_killed("replica 2 lost");
            }
            return n.train(range, ctx);
        };
        try {
            trainer dp(comm, factory, {.lr = 0.05f},
                       {.seed = 42, .on_replica_failure = replica_failure::shrink});
            for (int s = 0; s < 2; ++s)
                (void)dp.step(shrink_batch, fn);
            save_checkpoint(dp, path); // the previous checkpoint: step 2
            (void)dp.step(shrink_batch, fn);
            save_checkpoint_async(dp, path, held); // step 3
            // Until two steps after the loss (at most 500 steps while waiting for the commit).
            for (int s = 0; s < 500 && (dies < 0 || dp.steps() < dies + 2); ++s) {
                const step_result r = dp.step(shrink_batch, fn);
                out.events[me].push_back(static_cast<int>(r.checkpoint));
                if (r.checkpoint != checkpoint_event::none && dies < 0)
                    dies = r.step + 1;
                if (dies < 0) // wait for the committed save's report
                    std::this_thread::sleep_for(1ms);
            }
            try {
                out.waited[me] = static_cast<int>(wait_checkpoint(dp));
            } catch (const lockstep::error& e) {
                out.wait_error[me] = e.what();
            }
            (void)dp.finish();
        } catch (const replica_killed&) {
            inject.mark_dead(); // the lost replica's thread ends
        }
    });
    out.per_step = inject.per_step();
    out.loaded_steps = steps_loaded<trainer>(path);
    return out;
}

} // namespace

TEST_CASE("a background save in flight when the group shrinks is reported failed, never dropped",
          "[shrink]") {
    const save_lost_run run = save_then_lose(4, true);
    for (std::size_t r : {std::size_t{0}, std::size_t{1}}) {
        INFO("replica " << r);
        // The step computed again after the loss (step 4, the second after the save) reports it.
        REQUIRE(run.events[r].size() >= 2);
        CHECK(run.events[r][1] == static_cast<int>(checkpoint_event::failed));
        CHECK(std::count(run.events[r].begin(), run.events[r].end(),
                         static_cast<int>(checkpoint_event::none)) ==
              static_cast<std::ptrdiff_t>(run.events[r].size()) - 1);
        CHECK(run.waited[r] == -1);
        CHECK(contains(run.wait_error[r], "wait_checkpoint"));
        CHECK(contains(run.wait_error[r],
                       "abandoned: the group shrank (replica(s) 2 lost) before it committed"));
    }
    CHECK(run.loaded_steps == 2); // the previous checkpoint stands
}

TEST_CASE("a background save in flight is reported failed also where the step had completed",
          "[shrink]") {
    // Replica 0 completes step 4 before replica 2 is lost in it: it computes step 4 again inside
    // its call for step 5, whose result carries the save's end that step 4's status showed.
    const save_lost_run counted = // nobody lost (the loss is past the last step): a count
        save_then_lose(5, false, replica_loss{2, 100, loss_point::exchange, 1});
    const save_lost_run run = save_then_lose(
        4, true, replica_loss{2, 4, loss_point::after_checks_on_some, counted.per_step});
    for (std::size_t r : {std::size_t{0}, std::size_t{1}}) {
        std::string events;
        for (int e : run.events[r])
            events += std::to_string(e) + " ";
        INFO("replica " << r << ", events from step 3 on: " << events << run.wait_error[r]);
        CHECK(std::count(run.events[r].begin(), run.events[r].end(),
                         static_cast<int>(checkpoint_event::failed)) == 1);
        CHECK(contains(run.wait_error[r],
                       "abandoned: the group shrank (replica(s) 2 lost) before it committed"));
    }
    // Where the step had completed, the end rides on the next call's result.
    REQUIRE(run.events[0].size() >= 3);
    CHECK(run.events[0][2] == static_cast<int>(checkpoint_event::failed));
    CHECK(run.loaded_steps == 2);
}

TEST_CASE("a background save committed before the group shrinks stays reported committed",
          "[shrink]") {
    const save_lost_run run = save_then_lose(-1, false);
    for (std::size_t r : {std::size_t{0}, std::size_t{1}}) {
        INFO("replica " << r << ": " << run.wait_error[r]);
        CHECK(std::count(run.events[r].begin(), run.events[r].end(),
                         static_cast<int>(checkpoint_event::committed)) == 1);
        CHECK(std::count(run.events[r].begin(), run.events[r].end(),
                         static_cast<int>(checkpoint_event::failed)) == 0);
        CHECK(run.waited[r] == static_cast<int>(checkpoint_event::committed));
    }
    CHECK(run.loaded_steps == 3);
}

TEST_CASE("a lost replica 0's late commit never replaces the survivors' newer checkpoint",
          "[shrink]") {
    // Replica 0's marker writer for the background save of step 3 is held once it has written
    // the marker's temporary (before its rename), and replica 0 stalls in its next step past the
    // group's timeout: the survivors shrink without it, report the save failed and commit a
    // blocking save of a later step to the same path. Only once that save has returned are
    // replica 0 and its writer released. The late commit must be refused: the survivors' save
    // stays the checkpoint (unfixed, the writer renamed its older marker over it and removed the
    // newer save's shards as the generation it replaced).
    using net = mlp<float, thread_communicator, storage::registry, bn::global>;
    using trainer = data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::per_tensor,
                                  thread_communicator>;
    const temp_dir dir("shrink_late_commit");
    const fs::path path = dir.path / "x.ckpt";
    const auto factory = [](auto& ctx) { return net(ctx); };
    const auto wait_for = [](const std::atomic<bool>& flag) { // bounded: fail, not hang
        for (int i = 0; i < 20000 && !flag.load(); ++i)
            std::this_thread::sleep_for(1ms);
    };
    std::atomic<bool> writer_held{false}, newer_saved{false};
    const save_options hold_marker{.on_stage = [&](std::string_view stage, int) {
        if (stage == "manifest.written") {
            writer_held.store(true);
            wait_for(newer_saved);
        }
    }};
    std::mutex m;
    std::vector<int> ends(3, -1); // by thread index: the end the survivors' steps reported
    std::int64_t newer_steps = -1;
    thread_group group(3, {.timeout = 2s});
    group.run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.replica());
        const auto fn = [&](net& n, const shard_range& range, auto& ctx) {
            if (me == 0 && writer_held.load())
                wait_for(newer_saved); // past the timeout: left out of the shrink
            return n.train(range, ctx);
        };
        try {
            trainer dp(comm, factory, {.lr = 0.05f},
                       {.seed = 42, .on_replica_failure = replica_failure::shrink});
            for (int s = 0; s < 3; ++s)
                (void)dp.step(shrink_batch, fn);
            save_checkpoint_async(dp, path, hold_marker); // step 3
            checkpoint_event end = checkpoint_event::none;
            for (int s = 0; s < 500 && end == checkpoint_event::none; ++s) {
                end = dp.step(shrink_batch, fn).checkpoint;
                if (end == checkpoint_event::none)
                    std::this_thread::sleep_for(1ms);
            }
            save_checkpoint(dp, path); // the survivors' newer save
            {
                std::lock_guard lock(m);
                ends[me] = static_cast<int>(end);
                if (comm.rank() == 0)
                    newer_steps = dp.steps();
            }
            if (comm.rank() == 0)
                newer_saved.store(true); // save_checkpoint returned: no longer in flight
            (void)dp.finish();
        } catch (const lockstep::error&) {
            if (me != 0) // replica 0, once released, learns that it was left out
                throw;
        }
    });
    const std::int64_t loaded_steps = steps_loaded<trainer>(path);
    REQUIRE(group.lost().size() == 1);
    CHECK(group.lost()[0].replica == 0);
    CHECK(ends[1] == static_cast<int>(checkpoint_event::failed));
    CHECK(ends[2] == static_cast<int>(checkpoint_event::failed));
    CHECK(newer_steps > 3);
    CHECK(loaded_steps == newer_steps);
}

TEST_CASE("a lost replica 0's late blocking commit never replaces the survivors' newer "
          "checkpoint",
          "[shrink]") {
    // Every replica saves (blocking) from its step function in step 3; replica 0 is held in its
    // commit once it has written the marker's temporary, past the group's timeout: the
    // survivors' step fails, they shrink without it, compute step 3 again (saving again, now
    // committed by the new replica 0), run two more steps and save again between steps. Only
    // then is replica 0 released. Its late commit must be refused: the survivors' last save
    // stays the checkpoint (unfixed, replica 0 renamed its step-3 marker over it and removed the
    // newer save's shards as the generation it replaced).
    using net = mlp<float, thread_communicator, storage::registry, bn::global>;
    using trainer = data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::per_tensor,
                                  thread_communicator>;
    const temp_dir dir("shrink_late_blocking_commit");
    const fs::path path = dir.path / "x.ckpt";
    const auto factory = [](auto& ctx) { return net(ctx); };
    std::atomic<bool> newer_saved{false};
    const save_options hold_marker{.on_stage = [&](std::string_view stage, int) {
        // Bounded: the test fails, not hangs.
        for (int i = 0; i < 20000 && stage == "manifest.written" && !newer_saved.load(); ++i)
            std::this_thread::sleep_for(1ms);
    }};
    std::mutex m;
    std::int64_t newer_steps = -1;
    std::vector<int> lost_in_step(3, -1); // by thread index: step_result::lost of step 3
    thread_group group(3, {.timeout = 2s});
    group.run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.replica());
        trainer* self = nullptr;
        const auto fn = [&](net& n, const shard_range& range, auto& ctx) {
            if (ctx.step() == 3)
                save_checkpoint(*self, path, me == 0 ? hold_marker : save_options{});
            return n.train(range, ctx);
        };
        try {
            trainer dp(comm, factory, {.lr = 0.05f},
                       {.seed = 42, .on_replica_failure = replica_failure::shrink});
            self = &dp;
            for (int s = 0; s < 6; ++s) {
                const step_result r = dp.step(shrink_batch, fn);
                if (r.step == 3) {
                    const std::lock_guard lock(m);
                    lost_in_step[me] = r.lost;
                }
            }
            save_checkpoint(dp, path); // the survivors' newer save
            if (comm.rank() == 0) {
                const std::lock_guard lock(m);
                newer_steps = dp.steps();
                newer_saved.store(true); // save_checkpoint returned: no longer in flight
            }
            (void)dp.finish();
        } catch (const lockstep::error&) {
            if (me != 0) // replica 0, once released, learns that it was left out
                throw;
        }
    });
    const std::int64_t loaded_steps = steps_loaded<trainer>(path);
    REQUIRE(group.lost().size() == 1);
    CHECK(group.lost()[0].replica == 0);
    CHECK(lost_in_step[1] == 1);
    CHECK(lost_in_step[2] == 1);
    CHECK(newer_steps == 6);
    CHECK(loaded_steps == newer_steps);
}

TEST_CASE("a loss while a peer is in finish() stops the run: no healthy replica is shrunk over",
          "[shrink]") {
    // Replica 0 throws between its last step and finish(), once replica 1 waits in finish()'s
    // collective (no shrink recovery there): errc::peer_failure ends replica 1's thread. Replica 2
    // is either still in the last step's last collective, held there (after arriving, so the others
    // complete it) until replica 1 has failed; or held before finish() until then. Both end the
    // same: the held replica completes the step too (every replica reached the collective's final
    // phase), meets the failure in finish()'s collective as replica 1 did, and no shrink leaves it
    // training alone; run() throws replica 0's failure.
    using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
    const std::size_t last = train_losing(3, std::nullopt).per_step - 1;
    constexpr int steps = 2;
    for (const bool in_step : {true, false}) {
        DYNAMIC_SECTION("replica 2 " << (in_step ? "in the last step" : "in finish()")) {
            std::atomic<bool> one_waits{false};  // replica 1 arrived in finish()'s collective
            std::atomic<bool> one_failed{false}; // replica 1's finish() threw
            const auto wait_for = [](const std::atomic<bool>& flag) { // bounded: fail, not hang
                for (int i = 0; i < 20000 && !flag.load(); ++i)
                    std::this_thread::sleep_for(1ms);
            };
            std::array<int, 3> fences{};        // steps begun, by replica (each its own thread)
            std::array<std::size_t, 3> index{}; // collectives entered since the fence
            thread_group::params p{.timeout = 20s};
            p.on_collective = [&](const collective_event& e) {
                if (e.replica == 0 || e.generation != 0 || !e.label.empty())
                    return;
                const auto r = static_cast<std::size_t>(e.replica);
                if (e.when == collective_event::moment::entered) {
                    const bool fence = e.tag == "data_parallel.fence";
                    index[r] = fence ? 0 : index[r] + 1;
                    fences[r] += fence ? 1 : 0;
                } else if (fences[r] == steps && index[r] == last + 1 && r == 1) {
                    one_waits.store(true); // in finish(): replica 0's failure aborts its wait
                } else if (fences[r] == steps && index[r] == last && r == 2 && in_step) {
                    wait_for(one_failed); // arrived: 0 and 1 complete the step without it
                }
            };
            thread_group group(3, p);
            std::mutex m;
            std::vector<std::string> saw(3);
            std::vector<int> finished(3, 0);
            bool returned = false;
            std::string what;
            try {
                group.run([&](thread_communicator& comm) {
                    const auto me = static_cast<std::size_t>(comm.replica());
                    try {
                        data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce,
                                      thread_communicator>
                            dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05f},
                               {.seed = 42, .on_replica_failure = replica_failure::shrink});
                        for (int s = 0; s < steps; ++s)
                            (void)dp.step(shrink_batch,
                                          [](net& n, const shard_range& range, auto& ctx) {
                                              return n.train(range, ctx);
                                          });
                        if (me == 0) {
                            wait_for(one_waits);
                            throw std::runtime_error("replica 0 crashed before finish()");
                        }
                        if (me == 2 && !in_step)
                            wait_for(one_failed);
                        (void)dp.finish();
                        std::lock_guard lock(m);
                        finished[me] = dp.size();
                    } catch (const std::exception& e) {
                        {
                            std::lock_guard lock(m);
                            saw[me] = e.what();
                        }
                        if (me == 1)
                            one_failed.store(true);
                        throw;
                    }
                });
                returned = true;
            } catch (const std::exception& e) {
                what = e.what();
            }
            INFO("run(): " << what << "\nreplica 1: " << saw[1] << "\nreplica 2: " << saw[2]);
            CHECK_FALSE(returned);
            CHECK(contains(what, "replica 0 crashed before finish()"));
            CHECK(group.lost().empty());
            CHECK(finished == std::vector<int>{0, 0, 0});
            CHECK(contains(saw[0], "replica 0 crashed before finish()"));
            CHECK(contains(saw[1], "replica 0 failed: replica 0 crashed before finish()"));
            CHECK(contains(saw[2], "replica 0 failed: replica 0 crashed before finish()"));
            // "... replica R: all_reduce #N: ...": the collective replica R failed in.
            const auto failed_in = [&](std::size_t r) {
                const std::string who = "replica " + std::to_string(r) + ": ";
                const std::size_t at = saw[r].find(who);
                if (at == std::string::npos)
                    return std::string();
                const std::size_t from = at + who.size();
                return saw[r].substr(from, saw[r].find(':', from) - from);
            };
            CHECK(!failed_in(1).empty());
            CHECK(failed_in(2) == failed_in(1)); // finish()'s collective
            CHECK_FALSE(contains(saw[2], "the group does not shrink"));
        }
    }
}

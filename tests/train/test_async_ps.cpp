// tests/train/test_async_ps.cpp: the parameter-server protocol (sync::asynchronous,
// sync::bounded_staleness<S>) on the thread group: staleness bound, bookkeeping, shutdown,
// failures. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/parameter_server.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace lockstep;

TEST_CASE("staleness_gate keeps every applied gradient within S under random arrival orders",
          "[train][async]") {
    // Drives the gate the way the server does (FIFO admission, pushes in random order) and
    // tracks versions independently of the gate's own bookkeeping.
    for (const std::size_t s : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{5}}) {
        for (const int workers : {1, 2, 3, 7}) {
            std::mt19937 gen(static_cast<unsigned>(1000 * s + workers));
            detail::staleness_gate gate(workers, s);
            std::vector<std::int64_t> pulled(workers, -1); // version each worker computes on
            std::vector<int> queue;
            queue.reserve(static_cast<std::size_t>(workers));
            for (int w = 0; w < workers; ++w)
                queue.push_back(w);
            std::int64_t applied_version = 0, max_seen = 0;
            const int steps = 400;
            int applied = 0;
            while (applied < steps) {
                while (!queue.empty() && gate.can_admit(queue.front())) {
                    gate.admit(queue.front());
                    pulled[queue.front()] = applied_version;
                    queue.erase(queue.begin());
                }
                std::vector<int> busy;
                for (int w = 0; w < workers; ++w)
                    if (pulled[w] >= 0)
                        busy.push_back(w);
                REQUIRE(!busy.empty()); // liveness: somebody always computes
                const int y =
                    busy[std::uniform_int_distribution<std::size_t>(0, busy.size() - 1)(gen)];
                const std::int64_t staleness = applied_version - pulled[y];
                REQUIRE(gate.apply(y) == static_cast<std::uint64_t>(staleness));
                REQUIRE(staleness <= static_cast<std::int64_t>(s));
                max_seen = std::max(max_seen, staleness);
                pulled[y] = -1;
                ++applied_version;
                ++applied;
                queue.push_back(y);
            }
            REQUIRE(gate.version() == static_cast<std::uint64_t>(steps));
            // The bound is tight: with two or more workers, random orders reach it.
            if (workers >= 2)
                CHECK(max_seen == static_cast<std::int64_t>(s));
        }
    }
}

TEST_CASE("staleness_gate without a bound admits every worker", "[train][async]") {
    detail::staleness_gate gate(4, std::numeric_limits<std::size_t>::max());
    for (int w = 0; w < 4; ++w) {
        REQUIRE(gate.can_admit(w));
        gate.admit(w);
    }
    REQUIRE(gate.apply(1) == 0);
    REQUIRE(gate.apply(2) == 1);
    REQUIRE(gate.apply(3) == 2);
    REQUIRE(gate.can_admit(1));
    gate.admit(1);
    REQUIRE(gate.apply(0) == 3);
    REQUIRE(gate.apply(1) == 1);
}

namespace {

/// One recorded apply (server side) or compute (worker side).
struct event {
    int rank;
    std::uint64_t index, version_seen, applied_at;
};

/// A "counter network" whose parameters witness the server's version independently of the
/// protocol's labels: every gradient is {1, 0, ...} and the server applies w -= g, so params[0]
/// == -(gradients applied so far); a worker reads the version it really received from it.
template <class SyncPolicy>
struct counter_run {
    int replicas = 4;
    std::size_t steps = 60;
    int slow_rank = 1;
    std::chrono::milliseconds slow{8}, fast{1};

    std::mutex mu;
    std::vector<event> computed, applied;
    int stats_mismatches = 0; ///< applies whose statistics named another worker or item
    staleness_report report;
    std::vector<std::vector<float>> final_params, final_state;

    void run() {
        final_params.assign(replicas, {});
        final_state.assign(replicas, {});
        thread_group group(replicas, {.timeout = std::chrono::seconds(60)});
        group.run([&](thread_communicator& comm) {
            const int r = comm.rank();
            buffer<float> params(5, comm.system());
            buffer<float> state(2, comm.system());
            std::fill(params.begin(), params.end(), r == 0 ? 0.0f : -12345.0f);
            std::fill(state.begin(), state.end(), 0.0f);
            auto compute = [&](const work_item& item, std::span<float> g, std::span<float> st) {
                const auto seen = static_cast<std::uint64_t>(-params[0]);
                std::this_thread::sleep_for(r == slow_rank ? slow : fast);
                std::fill(g.begin(), g.end(), 0.0f);
                g[0] = 1.0f;
                g[1 + static_cast<std::size_t>(r) % 4] = 1.0f; // which worker contributed
                st[0] = static_cast<float>(r);
                st[1] = static_cast<float>(item.index);
                std::lock_guard lock(mu);
                computed.push_back({r, item.index, seen, item.version});
            };
            auto apply = [&](std::span<const float> g, std::span<const float> st,
                             const apply_info& info) {
                for (std::size_t i = 0; i < g.size(); ++i)
                    params[i] -= g[i];
                state[0] += 1.0f;
                state[1] = std::max(state[1], st[1]);
                // The statistics travel with their own gradient and header (checked after run).
                std::lock_guard lock(mu);
                if (static_cast<int>(st[0]) != info.worker ||
                    static_cast<std::uint64_t>(st[1]) != info.index)
                    ++stats_mismatches;
                applied.push_back({info.worker, info.index, info.computed_version, info.version});
            };
            auto rep = run_parameter_server<SyncPolicy>(
                comm, params.span(), state.span(), 2, {.steps = steps, .root = 0}, compute, apply);
            std::lock_guard lock(mu);
            if (r == 0)
                report = rep;
            final_params[r].assign(params.begin(), params.end());
            final_state[r].assign(state.begin(), state.end());
        });
    }

    /// Checks the bookkeeping against the independent witnesses; returns the max staleness
    /// computed from the witnesses.
    std::uint64_t check() {
        CHECK(stats_mismatches == 0);
        REQUIRE(applied.size() == steps);
        REQUIRE(computed.size() == steps);
        REQUIRE(report.applied == steps);
        std::map<std::uint64_t, event> by_index;
        for (const event& e : computed) {
            REQUIRE(e.version_seen == e.applied_at); // the label matches the params received
            REQUIRE(by_index.emplace(e.index, e).second);
        }
        std::uint64_t max_staleness = 0;
        double sum = 0;
        std::vector<std::uint64_t> hist;
        for (std::size_t k = 0; k < applied.size(); ++k) {
            const event& a = applied[k];
            REQUIRE(a.applied_at == k); // versions 0, 1, 2, ...: one per apply
            const event& c = by_index.at(a.index);
            REQUIRE(c.rank == a.rank);
            REQUIRE(a.version_seen == c.version_seen);
            const std::uint64_t st = k - c.version_seen;
            max_staleness = std::max(max_staleness, st);
            sum += double(st);
            if (hist.size() <= st)
                hist.resize(st + 1, 0);
            ++hist[st];
        }
        CHECK(report.max == max_staleness);
        CHECK(report.histogram == hist);
        CHECK(report.mean == Approx(sum / double(steps)).epsilon(1e-12));
        // Every replica ends with the server's parameters and state.
        std::vector<float> expected(5, 0.0f);
        expected[0] = -static_cast<float>(steps);
        for (const event& a : applied)
            expected[1 + static_cast<std::size_t>(a.rank) % 4] -= 1.0f;
        for (int r = 0; r < replicas; ++r) {
            CHECK(final_params[r] == expected);
            CHECK(final_state[r] == std::vector<float>{float(steps), float(steps - 1)});
        }
        std::uint64_t per_rank_total = 0;
        for (int r = 1; r < replicas; ++r) {
            CHECK(report.per_rank[r] ==
                  std::uint64_t(std::count_if(applied.begin(), applied.end(),
                                              [&](const event& e) { return e.rank == r; })));
            per_rank_total += report.per_rank[r];
        }
        CHECK(per_rank_total == steps);
        return max_staleness;
    }
};

} // namespace

TEST_CASE("asynchronous parameter server: a slow worker's gradients arrive stale",
          "[train][async][thread]") {
    counter_run<sync::asynchronous> run;
    run.run();
    const std::uint64_t max_staleness = run.check();
    // The slow worker sleeps 8x longer than the two fast ones, so ~16 versions pass meanwhile;
    // without a bound this must exceed 2 (the bound the next test enforces).
    CHECK(max_staleness > 2);
    CHECK(run.report.held_back == 0);
}

TEST_CASE("bounded_staleness<2>: no applied gradient is older than 2 versions",
          "[train][async][thread]") {
    counter_run<sync::bounded_staleness<2>> run;
    run.run();
    const std::uint64_t max_staleness = run.check();
    CHECK(max_staleness <= 2);
    CHECK(run.report.max <= 2);
    CHECK(run.report.held_back > 0); // the fast workers did have to wait
}

TEST_CASE("bounded_staleness<0> serializes the workers (staleness 0 everywhere)",
          "[train][async][thread]") {
    counter_run<sync::bounded_staleness<0>> run;
    run.steps = 20;
    run.run();
    CHECK(run.check() == 0);
}

TEST_CASE("bounded_staleness<1> with more workers than the bound allows at once",
          "[train][async][thread]") {
    counter_run<sync::bounded_staleness<1>> run;
    run.replicas = 5;
    run.steps = 40;
    run.run();
    CHECK(run.check() <= 1);
}

TEST_CASE("parameter server with one worker and a server on a non-zero root",
          "[train][async][thread]") {
    std::vector<float> result(2, 0.0f);
    // Recorded on the replica threads, checked after run() (Catch2's assertions are not
    // thread-safe): the server's largest staleness and report, the worker's last version.
    int max_staleness = -1;
    staleness_report server_report, worker_report;
    std::uint64_t worker_version = 0;
    thread_group group(2, {.timeout = std::chrono::seconds(30)});
    group.run([&](thread_communicator& comm) {
        buffer<float> params(3, comm.system());
        std::fill(params.begin(), params.end(), comm.rank() == 1 ? 1.0f : 0.0f);
        std::uint64_t last_version = 0;
        auto rep = run_parameter_server<sync::asynchronous>(
            comm, params.span(), {}, 0, {.steps = 7, .root = 1},
            [&](const work_item& item, std::span<float> g, std::span<float>) {
                last_version = item.version;
                for (std::size_t i = 0; i < g.size(); ++i)
                    g[i] = params[i];
            },
            [&](std::span<const float> g, std::span<const float>, const apply_info& info) {
                max_staleness = std::max(max_staleness, static_cast<int>(info.staleness));
                for (std::size_t i = 0; i < g.size(); ++i)
                    params[i] -= 0.5f * g[i];
            });
        if (comm.rank() == 1) {
            server_report = rep;
        } else {
            worker_report = rep;
            worker_version = last_version;
        }
        result[comm.rank()] = params[2];
    });
    CHECK(max_staleness == 0); // one worker: never stale
    CHECK(server_report.applied == 7);
    CHECK(server_report.max == 0);
    CHECK(worker_version == 6);
    CHECK(worker_report.per_rank[0] == 7);
    CHECK(result[0] == 1.0f / 128.0f); // (1/2)^7, exact in float
    CHECK(result[1] == 1.0f / 128.0f);
}

namespace {

/// What a parameter-server run that failed left: each replica's error text, and run()'s
/// rethrow (empty when the group finished).
struct ps_failure {
    std::map<int, std::string> errors;
    std::optional<error> rethrown;
};

/// run_parameter_server<Sync> over 4 floats on `replicas` thread replicas (group timeout
/// `timeout`, a budget of `steps` gradients) whose workers push all-ones gradients after
/// calling before(rank, n) for their n-th work item (n from 1), which may throw or stall.
template <class Sync, class Before>
ps_failure run_failing_ps(int replicas, std::chrono::milliseconds timeout, std::size_t steps,
                          Before before) {
    ps_failure out;
    std::mutex mu;
    try {
        thread_group(replicas, {.timeout = timeout}).run([&](thread_communicator& comm) {
            buffer<float> params(4, comm.system());
            std::fill(params.begin(), params.end(), 0.0f);
            int my_items = 0;
            try {
                run_parameter_server<Sync>(
                    comm, params.span(), {}, 0, {.steps = steps},
                    [&](const work_item&, std::span<float> g, std::span<float>) {
                        before(comm.rank(), ++my_items);
                        std::fill(g.begin(), g.end(), 1.0f);
                    },
                    [&](std::span<const float>, std::span<const float>, const apply_info&) {});
            } catch (const error& e) {
                std::lock_guard lock(mu);
                out.errors[comm.rank()] = e.what();
                throw;
            }
        });
    } catch (const error& e) {
        out.rethrown = e;
    }
    return out;
}

} // namespace

TEST_CASE("a failing worker stops the run on every replica without a hang",
          "[train][async][thread]") {
    auto [errors, rethrown] = run_failing_ps<sync::bounded_staleness<3>>(
        4, std::chrono::seconds(30), 1000, [](int rank, int n) {
            if (rank == 2 && n == 3)
                fail(errc::invalid_argument, rank, "test.compute", "injected failure");
        });
    REQUIRE(rethrown); // the group did not finish although a worker failed
    REQUIRE(errors.size() == 4);
    CHECK(errors[2].find("injected failure") != std::string::npos);
    CHECK(errors[0].find("peer_failure") != std::string::npos);
    INFO(errors[0]);
    // The server names the worker itself, or passes on the thread group's report of it.
    CHECK((errors[0].find("worker 2") != std::string::npos ||
           errors[0].find("injected failure") != std::string::npos));
    for (int r : {1, 3})
        CHECK(errors[r].find("peer_failure") != std::string::npos);
}

TEST_CASE("a stalled worker is named by the server's timeout, with its work item and version",
          "[train][async][thread]") {
    // Worker 1 stalls on its second item past the group's timeout. recv_any's own timeout names
    // no sender: the server names the worker it waited for.
    auto [errors, rethrown] =
        run_failing_ps<sync::asynchronous>(2, std::chrono::milliseconds(300), 6, [](int, int n) {
            if (n == 2)
                std::this_thread::sleep_for(std::chrono::milliseconds(900));
        });
    const std::string server_error = errors[0];
    REQUIRE(rethrown); // the group did not finish although a worker stalled past the timeout
    CHECK(rethrown->code() == errc::timeout);
    CHECK(std::string(rethrown->what()) == server_error); // run() rethrows the server's report
    INFO(server_error);
    CHECK(server_error.find("replica 0: parameter_server: the server waited for a gradient from "
                            "worker 1 (work item 1 on version 1) and got none; 1 of 6 gradients "
                            "were taken: ") != std::string::npos);
    CHECK(server_error.find("timed out after 300 ms") != std::string::npos);
}

TEST_CASE("a worker held back by the bound points its timeout at the server's report",
          "[train][async][thread]") {
    // bounded_staleness<0>: worker 1 waits for new work while worker 2 stalls; its own timeout
    // says why it waited and where the straggler is named.
    auto [errors, rethrown] = run_failing_ps<sync::bounded_staleness<0>>(
        3, std::chrono::milliseconds(300), 6, [](int rank, int n) {
            if (rank == 2 && n == 2)
                std::this_thread::sleep_for(std::chrono::milliseconds(900));
        });
    REQUIRE(rethrown); // the group did not finish although a worker stalled past the timeout
    CHECK(rethrown->code() == errc::timeout);
    INFO(errors[0] << "\n" << errors[1]);
    // Whichever timed out first: the server names worker 2, worker 1 points at the server.
    const bool server_named =
        errors[0].find("the server waited for a gradient from worker 2 (") != std::string::npos;
    const bool worker_pointed =
        errors[1].find("replica 1: parameter_server: worker 1 waited for work from the server "
                       "(rank 0) and got none; the server holds a worker back") !=
        std::string::npos;
    CHECK((server_named || worker_pointed));
    if (errors[1].starts_with("lockstep error [timeout]")) // worker 1's own timeout
        CHECK(worker_pointed);
}

TEST_CASE("a failing server update aborts every worker", "[train][async][thread]") {
    std::mutex mu;
    std::map<int, std::string> errors;
    thread_group group(3, {.timeout = std::chrono::seconds(30)});
    try {
        group.run([&](thread_communicator& comm) {
            buffer<float> params(2, comm.system());
            std::fill(params.begin(), params.end(), 0.0f);
            try {
                run_parameter_server<sync::asynchronous>(
                    comm, params.span(), {}, 0, {.steps = 100},
                    [&](const work_item&, std::span<float> g, std::span<float>) {
                        std::fill(g.begin(), g.end(), 1.0f);
                    },
                    [&](std::span<const float>, std::span<const float>, const apply_info& i) {
                        if (i.version == 5)
                            fail(errc::non_finite, comm.rank(), "test.apply", "injected");
                    });
            } catch (const error& e) {
                std::lock_guard lock(mu);
                errors[comm.rank()] = e.what();
                throw;
            }
        });
        FAIL("the group finished although the server failed");
    } catch (const error&) {
    }
    REQUIRE(errors.size() == 3);
    CHECK(errors[0].find("injected") != std::string::npos);
    CHECK(errors[1].find("peer_failure") != std::string::npos);
    CHECK(errors[2].find("peer_failure") != std::string::npos);
}

TEST_CASE("replicas that disagree on sizes, budget or root fail on every replica",
          "[train][async][thread]") {
    struct variant {
        std::size_t params, steps;
        int root;
        const char* what;
    };
    // Replica 2 passes the odd value.
    for (const variant v : {variant{5, 3, 0, "parameter count"}, variant{4, 4, 0, "steps"},
                            variant{4, 3, 1, "root"}}) {
        std::atomic<int> mismatches{0};
        std::mutex mu;
        std::string message;
        thread_group group(3, {.timeout = std::chrono::seconds(30)});
        try {
            group.run([&](thread_communicator& comm) {
                const bool odd = comm.rank() == 2;
                buffer<float> params(odd ? v.params : 4, comm.system());
                try {
                    run_parameter_server<sync::asynchronous>(
                        comm, params.span(), {}, 0,
                        {.steps = odd ? v.steps : 3, .root = odd ? v.root : 0},
                        [](const work_item&, std::span<float>, std::span<float>) {},
                        [](std::span<const float>, std::span<const float>, const apply_info&) {});
                } catch (const error& e) {
                    if (e.code() == errc::count_mismatch)
                        ++mismatches;
                    std::lock_guard lock(mu);
                    message = e.what();
                    throw;
                }
            });
        } catch (const error&) {
        }
        INFO(v.what << ": " << message);
        CHECK(mismatches == 3);
        CHECK(message.find(v.what) != std::string::npos);
    }
}

TEST_CASE("a single replica cannot run a parameter server", "[train][async][thread]") {
    thread_group group(1);
    REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
        buffer<float> params(2, comm.system());
        run_parameter_server<sync::asynchronous>(
            comm, params.span(), {}, 0, {.steps = 3},
            [](const work_item&, std::span<float>, std::span<float>) {},
            [](std::span<const float>, std::span<const float>, const apply_info&) {});
    }),
                        Catch::Contains("needs a server and at least one worker"));
}

namespace {

/// One weight whose gradient is 1 for every batch (loss = w, whatever the samples): the server's
/// update w -= lr * 1 then depends only on the learning rate each applied gradient gets.
struct unit_gradient_net {
    using ctx_type = replica_context<double, thread_communicator>;
    ctx_type::handle w;
    explicit unit_gradient_net(ctx_type& ctx) : w(ctx.registry().add("w", {1})) {}
    double train(const shard_range& r, ctx_type& ctx) {
        if (ctx.rank() == 1) // worker 1 is slow: its gradients arrive stale
            std::this_thread::sleep_for(std::chrono::milliseconds(6));
        w.grad()[0] += r.scale * static_cast<double>(r.size());
        ctx.mark_ready(w);
        return w.value()[0] * r.scale * static_cast<double>(r.size());
    }
};

} // namespace

TEST_CASE("a stale gradient gets the learning rate of the version it is applied as",
          "[train][async][thread]") {
    // lr(v) = 2^-v for the server version v: each of the N gradients is applied as one version
    // 0..N-1 whatever its staleness, so w = -sum_v 2^-v, exact in double. A rate taken from
    // the version a stale gradient was computed on would count some rates twice.
    constexpr std::size_t steps = 24;
    double expected = 0.0; // the registry's initial weight
    for (std::size_t v = 0; v < steps; ++v)
        expected -= std::ldexp(1.0, -static_cast<int>(v));
    std::vector<double> w(3);
    staleness_report report;
    thread_group(3).run([&](thread_communicator& comm) {
        data_parallel<unit_gradient_net, optim::sgd<double>, sync::asynchronous> dp(
            comm, [](auto& ctx) { return unit_gradient_net(ctx); }, {.lr = 1.0},
            {.lr = [](std::int64_t v) { return std::ldexp(1.0, -static_cast<int>(v)); }});
        const async_result r =
            dp.train(steps, 4, [](unit_gradient_net& n, const shard_range& range, auto& ctx) {
                return n.train(range, ctx);
            });
        w[static_cast<std::size_t>(comm.rank())] = dp.parameters()[0];
        if (comm.rank() == 0)
            report = r.staleness;
    });
    REQUIRE(report.max > 0); // some gradient was stale, so the versions differ
    for (std::size_t r = 0; r < 3; ++r) {
        INFO("replica " << r);
        CHECK(w[r] == expected);
    }
}

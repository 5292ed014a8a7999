// Two trainers built on one communicator with identical settings, stepped in another order on
// one replica: every replica throws naming both trainers (synchronous: in the step's status,
// nothing applied; local SGD: at the average, before the weights are mixed; asynchronous: at
// train()'s agreement, before any work), instead of reducing one trainer's gradients with the
// other's. The same order on every replica trains each trainer as a 1-replica run does. A
// trainer entered again while a call runs (nested, or from another thread), or whose
// communicator was moved from, is refused naming that. SPDX-License-Identifier: Apache-2.0
#include "mlp_fixture.hpp"
#include "support/replica_errors.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace lockstep_test;

namespace {

/// y = w . x + b, squared error against 0.5 x3 - x0, on the shared feature data; the initial
/// w is init + 0.1 (i + rank) (differs per replica before the trainer's broadcast).
struct linear {
    std::vector<double> w = std::vector<double>(3), dw = std::vector<double>(3);
    std::vector<double> b = std::vector<double>(1), db = std::vector<double>(1);
    linear(double init, int rank) {
        for (std::size_t i = 0; i < 3; ++i)
            w[i] = init + 0.1 * double(i + static_cast<std::size_t>(rank));
    }
    template <class F>
    void for_each_parameter(F&& f) {
        f("w", std::span<double>(w), std::span<double>(dw));
        f("b", std::span<double>(b), std::span<double>(db));
    }
    double train(const shard_range& r) {
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const auto g = r.sample_index(i);
            double y = b[0];
            const double target = 0.5 * feature(g, 3) - feature(g, 0);
            for (std::size_t k = 0; k < 3; ++k)
                y += w[k] * feature(g, k);
            loss += (y - target) * (y - target) * r.scale;
            for (std::size_t k = 0; k < 3; ++k)
                dw[k] += 2 * (y - target) * r.scale * feature(g, k);
            db[0] += 2 * (y - target) * r.scale;
        }
        return loss;
    }
};

using sgd = optim::sgd<double>;
auto train_fn = [](linear& n, const shard_range& r, auto&) { return n.train(r); };

/// Replica 0's initial values of a network built with `init` (what the broadcast gives all).
std::vector<double> initial(double init) {
    linear n(init, 0);
    return {n.w[0], n.w[1], n.w[2], n.b[0]};
}

constexpr const char* swapped_text = "replica 1 stepped trainer #2 on this communicator while "
                                     "replica 0 stepped trainer #1: every replica must step its "
                                     "trainers in the same order";

} // namespace

TEST_CASE("synchronous: after a swapped step each trainer keeps its own sample count",
          "[train][thread][agreement]") {
    // A refused step consumes no samples, but the rows it reads back may be the other
    // trainer's: taking replica 0's first sample from them gave one trainer the other's count.
    using trainer = data_parallel<linear, sgd, sync::synchronous, reduce::bucketed<>>;
    std::vector<std::vector<std::uint64_t>> samples(2);
    const auto e = errors_of(2, [&](int rank, thread_communicator& comm) {
        trainer a(comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1});
        trainer b(comm, [](auto& ctx) { return linear(-0.3, ctx.rank()); }, {.lr = 0.1});
        a.step(12, train_fn);
        b.step(20, train_fn);
        try {
            if (rank == 1)
                b.step(20, train_fn);
            else
                a.step(12, train_fn);
        } catch (const error&) {
            samples[static_cast<std::size_t>(rank)] = {a.samples(), b.samples()};
            throw;
        }
    });
    for (std::size_t r = 0; r < 2; ++r) {
        INFO("replica " << r << ": " << e[r].first);
        CHECK_THAT(e[r].first, Catch::Contains(swapped_text));
        // Only its own global_batch ever moved each trainer's count.
        CHECK(samples[r][0] % 12 == 0);
        CHECK(samples[r][1] % 20 == 0);
    }
}

TEST_CASE("synchronous: two trainers on one communicator stepped in another order on a replica "
          "fail on every replica, nothing applied",
          "[train][thread][agreement]") {
    using trainer = data_parallel<linear, sgd, sync::synchronous, reduce::bucketed<>>;
    // [replicas][rank] = {a's values, b's values} after 4 steps of 16 samples each.
    auto run = [](int replicas, bool swap, std::vector<std::vector<std::vector<double>>>& out) {
        out.assign(static_cast<std::size_t>(replicas), {});
        return errors_of(replicas, [&](int rank, thread_communicator& comm) {
            trainer a(comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1});
            trainer b(comm, [](auto& ctx) { return linear(-0.3, ctx.rank()); }, {.lr = 0.1});
            auto keep = [&] {
                const auto pa = a.parameters(), pb = b.parameters();
                out[static_cast<std::size_t>(rank)] = {{pa.begin(), pa.end()},
                                                       {pb.begin(), pb.end()}};
            };
            try {
                for (int s = 0; s < 4; ++s) {
                    if (swap && rank == 1) {
                        b.step(16, train_fn);
                        a.step(16, train_fn);
                    } else {
                        a.step(16, train_fn);
                        b.step(16, train_fn);
                    }
                }
            } catch (...) {
                keep();
                throw;
            }
            keep();
        });
    };
    std::vector<std::vector<std::vector<double>>> ref, same, swapped;
    for (const auto& [msg, code] : run(1, false, ref))
        REQUIRE(code == -1);

    SECTION("the same order on every replica: each trainer as on 1 replica") {
        for (const auto& [msg, code] : run(2, false, same)) {
            INFO(msg);
            CHECK(code == -1);
        }
        // Tolerance: the 2-replica sum adds the 16 per-sample gradients in another grouping;
        // values are O(1), so 4 steps differ by a few ulps of double.
        for (std::size_t r = 0; r < 2; ++r)
            for (std::size_t t = 0; t < 2; ++t)
                for (std::size_t i = 0; i < 4; ++i)
                    CHECK(std::fabs(same[r][t][i] - ref[0][t][i]) <= 1e-12);
    }
    SECTION("replica 1 steps b before a: an error naming both trainers on every replica") {
        const auto e = run(2, true, swapped);
        for (std::size_t r = 0; r < 2; ++r) {
            INFO("replica " << r << ": " << e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first, Catch::Contains(swapped_text));
            CHECK_THAT(e[r].first, Catch::Contains("step 0 skipped"));
            // The first step of each replica failed: neither trainer changed.
            REQUIRE(swapped[r].size() == 2);
            CHECK(swapped[r][0] == initial(0.5));
            CHECK(swapped[r][1] == initial(-0.3));
        }
    }
}

TEST_CASE("local SGD: two trainers stepped in another order fail at the average on every "
          "replica",
          "[train][thread][agreement][local_sgd]") {
    using trainer = data_parallel<linear, sgd, sync::local_sgd<2>, reduce::per_tensor>;
    const auto e = errors_of(2, [](int rank, thread_communicator& comm) {
        trainer a(comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1});
        trainer b(comm, [](auto& ctx) { return linear(-0.3, ctx.rank()); }, {.lr = 0.1});
        for (int s = 0; s < 4; ++s) {
            if (rank == 1) {
                b.step(16, train_fn);
                a.step(16, train_fn);
            } else {
                a.step(16, train_fn);
                b.step(16, train_fn);
            }
        }
    });
    for (const auto& [msg, code] : e) {
        INFO(msg);
        CHECK(code == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(msg, Catch::Contains("data_parallel.average"));
        CHECK_THAT(msg, Catch::Contains(swapped_text));
    }
}

TEST_CASE("asynchronous: two trainers trained in another order fail on every replica",
          "[train][thread][agreement][async]") {
    using trainer = data_parallel<linear, sgd, sync::asynchronous, reduce::per_tensor>;
    std::vector<std::vector<double>> after(2);
    const auto e = errors_of(2, [&](int rank, thread_communicator& comm) {
        trainer a(comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1});
        trainer b(comm, [](auto& ctx) { return linear(-0.3, ctx.rank()); }, {.lr = 0.1});
        trainer& first = rank == 1 ? b : a;
        try {
            first.train(2, 8, train_fn);
        } catch (...) {
            const auto p = first.parameters();
            after[static_cast<std::size_t>(rank)].assign(p.begin(), p.end());
            throw;
        }
    });
    for (std::size_t r = 0; r < 2; ++r) {
        INFO("replica " << r << ": " << e[r].first);
        CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(e[r].first, Catch::Contains("the replicas train different trainers: trainer "
                                               "#1 to #2 on this communicator"));
        // Refused before any work.
        CHECK(after[r] == initial(r == 1 ? -0.3 : 0.5));
    }
}

// A second training call on a trainer while one runs (from its step function, its gradient
// hook, on_apply, or another thread) would zero, reduce and apply the buffers the first still
// uses: refused, naming both calls, before it touches anything.
TEST_CASE("a step entered again from the step function or the gradient hook is refused",
          "[train][thread][agreement]") {
    using trainer = data_parallel<linear, sgd, sync::synchronous, reduce::bucketed<>>;
    const std::string nested =
        "data_parallel.step: called while data_parallel.step of this trainer runs on the same "
        "thread";
    for (const bool from_hook : {false, true}) {
        INFO((from_hook ? "gradient hook" : "step function"));
        const auto e = errors_of(2, [&](int, thread_communicator& comm) {
            trainer t(comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1});
            if (from_hook)
                t.set_gradient_hook(
                    [&](std::span<double>, std::span<const tensor_info>) { t.step(8, train_fn); });
            t.step(8, [&](linear& n, const shard_range& r, auto& ctx) {
                if (!from_hook)
                    t.step(8, train_fn);
                return train_fn(n, r, ctx);
            });
        });
        for (std::size_t r = 0; r < 2; ++r) {
            INFO(e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first, Catch::Contains("replica " + std::to_string(r) + ": " + nested));
        }
    }
}

TEST_CASE("a training call on a second thread while a step runs is refused; the step goes on",
          "[train][thread][agreement]") {
    using trainer = data_parallel<linear, sgd, sync::synchronous, reduce::bucketed<>>;
    std::vector<std::string> refused;
    std::vector<std::vector<double>> weights(2);
    const auto e = errors_of(2, [&](int rank, thread_communicator& comm) {
        trainer t(comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1});
        for (int s = 0; s < 2; ++s)
            t.step(8, [&](linear& n, const shard_range& r, auto& ctx) {
                if (rank == 0 && s == 1) // another thread tries while this one is inside
                    std::thread([&] {
                        for (int call = 0; call < 3; ++call)
                            try {
                                if (call == 0)
                                    t.step(8, train_fn);
                                else if (call == 1)
                                    (void)t.read_result();
                                else
                                    (void)t.finish();
                                refused.emplace_back("not refused");
                            } catch (const lockstep::error& x) {
                                refused.emplace_back(x.what());
                            }
                    }).join();
                return train_fn(n, r, ctx);
            });
        (void)t.finish();
        const auto p = t.parameters();
        weights[static_cast<std::size_t>(rank)].assign(p.begin(), p.end());
    });
    for (const auto& [msg, code] : e)
        CHECK(code == -1);
    REQUIRE(refused.size() == 3);
    const char* ops[] = {"data_parallel.step", "data_parallel.read_result", "data_parallel.finish"};
    for (std::size_t k = 0; k < 3; ++k) {
        INFO(refused[k]);
        CHECK_THAT(refused[k], Catch::Contains(std::string("replica 0: ") + ops[k] +
                                               ": called on a second thread while another thread "
                                               "is inside data_parallel.step of this trainer"));
    }
    CHECK(weights[0] == weights[1]);
}

TEST_CASE("a trainer whose communicator was moved from says so", "[train][thread][agreement]") {
    using trainer = data_parallel<linear, sgd, sync::synchronous, reduce::bucketed<>>;
    const auto e = errors_of(2, [&](int, thread_communicator& comm) {
        trainer t(comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1});
        t.step(8, train_fn);
        thread_communicator moved(std::move(comm));
        t.step(8, train_fn);
    });
    for (const auto& [msg, code] : e) {
        INFO(msg);
        CHECK(code == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(msg, Catch::Contains("data_parallel.step: the communicator this trainer was "
                                        "built on was moved from"));
    }
}

TEST_CASE("train() called again from on_apply is refused on the server",
          "[train][thread][agreement][async]") {
    using async_t = data_parallel<linear, sgd, sync::asynchronous, reduce::per_tensor>;
    const auto e = errors_of(3, [&](int, thread_communicator& comm) {
        async_t* self = nullptr;
        async_params ap;
        ap.on_apply = [&](const apply_info&, double) { self->train(1, 4, train_fn); };
        async_t t(
            comm, [](auto& ctx) { return linear(0.5, ctx.rank()); }, {.lr = 0.1}, {}, ap);
        self = &t;
        t.train(4, 4, train_fn);
    });
    INFO(e[0].first);
    CHECK(e[0].second == static_cast<int>(errc::invalid_argument));
    CHECK_THAT(e[0].first, Catch::Contains("replica 0: data_parallel.train: called while "
                                           "data_parallel.train of this trainer runs on the same "
                                           "thread"));
    for (std::size_t r = 1; r < 3; ++r)
        CHECK(e[r].second == static_cast<int>(errc::peer_failure));
}

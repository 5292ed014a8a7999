// reduce::reproducible<8> with bn::ghost<8>: the digits-like MLP (ghost BN, dropout keyed by the
// global sample index) trained for 50 uneven steps on 1, 2, 3, 4, 5 and 8 thread replicas holds
// bitwise identical parameters, optimizer state, BN running statistics and losses, for SGD,
// AdamW and LAMB in float and double, whether the exchange gathers every chunk to every replica
// (this small network under the default policy) or goes by blocks (reduce::reproducible<8, 0>).
// SPDX-License-Identifier: Apache-2.0
#include "optimizer_cases.hpp"
#include "repro_runner.hpp"

#include "train_runner.hpp"

#include <catch2/catch.hpp>

using namespace lockstep_test;

namespace {

template <class T, template <class> class Case>
void check_replica_counts() {
    using opt = typename Case<T>::type;
    const auto batches = repro_schedule();
    const auto one = repro_threads<T, opt>(1, Case<T>::params(), batches);
    const repro_record<T>& ref = one[0];
    // It trained: the weights moved and the running statistics left their initial values.
    REQUIRE(rel_error(ref.trace.back(), ref.trace.front()) > 1e-3);
    REQUIRE(ref.running[0] != T(0));
    REQUIRE(ref.optimizer_steps == static_cast<std::int64_t>(batches.size()));
    for (int replicas : {2, 3, 4, 5, 8}) {
        const auto run = repro_threads<T, opt>(replicas, Case<T>::params(), batches);
        for (std::size_t r = 0; r < run.size(); ++r) {
            INFO("replicas " << replicas << ", replica " << r);
            CHECK(repro_difference(run[r], ref) == "");
        }
    }
    for (int replicas : {1, 2, 3, 8}) {
        const auto run = repro_threads<T, opt, repro_blocks>(replicas, Case<T>::params(), batches);
        for (std::size_t r = 0; r < run.size(); ++r) {
            INFO("blocks, replicas " << replicas << ", replica " << r);
            CHECK(repro_difference(run[r], ref) == "");
        }
    }
}

/// The collectives one step of the test network issues on 2 thread replicas under Reduce.
template <class Reduce>
std::size_t step_collectives(std::size_t global) {
    using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
    std::size_t out = 0;
    thread_group group(2);
    group.run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, Reduce, thread_communicator> dp(
            comm, [&](auto& ctx) { return net(ctx, mlp_shape{}); }, {.lr = 0.1f}, {.seed = 42});
        const std::size_t before = dp.collectives();
        (void)dp.step(global, [](net& n, const shard_range& range, auto& ctx) {
            return n.train(range, ctx);
        });
        if (comm.rank() == 0)
            out = dp.collectives() - before;
    });
    return out;
}

} // namespace

TEMPLATE_TEST_CASE("reduce::reproducible: bitwise the same weights, state and BN statistics for "
                   "1, 2, 3, 4, 5 and 8 replicas",
                   "[train][reproducible][thread]", float, double) {
    SECTION("sgd") {
        check_replica_counts<TestType, sgd_case>();
    }
    SECTION("adamw") {
        check_replica_counts<TestType, adamw_case>();
    }
    SECTION("lamb") {
        check_replica_counts<TestType, lamb_case>();
    }
}

TEMPLATE_TEST_CASE("reduce::reproducible without BN trains like synchronous per_tensor",
                   "[train][reproducible][thread]", float, double) {
    // With the BN layer as the identity, the sum of chunk gradients is the gradient of the global
    // batch: the same trajectory as the ordinary synchronous trainer, within rounding.
    using T = TestType;
    const auto batches = repro_schedule(20);
    const mlp_shape shape{.batch_norm = false};
    const auto repro =
        repro_threads<T, optim::adamw<T>>(3, adamw_case<T>::params(), batches, shape);
    const auto plain = repro_threads<T, optim::adamw<T>, reduce::per_tensor, bn::local>(
        1, adamw_case<T>::params(), batches, shape);
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-10;
    for (std::size_t s = 0; s < batches.size(); ++s) {
        INFO("step " << s);
        CHECK(rel_error(repro[0].trace[s], plain[0].trace[s]) <= tol);
        CHECK(repro[0].losses[s] == Approx(plain[0].losses[s]).epsilon(tol));
    }
}

TEST_CASE("reduce::reproducible gathers a small network's chunks in 2 collectives, and blocks "
          "take one all_to_all per chunk index",
          "[train][reproducible][thread]") {
    // 37 samples in chunks of 8: 5 chunks, 3 on the busiest of 2 replicas.
    CHECK(step_collectives<repro_reduce>(37) == 2);
    CHECK(step_collectives<repro_blocks>(37) == 3 + 1 + 1);
    CHECK(repro_reduce::name() == "reduce::reproducible<8>");
    CHECK(repro_blocks::name() == "reduce::reproducible<8, 0>");
}

TEMPLATE_TEST_CASE("reduce::reproducible: a non-finite gradient skips the step on every replica",
                   "[train][reproducible][thread]", repro_reduce, repro_blocks) {
    using net = mlp<double, thread_communicator, storage::registry, repro_bn>;
    thread_group group(3);
    std::vector<std::vector<double>> before(3), after(3);
    std::vector<int> skipped(3);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        data_parallel<net, optim::sgd<double>, sync::synchronous, TestType, thread_communicator> dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, {.seed = 1});
        const auto fn = [](net& n, const shard_range& range, auto& ctx) {
            return n.train(range, ctx);
        };
        dp.step(37, fn);
        auto p = dp.parameters();
        before[r].assign(p.begin(), p.end());
        dp.network().poison = comm.rank() == 1;
        skipped[r] = dp.step(37, fn).skipped ? 1 : 0;
        p = dp.parameters();
        after[r].assign(p.begin(), p.end());
    });
    for (std::size_t r = 0; r < 3; ++r) {
        CHECK(skipped[r] == 1);
        CHECK(after[r] == before[r]);
    }
}

TEST_CASE("reduce::reproducible refuses micro-batches", "[train][reproducible][thread]") {
    using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
    thread_group group(1);
    CHECK_THROWS_WITH(group.run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce, thread_communicator>
            dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, {.micro_batches = 2});
    }),
                      Catch::Contains("reduce::reproducible cuts every global batch into chunks"));
}

// data_parallel beyond plain equivalence: registry vs visitor (member and ADL), gradient
// accumulation, mark_ready buckets, parameter mismatch, non-finite steps, local SGD.
// SPDX-License-Identifier: Apache-2.0
#include "train_runner.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/sgd.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <mutex>
#include <string>

using namespace lockstep_test;

namespace {
using sgd = optim::sgd<float>;
const optim::sgd_params sgd_p{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3};
using small_buckets = reduce::bucketed<64, 32>;

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
} // namespace

TEST_CASE("the registry path and the visitor path train the same network to the same bits",
          "[train][thread]") {
    for (int replicas : {1, 3}) {
        INFO("replicas " << replicas);
        const auto reg = train_run<float, sgd, sync::synchronous, small_buckets, storage::registry>(
            {.replicas = replicas}, sgd_p);
        const auto vis = train_run<float, sgd, sync::synchronous, small_buckets, storage::visitor>(
            {.replicas = replicas}, sgd_p);
        REQUIRE(reg.layout.size() == vis.layout.size());
        for (std::size_t t = 0; t < reg.layout.size(); ++t) {
            CHECK(reg.layout[t].name == vis.layout[t].name);
            CHECK(reg.layout[t].offset == vis.layout[t].offset);
        }
        CHECK(first_divergence(vis).empty());
        for (std::size_t s = 0; s < reg.params[0].size(); ++s) {
            INFO("step " << s);
            CHECK(same_bits(reg.params[0][s], vis.params[0][s]));
            CHECK(same_bits(reg.state[0][s], vis.state[0][s]));
        }
    }
}

// A user network whose visitor is a free function found by ADL, next to the same network with a
// member visitor: y = w . x + b, squared error, on the shared feature data.
namespace user {
template <bool Member>
struct linear {
    std::vector<double> w = std::vector<double>(5), dw = std::vector<double>(5);
    std::vector<double> b = std::vector<double>(1), db = std::vector<double>(1);
    explicit linear(int rank) {
        for (std::size_t i = 0; i < 5; ++i)
            w[i] = 0.1 * double(i + rank); // differs per replica
    }
    template <class F>
    requires Member void for_each_parameter(F&& f) {
        f("w", std::span<double>(w), std::span<double>(dw));
        f("b", std::span<double>(b), std::span<double>(db));
    }
    double train(const lockstep::shard_range& r) {
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const auto g = r.sample_index(i);
            double y = b[0], target = 0.5 * lockstep_test::feature(g, 5);
            for (std::size_t k = 0; k < 5; ++k)
                y += w[k] * lockstep_test::feature(g, k);
            loss += (y - target) * (y - target) * r.scale;
            for (std::size_t k = 0; k < 5; ++k)
                dw[k] += 2 * (y - target) * r.scale * lockstep_test::feature(g, k);
            db[0] += 2 * (y - target) * r.scale;
        }
        return loss;
    }
};
template <class F>
void for_each_parameter(linear<false>& n, F&& f) {
    f("w", std::span<double>(n.w), std::span<double>(n.dw));
    f("b", std::span<double>(n.b), std::span<double>(n.db));
}
} // namespace user

TEST_CASE("for_each_parameter is found as a member and by ADL", "[train][thread]") {
    auto run = [](auto tag) {
        using net = user::linear<decltype(tag)::value>;
        std::vector<std::vector<double>> out(2);
        thread_group(2).run([&](thread_communicator& comm) {
            data_parallel<net, optim::sgd<double>, sync::synchronous, reduce::per_tensor> dp(
                comm, [](auto& ctx) { return net(ctx.rank()); }, {.lr = 0.1});
            static_assert(decltype(dp)::uses_visitor);
            for (int s = 0; s < 10; ++s)
                dp.step(9, [](net& n, const shard_range& r, auto&) { return n.train(r); });
            // The network's own buffers hold the trained values (unpacked after every step).
            out[comm.rank()] = dp.network().w;
        });
        return out;
    };
    const auto member = run(std::true_type{});
    const auto adl = run(std::false_type{});
    CHECK(member[0] == member[1]);
    CHECK(adl[0] == member[0]);
    CHECK(adl[1] == member[0]);
    CHECK(member[0] != std::vector<double>{0, 0.1, 0.2, 0.3, 0.4}); // it trained
}

TEST_CASE("gradient accumulation over micro-batches equals the single big batch",
          "[train][thread]") {
    SECTION("without batch norm: 3 replicas x 4 micro-batches == 1 replica x 1 batch") {
        mlp_shape plain;
        plain.batch_norm = false;
        const auto ref =
            train_run<double, optim::adam<double>, sync::synchronous, reduce::per_tensor,
                      storage::registry>({.replicas = 1, .shape = plain}, {.lr = 1e-2});
        const auto acc = train_run<double, optim::adam<double>, sync::synchronous, small_buckets,
                                   storage::registry>(
            {.replicas = 3, .micro_batches = 4, .shape = plain}, {.lr = 1e-2});
        CHECK(first_divergence(acc).empty());
        for (std::size_t s = 0; s < ref.params[0].size(); ++s) {
            INFO("step " << s);
            CHECK(max_tensor_rel_error(acc.params[0][s], ref.params[0][s], ref.layout) <= 1e-10);
            CHECK(acc.results[0][s].loss == Approx(ref.results[0][s].loss).epsilon(1e-10));
        }
    }
    SECTION("with bn::global the statistics are per global micro-batch, whatever the replicas") {
        // 2 micro-batches per step; the batch of 3 would leave a micro-batch of one sample.
        const std::vector<std::size_t> batches = {37, 12, 7, 20, 9, 16};
        const auto ref = train_run<double, optim::adam<double>, sync::synchronous,
                                   reduce::per_tensor, storage::registry>(
            {.replicas = 1, .batches = batches, .micro_batches = 2}, {.lr = 1e-2});
        const auto acc = train_run<double, optim::adam<double>, sync::synchronous,
                                   reduce::per_tensor, storage::registry>(
            {.replicas = 3, .batches = batches, .micro_batches = 2}, {.lr = 1e-2});
        CHECK(first_divergence(acc).empty());
        CHECK(max_tensor_rel_error(acc.params[0].back(), ref.params[0].back(), ref.layout) <=
              1e-10);
    }
}

TEST_CASE("buckets launched from mark_ready give the same bits as buckets launched after backward",
          "[train][thread]") {
    const auto marked = train_run<float, sgd, sync::synchronous, small_buckets, storage::registry>(
        {.replicas = 3, .mark_ready = true}, sgd_p);
    const auto unmarked =
        train_run<float, sgd, sync::synchronous, small_buckets, storage::registry>(
            {.replicas = 3, .mark_ready = false}, sgd_p);
    for (std::size_t s = 0; s < marked.params[0].size(); ++s)
        CHECK(same_bits(marked.params[0][s], unmarked.params[0][s]));
    // 83 floats in buckets of >= 64 bytes in reverse order: {fc2.bias, fc2.weight (24)} = 108
    // bytes, {bn1.bias, bn1.weight} = 64 bytes, {fc1.weight (40)}: 3 all_reduces per step.
    CHECK(marked.collectives[0] == 3 * marked.params[0].size());
    const auto per_tensor =
        train_run<float, sgd, sync::synchronous, reduce::per_tensor, storage::registry>(
            {.replicas = 2}, sgd_p);
    CHECK(per_tensor.collectives[1] == 5 * per_tensor.params[0].size());
}

TEST_CASE("replicas declaring different parameters fail on every replica, naming both shapes",
          "[train][thread]") {
    using net = mlp<float, thread_communicator, storage::registry>;
    std::vector<std::string> messages(3);
    std::vector<int> codes(3, -1);
    thread_group(3).run([&](thread_communicator& comm) {
        mlp_shape sh;
        if (comm.rank() == 2)
            sh.in = 6; // fc1.weight {8, 6} instead of {8, 5}
        try {
            data_parallel<net, sgd> dp(
                comm, [&](auto& ctx) { return net(ctx, sh); }, sgd_p);
        } catch (const error& e) {
            messages[comm.rank()] = e.what();
            codes[comm.rank()] = static_cast<int>(e.code());
        }
    });
    for (int r = 0; r < 3; ++r) {
        INFO(messages[r]);
        CHECK(codes[r] == static_cast<int>(errc::shape_mismatch));
        CHECK_THAT(messages[r], Catch::Contains("replica " + std::to_string(r) + ":"));
        CHECK_THAT(messages[r], Catch::Contains("'fc1.weight' with shape {8, 5}"));
        CHECK_THAT(messages[r], Catch::Contains("replica 2 declares parameter 'fc1.weight' with "
                                                "shape {8, 6}"));
    }
}

TEST_CASE("a non-finite gradient on one replica skips the step on every replica",
          "[train][thread]") {
    SECTION("skip") {
        const auto run = train_run<float, sgd, sync::synchronous, small_buckets, storage::registry>(
            {.replicas = 3, .poison_rank = 1, .poison_step = 4}, sgd_p);
        CHECK(first_divergence(run).empty());
        for (int r = 0; r < 3; ++r) {
            CHECK(run.results[r][4].skipped);
            CHECK_FALSE(run.results[r][3].skipped);
            CHECK_FALSE(run.results[r][5].skipped);
        }
        CHECK(same_bits(run.params[0][4], run.params[0][3]));       // nothing applied
        CHECK_FALSE(same_bits(run.params[0][5], run.params[0][4])); // training went on
        for (float v : run.params[0].back())
            CHECK(std::isfinite(v));
    }
    SECTION("throw on every replica when skipping is off") {
        using net = mlp<float, thread_communicator, storage::registry>;
        std::vector<int> codes(3, -1);
        thread_group(3).run([&](thread_communicator& comm) {
            data_parallel<net, sgd> dp(comm, [](auto& ctx) { return net(ctx); }, sgd_p,
                                       {.skip_non_finite = false});
            dp.network().poison = comm.rank() == 0;
            try {
                dp.step(12,
                        [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
            } catch (const error& e) {
                codes[comm.rank()] = static_cast<int>(e.code());
            }
        });
        for (int c : codes)
            CHECK(c == static_cast<int>(errc::non_finite));
    }
}

TEST_CASE("local SGD: independent steps, weights averaged every K steps and at the end",
          "[train][thread][local_sgd]") {
    const std::vector<std::size_t> even = {24, 12, 36, 24, 12, 24, 36, 12}; // divisible by 3 and 4
    const optim::sgd_params plain{.lr = 0.1};
    SECTION("local_sgd<1> with plain SGD and equal shards is synchronous SGD") {
        // mean over replicas of (w - lr g_r) = w - lr mean_r g_r, and with equal shards the
        // mean of the per-replica mean gradients is the global mean gradient. bn::local keeps
        // the per-replica statistics in both runs.
        const auto local =
            train_run<float, sgd, sync::local_sgd<1>, reduce::per_tensor, storage::registry,
                      bn::local>({.replicas = 4, .batches = even}, plain);
        const auto sync_run =
            train_run<float, sgd, sync::synchronous, reduce::per_tensor, storage::registry,
                      bn::local>({.replicas = 4, .batches = even}, plain);
        CHECK(first_divergence(local).empty());
        for (std::size_t s = 0; s < even.size(); ++s) {
            INFO("step " << s);
            CHECK(max_tensor_rel_error(local.params[0][s], sync_run.params[0][s],
                                       sync_run.layout) <= 1e-5);
        }
    }
    SECTION("local_sgd<3>: replicas differ between averages and agree after them") {
        const auto run =
            train_run<float, sgd, sync::local_sgd<3>, small_buckets, storage::visitor, bn::local>(
                {.replicas = 3, .batches = even}, plain);
        for (std::size_t s = 0; s < even.size(); ++s) {
            INFO("step " << s);
            const bool averaged = (s + 1) % 3 == 0;
            CHECK(same_bits(run.params[1][s], run.params[0][s]) == averaged);
            CHECK(same_bits(run.params[2][s], run.params[0][s]) == averaged);
            // Running statistics are averaged with the weights.
            CHECK(same_bits(run.state[2][s], run.state[0][s]) == averaged);
        }
        // finish() averaged the 2 steps after the last average.
        CHECK(same_bits(run.params[1].back(), run.params[0].back()));
        CHECK(same_bits(run.params[2].back(), run.params[0].back()));
        CHECK_FALSE(same_bits(run.params[0].back(), run.params[0][even.size() - 1]));
        CHECK(run.params[0].size() == even.size() + 1);
    }
}

TEST_CASE("train_params: the lr schedule drives every step, decay picks the segments",
          "[train][thread]") {
    using net = user::linear<true>;
    std::vector<std::vector<double>> lrs(2), applied(2);
    std::vector<std::vector<tensor_segment>> segments(2);
    thread_group(2).run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<double>, sync::synchronous, reduce::per_tensor> dp(
            comm, [](auto& ctx) { return net(ctx.rank()); }, {.lr = 0.5, .weight_decay = 0.1},
            {.lr = [](std::int64_t s) { return 0.1 / double(s + 1); },
             .decay = [](const tensor_info& t) { return t.name != "b"; }});
        for (int s = 0; s < 4; ++s) {
            lrs[comm.rank()].push_back(
                dp.step(5, [](net& n, const shard_range& r, auto&) { return n.train(r); }).lr);
            applied[comm.rank()].push_back(dp.optimizer().lr());
        }
        segments[comm.rank()] = dp.optimizer().segments();
    });
    for (int r = 0; r < 2; ++r) {
        CHECK(lrs[r] == std::vector<double>{0.1, 0.05, 0.1 / 3, 0.025});
        CHECK(applied[r] == lrs[r]);
        REQUIRE(segments[r].size() == 2);
        CHECK(segments[r][0].offset == 0);
        CHECK(segments[r][0].size == 5);
        CHECK(segments[r][0].decay);
        CHECK(segments[r][1].offset == 5);
        CHECK_FALSE(segments[r][1].decay);
        CHECK_FALSE(segments[r][1].adapt);
    }
}

TEST_CASE("synchronous SGD equals a naive double loop over the concatenated global batch",
          "[train][thread]") {
    // Independent reference: w -= lr * (1/B) sum_i d/dw (y_i - t_i)^2 over the whole global batch
    // of each step, starting from replica 0's initial weights.
    const std::vector<std::size_t> batches = batch_schedule(12);
    const double lr = 0.05;
    std::vector<double> w(6); // w[0..4], b
    for (std::size_t k = 0; k < 5; ++k)
        w[k] = 0.1 * double(k);
    std::uint64_t offset = 0;
    for (std::size_t B : batches) {
        std::vector<double> g(6, 0.0);
        for (std::size_t i = 0; i < B; ++i) {
            const std::uint64_t s = offset + i;
            double y = w[5];
            for (std::size_t k = 0; k < 5; ++k)
                y += w[k] * feature(s, k);
            const double e = y - 0.5 * feature(s, 5);
            for (std::size_t k = 0; k < 5; ++k)
                g[k] += 2 * e * feature(s, k) / double(B);
            g[5] += 2 * e / double(B);
        }
        for (std::size_t k = 0; k < 6; ++k)
            w[k] -= lr * g[k];
        offset += B;
    }
    auto check = [&](auto reduce_tag) {
        using red = decltype(reduce_tag);
        using net = user::linear<true>;
        std::vector<std::vector<double>> out(3);
        thread_group(3).run([&](thread_communicator& comm) {
            data_parallel<net, optim::sgd<double>, sync::synchronous, red> dp(
                comm, [](auto& ctx) { return net(ctx.rank()); }, {.lr = lr});
            for (std::size_t B : batches)
                dp.step(B, [](net& n, const shard_range& r, auto&) { return n.train(r); });
            auto p = dp.parameters();
            out[comm.rank()].assign(p.begin(), p.end());
        });
        for (const auto& o : out)
            CHECK(rel_error(o, w) <= 1e-13);
    };
    check(reduce::per_tensor{});
    check(reduce::bucketed<8, 8>{});
    check(reduce::parameter_server<2>{});
}

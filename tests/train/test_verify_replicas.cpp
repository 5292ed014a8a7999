// train_params::verify_every on thread replicas: healthy runs of every reduce policy (and local
// SGD, bn::local) pass the check; one bit flipped on one replica in a parameter, an optimizer
// moment or a BN running statistic fails every replica at the next check, naming the step, the
// replica, the tensor, the element and every replica's bits there; bad settings are refused.
// SPDX-License-Identifier: Apache-2.0
#include "verify_cases.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/detail/replica_consistency.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

using namespace lockstep_test;

namespace {

template <class Sync, class Reduce, class BN = bn::global, class Opt = optim::adam<double>>
void healthy_run(int replicas, std::int64_t every) {
    using net = mlp<double, thread_communicator, storage::registry, BN>;
    std::vector<std::string> errors(static_cast<std::size_t>(replicas));
    thread_group group(replicas);
    group.run([&](thread_communicator& comm) {
        data_parallel<net, Opt, Sync, Reduce, thread_communicator> dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.01},
            {.seed = 3, .verify_every = every});
        try {
            for (std::size_t s = 0; s < 6; ++s)
                dp.step(24 + 12 * (s % 2),
                        [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
            dp.finish();
        } catch (const error& e) {
            errors[static_cast<std::size_t>(comm.rank())] = e.what();
        }
    });
    for (const auto& e : errors) {
        CAPTURE(e);
        CHECK(e.empty());
    }
}

} // namespace

TEST_CASE("verify_every passes healthy runs of every policy", "[train][thread][verify]") {
    const int n = GENERATE(1, 3);
    CAPTURE(n);
    healthy_run<sync::synchronous, reduce::per_tensor>(n, 1);
    healthy_run<sync::synchronous, reduce::bucketed<256>>(n, 1);
    healthy_run<sync::synchronous, reduce::compressed<bfloat16>>(n, 2);
    healthy_run<sync::synchronous, reduce::parameter_server<0>>(n, 1);
    healthy_run<sync::synchronous, reduce::sharded<256>>(n, 1);
    healthy_run<sync::synchronous, reduce::reproducible<4>, bn::ghost<4>>(n, 1);
    healthy_run<sync::local_sgd<2>, reduce::bucketed<>, bn::local>(n, 2);
    // bn::local keeps per-replica running statistics: they are not compared.
    healthy_run<sync::synchronous, reduce::bucketed<>, bn::local>(n, 1);
}

TEST_CASE("one flipped bit on one replica fails every replica at the next check, naming it",
          "[train][thread][verify]") {
    const auto target =
        GENERATE(flip_target::parameter, flip_target::optimizer_state, flip_target::running_stat);
    const int n = GENERATE(2, 3);
    CAPTURE(static_cast<int>(target), n);
    using net = mlp<double, thread_communicator, storage::registry, bn::global>;
    using trainer =
        data_parallel<net, optim::adam<double>, sync::synchronous, reduce::bucketed<256>>;
    const int odd = n - 1;
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    std::vector<int> codes(static_cast<std::size_t>(n), -1),
        steps_done(static_cast<std::size_t>(n));
    flip_site site;
    thread_group group(n);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        trainer dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.01},
                   {.frozen = [](const tensor_info& t) { return t.name == "fc1.weight"; },
                    .verify_every = 2});
        const auto fn = [](net& m, const shard_range& range, auto& ctx) {
            return m.train(range, ctx);
        };
        try {
            dp.step(12, fn);
            dp.step(12, fn); // checked: every replica agrees
            dp.step(12, fn);
            if (comm.rank() == odd)
                site = flip_one_bit(dp, target);
            dp.step(12, fn); // step 3 (the 4th): checked, replica `odd` differs
        } catch (const error& e) {
            errors[r] = e.what();
            codes[r] = static_cast<int>(e.code());
        }
        steps_done[r] = static_cast<int>(dp.steps());
    });
    const std::string want = expected_divergence(3, odd, n, site);
    for (int r = 0; r < n; ++r) {
        const auto& e = errors[static_cast<std::size_t>(r)];
        CAPTURE(r, e, want);
        CHECK(codes[static_cast<std::size_t>(r)] == static_cast<int>(errc::divergence));
        CHECK(steps_done[static_cast<std::size_t>(r)] == 4);
        CHECK(e.find("replica " + std::to_string(r) + ": data_parallel.verify_replicas") !=
              std::string::npos);
        CHECK(e.find(want) != std::string::npos);
        CHECK(e.find(" at element " + std::to_string(site.element) + ": ") != std::string::npos);
        for (int q = 0; q < n; ++q)
            CHECK(e.find("replica " + std::to_string(q) + " ") != std::string::npos);
        CHECK(e.find("(bits 0x") != std::string::npos);
    }
}

TEST_CASE("a flipped BN running statistic under bn::local is not compared",
          "[train][thread][verify]") {
    // bn::local keeps each replica's own running statistics: they differ by design.
    using net = mlp<double, thread_communicator, storage::registry, bn::local>;
    using trainer = data_parallel<net, optim::sgd<double>, sync::synchronous, reduce::bucketed<>>;
    std::vector<std::string> errors(2);
    thread_group group(2);
    group.run([&](thread_communicator& comm) {
        trainer dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.01}, {.verify_every = 1});
        const auto fn = [](net& m, const shard_range& range, auto& ctx) {
            return m.train(range, ctx);
        };
        try {
            dp.step(12, fn);
            if (comm.rank() == 1)
                flip_one_bit(dp, flip_target::running_stat);
            dp.step(12, fn);
        } catch (const error& e) {
            errors[static_cast<std::size_t>(comm.rank())] = e.what();
        }
    });
    CHECK(errors[0].empty());
    CHECK(errors[1].empty());
}

TEST_CASE("verify_every settings that cannot work are refused", "[train][thread][verify]") {
    using net = mlp<double, thread_communicator, storage::registry, bn::local>;
    std::vector<std::string> errors(4);
    thread_group group(2);
    group.run([&](thread_communicator& comm) {
        const auto make = [&](auto tag, std::int64_t every) {
            using trainer = typename decltype(tag)::type;
            trainer dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.01},
                       {.verify_every = every});
        };
        const auto record = [&](std::size_t i, auto&& f) {
            try {
                f();
            } catch (const error& e) {
                if (comm.rank() == 0)
                    errors[i] = e.what();
            }
        };
        using sync_dp =
            data_parallel<net, optim::sgd<double>, sync::synchronous, reduce::bucketed<>>;
        using local_dp =
            data_parallel<net, optim::sgd<double>, sync::local_sgd<4>, reduce::bucketed<>>;
        using async_dp =
            data_parallel<net, optim::sgd<double>, sync::asynchronous, reduce::per_tensor>;
        record(0, [&] { make(std::type_identity<sync_dp>{}, -1); });
        record(1, [&] { make(std::type_identity<local_dp>{}, 6); });
        record(2, [&] { make(std::type_identity<async_dp>{}, 10); });
        // Replicas that pass different values are refused by the construction-time agreement.
        record(3, [&] { make(std::type_identity<sync_dp>{}, comm.rank() == 0 ? 10 : 20); });
    });
    CHECK_THAT(errors[0], Catch::Contains("verify_every = -1 (must be >= 0"));
    CHECK_THAT(errors[1], Catch::Contains("verify_every = 6 is not a multiple of local SGD's "
                                          "period 4"));
    CHECK_THAT(errors[2], Catch::Contains("verify_every = 10: the asynchronous trainers"));
    CHECK_THAT(errors[3], Catch::Contains("verify_every: 10 on replica 0, 20 on replica 1"));
}

TEST_CASE("a difference past a large tensor's first block is located at its element",
          "[train][thread][verify]") {
    // The element search narrows to a block of 4096 elements, then to the element: a flip at
    // element 8197 (block 2) of the second tensor is named there, with each replica's bits.
    constexpr std::size_t large = 3 * 4096 + 10, at = 2 * 4096 + 5;
    std::vector<std::string> errors(3);
    std::vector<std::string> values(3);
    thread_group(3).run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        std::vector<float> small(10, 0.25f), big(large);
        for (std::size_t i = 0; i < large; ++i)
            big[i] = static_cast<float>(i) / 7.0f;
        if (me == 1)
            big[at] = std::bit_cast<float>(std::bit_cast<std::uint32_t>(big[at]) ^ 0x100u);
        values[me] = detail::describe_element(big[at]);
        const std::vector<detail::consistency_section<float>> sections{
            {"small", std::span<const float>(small)}, {"large", std::span<const float>(big)}};
        try {
            detail::verify_replicas(comm, host_system{1}, 4, sections);
        } catch (const error& e) {
            errors[me] = e.what();
        }
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO("replica " << r << ": " << errors[r]);
        CHECK(contains(errors[r], "after step 4 replica 1 holds other values than replicas 0, 2: "
                                  "first in tensor 'large' (2 of 2 compared tensors, 12298 "
                                  "elements) at element 8197: "));
        for (std::size_t v = 0; v < 3; ++v)
            CHECK(contains(errors[r], "replica " + std::to_string(v) + " " + values[v]));
    }
    CHECK(values[1] != values[0]);
}

namespace {

/// Three replicas of the mlp on storage S write fc2.weight[3] after the trainer is built: only
/// replica 1 (`alike` false) or every replica (true), or none (`write` false); then two steps.
/// Each replica's error, and replica 0's parameters after the steps.
template <storage S>
std::pair<std::vector<std::string>, std::vector<double>> written_after_construction(bool write,
                                                                                    bool alike) {
    using net = mlp<double, thread_communicator, S, bn::global>;
    std::vector<std::string> errors(3);
    std::vector<double> params;
    thread_group(3).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        data_parallel<net, optim::sgd<double>> dp(comm, [](auto& ctx) { return net(ctx); },
                                                  {.lr = 0.05}, {.seed = 3});
        if (write && (alike || r == 1))
            dp.network().output_weights()[3] = 0.75;
        try {
            for (int s = 0; s < 2; ++s)
                dp.step(12, [](net& m, const shard_range& range, auto& ctx) {
                    return m.train(range, ctx);
                });
        } catch (const error& e) {
            errors[r] = e.what();
        }
        if (r == 0)
            params.assign(dp.parameters().begin(), dp.parameters().end());
    });
    return {errors, params};
}

} // namespace

TEST_CASE("parameters written after construction on one replica skip the first step on every "
          "replica; written alike on every replica, they are what trains",
          "[train][thread][verify]") {
    for (const bool visitor : {false, true}) {
        CAPTURE(visitor);
        const auto [errors, params] =
            visitor ? written_after_construction<storage::visitor>(true, false)
                    : written_after_construction<storage::registry>(true, false);
        for (std::size_t r = 0; r < errors.size(); ++r) {
            CAPTURE(r, errors[r]);
            CHECK(contains(errors[r], "lockstep error [invalid_argument] replica " +
                                          std::to_string(r) +
                                          ": data_parallel.step: step 0 "
                                          "skipped"));
            CHECK(contains(errors[r], " parameters: replica 1's differ from replica 0's before the "
                                      "trainer's first step (digests "));
            CHECK(contains(errors[r], "): the trainer broadcast replica 0's at construction, so "
                                      "replica 1's network wrote them since; set initial values "
                                      "before the trainer is built (in the network's "
                                      "constructor), or alike on every replica;"));
            CHECK(!contains(errors[r], "replica 2's differ"));
        }
    }
    // Alike on every replica: the value written is the one trained, on the visitor path too (the
    // registry path writes the trainer's buffer itself).
    const auto registry = written_after_construction<storage::registry>(true, true);
    const auto visitor = written_after_construction<storage::visitor>(true, true);
    for (const auto& e : registry.first)
        CHECK(e.empty());
    for (const auto& e : visitor.first)
        CHECK(e.empty());
    CHECK(visitor.second == registry.second);
    CHECK(visitor.second != written_after_construction<storage::visitor>(false, true).second);
}

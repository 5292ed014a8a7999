// tests/nn/test_bn_misuse.cpp: the mistakes that used to change a batch-norm layer's meaning
// without a word are refused on every replica: the bare communicator inside a trainer's step,
// a layer whose policy the network did not declare in bn_policies, by name (with the
// compile-time check's sentence where the combination cannot train), and a second backward of
// one forward_train (one layer used by two branches).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/lockstep.hpp"
#include "support/contains.hpp"
#include "support/replica_errors.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

using namespace lockstep;
using lockstep_test::errors_of;
using lockstep_test::texts_of;

using lockstep_test::contains;

namespace {

using context = replica_context<float, thread_communicator>;
constexpr std::size_t channels = 3;

/// How the step function calls its layer: once, with the context or the communicator; or as a
/// layer shared by two branches, forward, forward, backward, backward (with the context).
enum class call { with_context, with_communicator, two_branches };

/// x -> batch norm -> loss sum(y * t) * scale. Policy: the layer's; Declared: the network's
/// bn_policies (std::tuple<> declares none, as a network without the alias does).
template <class Policy, class Declared>
struct bn_net {
    using bn_policies = Declared;
    using bn_type = nn::batch_norm<float, Policy, nn::nc>;
    tensor_handle<float> gamma, beta;
    std::unique_ptr<bn_type> bn;
    explicit bn_net(context& ctx)
        : gamma(ctx.registry().add("bn.gamma", {channels})),
          beta(ctx.registry().add("bn.beta", {channels})) {
        ctx.registry().finalize();
        bn = std::make_unique<bn_type>(ctx.comm(), channels,
                                       typename bn_type::parameter_spans{
                                           gamma.value(), beta.value(), gamma.grad(), beta.grad()});
    }
    template <class F>
    void for_each_state(F&& f) {
        f("bn.running_mean", bn->running_mean());
        f("bn.running_var", bn->running_var());
    }
    double train(const shard_range& r, context& ctx, call how) {
        const std::size_t n = r.size();
        std::vector<float> x(n * channels), y(x.size()), dy(x.size()), dx(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) // differs per sample, so per replica
            x[i] =
                static_cast<float>(std::sin(0.37 * double(r.sample_index(r.begin) * channels + i)));
        if (how != call::with_communicator)
            bn->forward_train(ctx, std::span<const float>(x), {n, channels}, std::span<float>(y));
        else
            bn->forward_train(ctx.comm(), std::span<const float>(x), {n, channels},
                              std::span<float>(y));
        for (std::size_t i = 0; i < y.size(); ++i)
            dy[i] = static_cast<float>(r.scale * std::cos(double(i)));
        if (how == call::two_branches) {
            std::vector<float> y2(x.size()), dx2(x.size());
            bn->forward_train(ctx, std::span<const float>(x), {n, channels}, std::span<float>(y2));
            bn->backward(ctx, std::span<const float>(dy), std::span<float>(dx2));
        }
        if (how != call::with_communicator)
            bn->backward(ctx, std::span<const float>(dy), std::span<float>(dx));
        else
            bn->backward(ctx.comm(), std::span<const float>(dy), std::span<float>(dx));
        return 0.0;
    }
};

/// Runs `steps` steps of bn_net<Policy, Declared> under ReducePolicy on `replicas` thread
/// replicas, `global` samples in `micro_batches` per step; returns each replica's error message
/// ("" when it trained).
template <class Policy, class Declared, class ReducePolicy>
std::vector<std::string> run(int replicas, call how, int steps = 2, std::size_t global = 16,
                             int micro_batches = 1) {
    using net = bn_net<Policy, Declared>;
    const auto errors = errors_of(replicas, [&](int, thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, ReducePolicy> trainer(
            comm, [](context& ctx) { return net(ctx); }, {.lr = 0.1},
            {.micro_batches = micro_batches});
        for (int s = 0; s < steps; ++s)
            trainer.step(global, [&](net& n, const shard_range& sr, context& ctx) {
                return n.train(sr, ctx, how);
            });
        trainer.finish();
    });
    for (const auto& [text, code] : errors)
        if (!text.empty())
            CHECK(code == static_cast<int>(errc::invalid_argument));
    return texts_of(errors);
}

} // namespace

TEST_CASE("the bare communicator inside a step is refused on every replica", "[nn][bn][thread]") {
    SECTION("bn::ghost with reduce::reproducible") {
        const int replicas = GENERATE(1, 2, 3);
        CAPTURE(replicas);
        const auto errors = run<bn::ghost<4>, std::tuple<bn::ghost<4>>, reduce::reproducible<4>>(
            replicas, call::with_communicator);
        REQUIRE(errors.size() == static_cast<std::size_t>(replicas));
        for (const std::string& e : errors) {
            CHECK(contains(e, "batch_norm.forward_train"));
            CHECK(contains(e, "called with a communicator inside a data_parallel step"));
            CHECK(contains(e, "bn.forward_train(ctx, x, shape, y)"));
            CHECK(contains(e, "bn::ghost<4>"));
        }
    }
    SECTION("bn::global with reduce::bucketed") {
        const int replicas = GENERATE(1, 2, 3);
        CAPTURE(replicas);
        const auto errors = run<bn::global, std::tuple<bn::global>, reduce::bucketed<>>(
            replicas, call::with_communicator);
        REQUIRE(errors.size() == static_cast<std::size_t>(replicas));
        for (const std::string& e : errors)
            CHECK(contains(e, "batch_norm.forward_train: called with a communicator"));
    }
    SECTION("the context form trains") {
        const auto errors =
            run<bn::global, std::tuple<bn::global>, reduce::bucketed<>>(2, call::with_context);
        for (const std::string& e : errors)
            CHECK(e.empty());
    }
}

TEST_CASE("outside a trainer the communicator form still trains a layer", "[nn][bn][thread]") {
    std::vector<float> mean(2);
    thread_group(2).run([&](thread_communicator& comm) {
        nn::batch_norm<float, bn::global, nn::nc> bn(comm, channels);
        std::vector<float> x(4 * channels), y(x.size());
        for (std::size_t i = 0; i < x.size(); ++i)
            x[i] = static_cast<float>(comm.rank() * 10 + static_cast<int>(i));
        bn.forward_train(comm, std::span<const float>(x), {4, channels}, std::span<float>(y));
        mean[static_cast<std::size_t>(comm.rank())] = bn.running_mean()[0];
    });
    // Channel 0 holds 0, 3, 6, 9 and 10, 13, 16, 19: global mean 9.5, running 0.95.
    CHECK(mean[0] == Approx(0.95).epsilon(1e-6));
    CHECK(mean[1] == mean[0]);
}

TEST_CASE("a BN policy missing from bn_policies is refused at its first call", "[nn][bn][thread]") {
    SECTION("bn::global under reduce::reproducible: the compile-time sentence") {
        const auto errors =
            run<bn::global, std::tuple<>, reduce::reproducible<4>>(2, call::with_context);
        for (const std::string& e : errors) {
            CHECK(contains(e, "batch_norm.forward_train: a layer of policy bn::global is not in "
                              "the network's bn_policies (none)"));
            CHECK(contains(e, LOCKSTEP_COMPAT_REPRODUCIBLE_NEEDS_GHOST));
        }
    }
    SECTION("bn::ghost under reduce::bucketed: the compile-time sentence") {
        const auto errors =
            run<bn::ghost<4>, std::tuple<>, reduce::bucketed<>>(3, call::with_context);
        for (const std::string& e : errors)
            CHECK(contains(e, LOCKSTEP_COMPAT_GHOST_NEEDS_REPRODUCIBLE));
    }
    SECTION("bn::ghost<8> declared as bn::ghost<4>") {
        const auto errors = run<bn::ghost<8>, std::tuple<bn::ghost<4>>, reduce::reproducible<4>>(
            2, call::with_context);
        for (const std::string& e : errors) {
            CHECK(contains(e, "a layer of policy bn::ghost<8> is not in the network's "
                              "bn_policies (bn::ghost<4>)"));
            CHECK(contains(e, LOCKSTEP_COMPAT_GHOST_CHUNK));
        }
    }
    SECTION("a combination that could train is refused too, without a rule") {
        const auto errors =
            run<bn::global, std::tuple<>, reduce::bucketed<>>(2, call::with_context);
        for (const std::string& e : errors) {
            CHECK(contains(e, "a layer of policy bn::global is not in the network's bn_policies"));
            CHECK_FALSE(contains(e, "cannot train here"));
        }
    }
    // Policies that act alike are still told apart: under a bn::global declaration a bn::group
    // layer's running statistics would be compared by verify_every as if shared, and recorded
    // in checkpoints under the wrong name.
    SECTION("bn::group<2> declared as bn::global") {
        const auto errors =
            run<bn::group<2>, std::tuple<bn::global>, reduce::bucketed<>>(2, call::with_context);
        for (const std::string& e : errors) {
            CHECK(contains(e, "batch_norm.forward_train: a layer of policy bn::group<2> is not in "
                              "the network's bn_policies (bn::global)"));
            CHECK_FALSE(contains(e, "cannot train here"));
        }
    }
    SECTION("bn::tower<1> declared as bn::tower<0>, bn::local") {
        const auto errors =
            run<bn::tower<1>, std::tuple<bn::tower<0>, bn::local>, reduce::bucketed<>>(
                2, call::with_context);
        for (const std::string& e : errors)
            CHECK(contains(e, "a layer of policy bn::tower<1> is not in the network's "
                              "bn_policies (bn::tower<0>, bn::local)"));
    }
    SECTION("a declared policy trains") {
        const auto errors = run<bn::ghost<4>, std::tuple<bn::ghost<4>>, reduce::reproducible<4>>(
            3, call::with_context);
        for (const std::string& e : errors)
            CHECK(e.empty());
    }
}

TEST_CASE("a bn::ghost chunk of one sample is refused, naming the chunk and the fix",
          "[nn][bn][thread]") {
    // 17 = 4 x 4 + 1: the last chunk holds one sample, whose batch statistics do not exist.
    const auto errors = run<bn::ghost<4>, std::tuple<bn::ghost<4>>, reduce::reproducible<4>>(
        1, call::with_context, 1, 17);
    INFO(errors[0]);
    CHECK(contains(errors[0], "expected more than 1 value per channel when training, got input "
                              "(1, 3) (a chunk of bn::ghost<4>: a global batch of k x 4 + 1 "
                              "leaves one sample in its last chunk; choose the global batch or "
                              "ChunkSamples so that none does)"));
}

TEST_CASE("one value per channel in a trainer names the batch split and the fix",
          "[nn][bn][thread]") {
    SECTION("bn::global: a micro-batch of 1 sample (global batch 3 in 2 micro-batches)") {
        const auto errors = run<bn::global, std::tuple<bn::global>, reduce::bucketed<>>(
            2, call::with_context, 1, 3, 2);
        for (const std::string& e : errors) {
            INFO(e);
            CHECK(contains(e, "step 0 skipped: batch_norm layer 0 (in forward order): expected "
                              "more than 1 value per channel when training, got 1 over the "
                              "replicas sharing statistics (global batch 3 in 2 micro-batches "
                              "over 2 replica(s)): raise global_batch or lower micro_batches "
                              "(bn::group: or the replica count)"));
        }
    }
    SECTION("bn::running_only: one replica's part of 1 sample") {
        const auto errors = run<bn::running_only, std::tuple<bn::running_only>, reduce::bucketed<>>(
            2, call::with_context, 1, 3);
        for (const std::string& e : errors) {
            INFO(e);
            CHECK(contains(e, "expected more than 1 value per channel when training, got 1 on "
                              "replica 1 (global batch 3 over 2 replica(s)): raise global_batch, "
                              "lower micro_batches or the replica count, or use a BN policy that "
                              "shares statistics"));
        }
    }
    SECTION("bn::local: 1 sample per replica") {
        const auto errors =
            run<bn::local, std::tuple<bn::local>, reduce::bucketed<>>(2, call::with_context, 1, 2);
        for (std::size_t r = 0; r < errors.size(); ++r) {
            INFO(errors[r]);
            CHECK(contains(errors[r], "replica " + std::to_string(r) +
                                          ": batch_norm.forward_train: expected more than 1 value "
                                          "per channel when training, got input (1, 3), 1 value "
                                          "per channel (bn::local normalizes each replica's "
                                          "values alone: in a trainer, raise global_batch, lower "
                                          "micro_batches or the replica count (2), or use a BN "
                                          "policy that shares statistics)"));
        }
    }
}

// The layer refuses bn::tower<K> beyond the replicas at its first forward; the trainer refuses
// it at construction, before the network is built or any data is loaded.
TEST_CASE("bn::tower<K> beyond the replicas is refused when the trainer is built",
          "[nn][bn][thread]") {
    const auto errors = run<bn::tower<3>, std::tuple<bn::local, bn::tower<3>>, reduce::bucketed<>>(
        3, call::with_context, 0);
    for (std::size_t r = 0; r < errors.size(); ++r)
        CHECK(
            contains(errors[r], "replica " + std::to_string(r) +
                                    ": data_parallel: bn::tower<3> (in the network's "
                                    "bn_policies) takes replica 3's batch statistics, but the "
                                    "communicator has 3 replica(s): use bn::tower<K> with K < 3"));
    const auto fits =
        run<bn::tower<2>, std::tuple<bn::tower<2>>, reduce::bucketed<>>(3, call::with_context);
    for (const std::string& e : fits)
        CHECK(e.empty());
}

TEST_CASE("bn_rule_broken gives the compile-time check's sentences", "[nn][bn][policy]") {
    const auto facts = [](auto sync, auto reduce) {
        return trainer_facts_of<decltype(sync), decltype(reduce)>();
    };
    const trainer_policy_facts bucketed = facts(sync::synchronous{}, reduce::bucketed<>{});
    const trainer_policy_facts repro4 = facts(sync::synchronous{}, reduce::reproducible<4>{});
    const trainer_policy_facts local = facts(sync::local_sgd<2>{}, reduce::bucketed<>{});
    const trainer_policy_facts async = facts(sync::asynchronous{}, reduce::bucketed<>{});
    CHECK(bn_rule_broken(bucketed, bn_facts_of<bn::global>()) == nullptr);
    CHECK(bn_rule_broken(bucketed, bn_facts_of<bn::group<2>>()) == nullptr);
    CHECK(bn_rule_broken(repro4, bn_facts_of<bn::ghost<4>>()) == nullptr);
    CHECK(bn_rule_broken(local, bn_facts_of<bn::running_only>()) == nullptr);
    CHECK(bn_rule_broken(async, bn_facts_of<bn::local>()) == nullptr);
    CHECK(std::string(bn_rule_broken(local, bn_facts_of<bn::global>())) ==
          LOCKSTEP_COMPAT_BN_NEEDS_SYNCHRONOUS);
    CHECK(std::string(bn_rule_broken(async, bn_facts_of<bn::tower<0>>())) ==
          LOCKSTEP_COMPAT_BN_ASYNC_COLLECTIVE);
    CHECK(std::string(bn_rule_broken(repro4, bn_facts_of<bn::local>())) ==
          LOCKSTEP_COMPAT_REPRODUCIBLE_NEEDS_GHOST);
    CHECK(std::string(bn_rule_broken(bucketed, bn_facts_of<bn::ghost<4>>())) ==
          LOCKSTEP_COMPAT_GHOST_NEEDS_REPRODUCIBLE);
    CHECK(std::string(bn_rule_broken(repro4, bn_facts_of<bn::ghost<2>>())) ==
          LOCKSTEP_COMPAT_GHOST_CHUNK);
}

TEST_CASE("asynchronous workers refuse an undeclared policy too", "[nn][bn][thread][async]") {
    // bn::global in a network that declares no BN policy, trained by the parameter server: the
    // compile-time check saw none, so the workers' first call refuses it with that check's
    // sentence, and the server learns of it instead of pairing collectives of different steps.
    using net = bn_net<bn::global, std::tuple<>>;
    std::vector<std::string> errors(3);
    try {
        thread_group(3).run([&](thread_communicator& comm) {
            try {
                data_parallel<net, optim::sgd<float>, sync::asynchronous> trainer(
                    comm, [](context& ctx) { return net(ctx); }, {.lr = 0.1});
                (void)trainer.train(4, 8, [](net& n, const shard_range& r, context& ctx) {
                    return n.train(r, ctx, call::with_context);
                });
            } catch (const error& e) {
                errors[static_cast<std::size_t>(comm.rank())] = e.what();
                throw;
            }
        });
    } catch (const error&) {
    }
    CHECK_FALSE(errors[0].empty()); // the server
    for (const int worker : {1, 2}) {
        const std::string& e = errors[static_cast<std::size_t>(worker)];
        INFO(e);
        if (e.find("peer_failure") != std::string::npos)
            continue; // the other worker failed first and the server stopped this one
        CHECK(contains(e, "a layer of policy bn::global is not in the network's bn_policies"));
        CHECK(contains(e, LOCKSTEP_COMPAT_BN_NEEDS_SYNCHRONOUS));
    }
    CHECK((contains(errors[1], LOCKSTEP_COMPAT_BN_NEEDS_SYNCHRONOUS) ||
           contains(errors[2], LOCKSTEP_COMPAT_BN_NEEDS_SYNCHRONOUS)));
}

TEST_CASE("a second backward of one forward_train is refused: one layer object per use",
          "[nn][bn][thread]") {
    const std::string fix = "was taken by a backward already: one layer object per use (a shared "
                            "branch needs its own layer or its own forward before each backward)";
    SECTION("inside a step, a layer shared by two branches") {
        const auto global =
            run<bn::global, std::tuple<bn::global>, reduce::bucketed<>>(2, call::two_branches);
        const auto local =
            run<bn::local, std::tuple<bn::local>, reduce::bucketed<>>(2, call::two_branches);
        for (std::size_t r = 0; r < 2; ++r) {
            const std::string backward =
                "replica " + std::to_string(r) +
                ": batch_norm.backward: backward needs a forward_train of its own, the layer's "
                "last one (batch_norm layer 1 in forward order, ";
            INFO(global[r] << "\n" << local[r]);
            CHECK(contains(global[r],
                           std::string(backward).append("bn::global, 3 channels) ").append(fix)));
            CHECK(contains(local[r],
                           std::string(backward).append("bn::local, 3 channels) ").append(fix)));
        }
    }
    SECTION("outside a trainer: refused, and a forward before each backward trains") {
        // forward(x1), forward(x2), backward(dy2), backward(dy1): the second backward would pair
        // dy1 with x2's statistics. Then forward(x1), backward(dy1) gives dx1 as a fresh layer.
        std::vector<std::string> refused(2);
        std::vector<std::vector<float>> dx1(2), reference(2);
        thread_group(2).run([&](thread_communicator& comm) {
            const auto me = static_cast<std::size_t>(comm.rank());
            nn::batch_norm<float, bn::global, nn::nc> shared(comm, channels), fresh(comm, channels);
            std::vector<float> x1(4 * channels), x2(x1.size()), dy1(x1.size()), dy2(x1.size());
            for (std::size_t i = 0; i < x1.size(); ++i) {
                x1[i] = static_cast<float>(std::sin(0.3 * double(i + 12 * me)));
                x2[i] = static_cast<float>(std::cos(0.7 * double(i + 12 * me)));
                dy1[i] = static_cast<float>(std::cos(0.5 * double(i)));
                dy2[i] = static_cast<float>(std::sin(1.1 * double(i)));
            }
            std::vector<float> y1(x1.size()), y2(x1.size()), dx2(x1.size()), dx(x1.size()),
                dxr(x1.size());
            shared.forward_train(comm, std::span<const float>(x1), {4, channels},
                                 std::span<float>(y1));
            shared.forward_train(comm, std::span<const float>(x2), {4, channels},
                                 std::span<float>(y2));
            shared.backward(comm, std::span<const float>(dy2), std::span<float>(dx2));
            try {
                shared.backward(comm, std::span<const float>(dy1), std::span<float>(dx));
            } catch (const error& e) {
                refused[me] = e.what();
            }
            shared.forward_train(comm, std::span<const float>(x1), {4, channels},
                                 std::span<float>(y1));
            shared.backward(comm, std::span<const float>(dy1), std::span<float>(dx));
            fresh.forward_train(comm, std::span<const float>(x1), {4, channels},
                                std::span<float>(y1));
            fresh.backward(comm, std::span<const float>(dy1), std::span<float>(dxr));
            dx1[me] = dx;
            reference[me] = dxr;
        });
        for (std::size_t r = 0; r < 2; ++r) {
            INFO(refused[r]);
            CHECK(contains(refused[r], "lockstep error [invalid_argument] replica " +
                                           std::to_string(r) +
                                           ": batch_norm.backward: backward needs a forward_train "
                                           "of its own, the layer's last one (bn::global, 3 "
                                           "channels) " +
                                           fix));
            CHECK(dx1[r] == reference[r]);
        }
    }
}

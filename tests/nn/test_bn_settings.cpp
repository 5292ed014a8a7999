// tests/nn/test_bn_settings.cpp: the replicas that share a batch-norm layer's statistics must
// have built their layers alike (eps, momentum, affine, channels, policy): a difference is
// refused at the layer's first training call on every replica, naming the layer, the setting,
// the values and the fix; the same settings train, and the check runs once per layer.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/lockstep.hpp"
#include "support/contains.hpp"
#include "support/replica_errors.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

using namespace lockstep;
using lockstep_test::errors_of;
using lockstep_test::texts_of;

using lockstep_test::contains;

namespace {

constexpr std::size_t channels = 3;

/// Each replica's forward_train input of `n` samples of `c` channels (differs per replica).
std::vector<float> input(int rank, std::size_t n, std::size_t c) {
    std::vector<float> x(n * c);
    for (std::size_t i = 0; i < x.size(); ++i)
        x[i] = static_cast<float>(std::sin(0.37 * double(rank * 100 + static_cast<int>(i))));
    return x;
}

/// Builds replica r's layer with params_of(r) and `channels_of(r)` channels on `replicas` thread
/// replicas and calls forward_train twice outside a trainer; returns each replica's error message
/// ("" when it trained) and checks that every error is invalid_argument.
template <class Policy>
std::vector<std::string> run_layers(
    int replicas, const std::function<nn::batch_norm_params(int)>& params_of,
    const std::function<std::size_t(int)>& channels_of = [](int) { return channels; }) {
    const auto errors = errors_of(replicas, [&](int rank, thread_communicator& comm) {
        const std::size_t c = channels_of(rank);
        nn::batch_norm<float, Policy, nn::nc> bn(comm, c, params_of(rank));
        const std::vector<float> x = input(rank, 4, c);
        std::vector<float> y(x.size());
        for (int call = 0; call < 2; ++call)
            bn.forward_train(comm, std::span<const float>(x), {4, c}, std::span<float>(y));
    });
    for (const auto& [text, code] : errors)
        if (!text.empty())
            CHECK(code == static_cast<int>(errc::invalid_argument));
    return texts_of(errors);
}

nn::batch_norm_params with_eps(double eps) {
    nn::batch_norm_params p;
    p.eps = eps;
    return p;
}

nn::batch_norm_params with_momentum(double m) {
    nn::batch_norm_params p;
    p.momentum = m;
    return p;
}

} // namespace

TEMPLATE_TEST_CASE("layers built with other settings than their peers' are refused on every "
                   "replica",
                   "[nn][bn][thread]", bn::global, bn::running_only, bn::tower<0>, bn::group<3>) {
    const std::string layer = std::string("(") + bn::traits<TestType>::name() + ", 3 channels)";
    SECTION("eps differs on replica 1 of 2") {
        const auto errors =
            run_layers<TestType>(2, [](int r) { return with_eps(r == 1 ? 1e-2 : 1e-5); });
        REQUIRE(errors.size() == 2);
        for (std::size_t r = 0; r < errors.size(); ++r) {
            const std::string& e = errors[r];
            CAPTURE(e);
            CHECK(contains(e, "replica " + std::to_string(r) + ": batch_norm.forward_train"));
            CHECK(contains(e, "the 2 replicas that train this layer " + layer));
            CHECK(contains(e, std::string("eps: ") + (r == 1 ? "0.01" : "1e-05") +
                                  " here, from 1e-05 to 0.01 over the replicas"));
            CHECK_FALSE(contains(e, "momentum:"));
            CHECK(contains(e, "construct every replica's layer with the same batch_norm_params"));
        }
    }
    SECTION("momentum differs on replica 2 of 3") {
        const auto errors =
            run_layers<TestType>(3, [](int r) { return with_momentum(r == 2 ? 0.9 : 0.1); });
        REQUIRE(errors.size() == 3);
        for (std::size_t r = 0; r < errors.size(); ++r) {
            const std::string& e = errors[r];
            CAPTURE(e);
            CHECK(contains(e, "replica " + std::to_string(r) + ": batch_norm.forward_train"));
            CHECK(contains(e, "the 3 replicas that train this layer " + layer));
            CHECK(contains(e, std::string("momentum: ") + (r == 2 ? "0.9" : "0.1") +
                                  " here, from 0.1 to 0.9 over the replicas"));
            CHECK_FALSE(contains(e, "eps:"));
            CHECK(contains(e, "same batch_norm_params"));
        }
    }
    SECTION("eps 1e-5 against the nearest other double") {
        const auto errors = run_layers<TestType>(
            2, [](int r) { return with_eps(r == 0 ? 1e-5 : std::nextafter(1e-5, 1.0)); });
        for (const std::string& e : errors)
            CHECK(contains(e, "eps: "));
    }
    SECTION("affine and channels differ") {
        const auto errors = run_layers<TestType>(
            2,
            [](int r) {
                nn::batch_norm_params p;
                p.affine = r == 0;
                return p;
            },
            [](int r) { return r == 0 ? channels : channels + 1; });
        for (const std::string& e : errors) {
            CAPTURE(e);
            CHECK(contains(e, "affine: "));
            CHECK(contains(e, "from false to true over the replicas"));
            CHECK(contains(e, "channels: "));
            CHECK(contains(e, "from 3 to 4 over the replicas"));
        }
    }
    SECTION("the same settings train") {
        const auto errors = run_layers<TestType>(3, [](int) {
            nn::batch_norm_params p;
            p.eps = 1e-3;
            p.momentum = 0.25;
            return p;
        });
        for (const std::string& e : errors)
            CHECK(e.empty());
    }
}

TEST_CASE("bn::group: a difference in one group fails every group", "[nn][bn][thread]") {
    // Checked within each group, the other group trained on and then waited for the refusing
    // one in the next collective of the step (under MPI: until the timeout).
    const auto errors =
        run_layers<bn::group<2>>(4, [](int r) { return with_eps(r == 3 ? 1e-3 : 1e-5); });
    REQUIRE(errors.size() == 4);
    for (std::size_t r = 0; r < errors.size(); ++r) {
        CAPTURE(r, errors[r]);
        CHECK(contains(errors[r], "the 4 replicas that train this layer (bn::group<2>, 3 "
                                  "channels) built it with different settings (eps: "));
    }
}

TEST_CASE("layers of different policies at one position are refused", "[nn][bn][thread]") {
    std::vector<std::string> errors(2);
    try {
        thread_group(2).run([&](thread_communicator& comm) {
            try {
                const std::vector<float> x = input(comm.rank(), 4, channels);
                std::vector<float> y(x.size());
                if (comm.rank() == 0) {
                    nn::batch_norm<float, bn::global, nn::nc> bn(comm, channels);
                    bn.forward_train(comm, std::span<const float>(x), {4, channels},
                                     std::span<float>(y));
                } else {
                    nn::batch_norm<float, bn::running_only, nn::nc> bn(comm, channels);
                    bn.forward_train(comm, std::span<const float>(x), {4, channels},
                                     std::span<float>(y));
                }
            } catch (const error& e) {
                errors[static_cast<std::size_t>(comm.rank())] = e.what();
                throw;
            }
        });
    } catch (const error&) {
    }
    CHECK(contains(errors[0], "BN policy: bn::global here, another on a replica"));
    CHECK(contains(errors[1], "BN policy: bn::running_only here, another on a replica"));
}

TEST_CASE("bn::local layers share nothing and keep their own settings", "[nn][bn][thread]") {
    const auto errors =
        run_layers<bn::local>(2, [](int r) { return with_eps(r == 1 ? 1e-2 : 1e-5); });
    for (const std::string& e : errors)
        CHECK(e.empty());
}

TEST_CASE("the settings check is one host wait at the layer's first training call",
          "[nn][bn][thread]") {
    std::vector<std::uint64_t> first(2), second(2);
    thread_group(2).run([&](thread_communicator& comm) {
        nn::batch_norm<float, bn::global, nn::nc> bn(comm, channels);
        const std::vector<float> x = input(comm.rank(), 4, channels);
        std::vector<float> y(x.size());
        const auto r = static_cast<std::size_t>(comm.rank());
        std::uint64_t before = host_sync_count();
        bn.forward_train(comm, std::span<const float>(x), {4, channels}, std::span<float>(y));
        first[r] = host_sync_count() - before;
        before = host_sync_count();
        bn.forward_train(comm, std::span<const float>(x), {4, channels}, std::span<float>(y));
        second[r] = host_sync_count() - before;
    });
    for (std::size_t r = 0; r < 2; ++r) {
        CHECK(first[r] == second[r] + 1);
    }
}

namespace {

using context = replica_context<float, thread_communicator>;

template <class Policy>
struct bn_net {
    using bn_policies = std::tuple<Policy>;
    using bn_type = nn::batch_norm<float, Policy, nn::nc>;
    tensor_handle<float> gamma, beta;
    std::unique_ptr<bn_type> bn;
    bn_net(context& ctx, nn::batch_norm_params p)
        : gamma(ctx.registry().add("bn.gamma", {channels})),
          beta(ctx.registry().add("bn.beta", {channels})) {
        ctx.registry().finalize();
        bn = std::make_unique<bn_type>(ctx.comm(), channels,
                                       typename bn_type::parameter_spans{
                                           gamma.value(), beta.value(), gamma.grad(), beta.grad()},
                                       p);
    }
    double train(const shard_range& r, context& ctx) {
        const std::size_t n = r.size();
        std::vector<float> x(n * channels), y(x.size()), dy(x.size()), dx(x.size());
        for (std::size_t i = 0; i < x.size(); ++i)
            x[i] =
                static_cast<float>(std::sin(0.37 * double(r.sample_index(r.begin) * channels + i)));
        bn->forward_train(ctx, std::span<const float>(x), {n, channels}, std::span<float>(y));
        for (std::size_t i = 0; i < y.size(); ++i)
            dy[i] = static_cast<float>(r.scale * std::cos(double(i)));
        bn->backward(ctx, std::span<const float>(dy), std::span<float>(dx));
        return 0.0;
    }
};

/// Two steps of bn_net<Policy> under ReducePolicy on `replicas` thread replicas, replica r's
/// layer built with params_of(r); each replica's error message ("" when it trained).
template <class Policy, class ReducePolicy>
std::vector<std::string> run_trainer(int replicas,
                                     const std::function<nn::batch_norm_params(int)>& params_of) {
    using net = bn_net<Policy>;
    return texts_of(errors_of(replicas, [&](int rank, thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, ReducePolicy> trainer(
            comm, [&](context& ctx) { return net(ctx, params_of(rank)); }, {.lr = 0.1});
        for (int s = 0; s < 2; ++s)
            trainer.step(
                16, [&](net& n, const shard_range& sr, context& ctx) { return n.train(sr, ctx); });
        trainer.finish();
    }));
}

} // namespace

TEST_CASE("inside a trainer's step the settings check refuses on every replica",
          "[nn][bn][thread]") {
    SECTION("bn::global, eps differs") {
        const auto errors = run_trainer<bn::global, reduce::bucketed<>>(
            2, [](int r) { return with_eps(r == 1 ? 1e-2 : 1e-5); });
        for (const std::string& e : errors) {
            CAPTURE(e);
            CHECK(contains(e, "(batch_norm layer 0 in forward order, bn::global, 3 channels) "
                              "built it with different settings (eps: "));
            CHECK(contains(e, "same batch_norm_params"));
        }
    }
    SECTION("bn::ghost<4> in a reproducible step, momentum differs") {
        const auto errors = run_trainer<bn::ghost<4>, reduce::reproducible<4>>(
            3, [](int r) { return with_momentum(r == 0 ? 0.5 : 0.1); });
        for (const std::string& e : errors) {
            CAPTURE(e);
            CHECK(contains(e, "(batch_norm layer 0 in forward order, bn::ghost<4>, 3 channels) "
                              "built it with different settings (momentum: "));
            CHECK(contains(e, "from 0.1 to 0.5 over the replicas"));
        }
    }
    SECTION("the same settings train") {
        const auto same = [](int) { return with_momentum(0.2); };
        for (const std::string& e : run_trainer<bn::global, reduce::bucketed<>>(3, same))
            CHECK(e.empty());
        for (const std::string& e : run_trainer<bn::ghost<4>, reduce::reproducible<4>>(3, same))
            CHECK(e.empty());
    }
}

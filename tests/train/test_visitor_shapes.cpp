// The visitor path keeps the shapes a network passes (f(name, values, grads, shape)), so decay
// and frozen predicates over tensor_info::shape work as on the registry path.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace lockstep;

namespace {

using ctx_type = replica_context<double, thread_communicator>;

/// w: 2 x 3 (passed with its shape), b: 2 (passed without one), v: 4 (a wrong shape when asked).
struct visitor_net {
    explicit visitor_net(ctx_type&, bool bad_shape = false) : bad(bad_shape) {}
    std::vector<double> w = std::vector<double>(6, 1.0), gw = std::vector<double>(6, 0.0);
    std::vector<double> b = std::vector<double>(2, 1.0), gb = std::vector<double>(2, 0.0);
    bool bad = false;
    template <class F>
    void for_each_parameter(F&& f) {
        f("w", std::span<double>(w), std::span<double>(gw),
          bad ? std::vector<std::size_t>{4, 2} : std::vector<std::size_t>{2, 3});
        f("b", std::span<double>(b), std::span<double>(gb));
    }
};

} // namespace

TEST_CASE("visitor tensors keep the shapes the network passes", "[train][visitor]") {
    thread_group group(2, {.timeout = std::chrono::seconds(30)});
    std::vector<std::vector<std::size_t>> shapes;
    std::vector<double> w_after, b_after;
    group.run([&](thread_communicator& comm) {
        // Weight decay on matrices only: w decays, b does not.
        data_parallel<visitor_net, optim::sgd<double>, sync::synchronous, reduce::bucketed<>> dp(
            comm, [](ctx_type& ctx) { return visitor_net(ctx); }, {.lr = 0.5, .weight_decay = 0.1},
            {.decay = [](const tensor_info& t) { return t.shape.size() > 1; }});
        dp.step(4, [](visitor_net&, const shard_range&, ctx_type&) { return 0.0; });
        if (comm.rank() == 0) {
            for (const auto& t : dp.registry().parameters())
                shapes.push_back(t.shape);
            w_after = dp.network().w;
            b_after = dp.network().b;
        }
    });
    REQUIRE(shapes.size() == 2);
    CHECK(shapes[0] == std::vector<std::size_t>{2, 3});
    CHECK(shapes[1] == std::vector<std::size_t>{2});
    // Zero gradients: w moves by lr * weight_decay * w = 0.05, b not at all.
    for (double v : w_after)
        CHECK(v == Approx(0.95).epsilon(1e-12));
    for (double v : b_after)
        CHECK(v == 1.0);
}

TEST_CASE("a visitor shape that does not hold the tensor's values is refused", "[train][visitor]") {
    thread_group group(1, {.timeout = std::chrono::seconds(30)});
    try {
        group.run([&](thread_communicator& comm) {
            data_parallel<visitor_net, optim::sgd<double>, sync::synchronous, reduce::bucketed<>>
                dp(comm, [](ctx_type& ctx) { return visitor_net(ctx, true); }, {.lr = 0.1});
        });
        FAIL("a wrong shape was accepted");
    } catch (const error& e) {
        CHECK(e.code() == errc::shape_mismatch);
        CHECK_THAT(e.what(), Catch::Contains("'w'") && Catch::Contains("{4, 2}") &&
                                 Catch::Contains("6 values"));
    }
}

// The visitor path keeps the shapes a network passes (f(name, values, grads, shape)), so decay
// and frozen predicates over tensor_info::shape work as on the registry path; visited spans that
// overlap are refused at construction (a tied tensor visited twice is not); a visitor that later
// visits other tensors than it declared fails on its replica and nowhere hangs.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "support/replica_errors.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <string>
#include <utility>
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

namespace {

/// How a visitor_change network's visitors differ from what they declared at construction.
enum class visit_change { none, fewer, swap, grow, fewer_state, rename_state };

/// w: 4, v: 4, b: 1 and state s: 3, t: 2; y = (w + v) . x + b, squared error against x0 - 2 x1.
/// From `change` on, the visitors deviate as `change` says.
struct visitor_change {
    std::vector<double> w = std::vector<double>(4), gw = std::vector<double>(4);
    std::vector<double> v = std::vector<double>(4, 0.2), gv = std::vector<double>(4);
    std::vector<double> b = std::vector<double>(1), gb = std::vector<double>(1);
    std::vector<double> s = std::vector<double>(3), t = std::vector<double>(2);
    visit_change change = visit_change::none;
    explicit visitor_change(int rank) {
        for (std::size_t k = 0; k < 4; ++k)
            w[k] = 0.1 * double(k + 1 + rank); // differs per replica until the broadcast
    }
    template <class F>
    void for_each_parameter(F&& f) {
        f("w", std::span<double>(w), std::span<double>(gw));
        if (change == visit_change::fewer)
            return;
        if (change == visit_change::swap) {
            f("b", std::span<double>(b), std::span<double>(gb));
            f("v", std::span<double>(v), std::span<double>(gv));
            return;
        }
        f("v", std::span<double>(v), std::span<double>(gv));
        f("b", std::span<double>(b), std::span<double>(gb));
    }
    template <class F>
    void for_each_state(F&& f) {
        f("s", std::span<double>(s));
        if (change != visit_change::fewer_state)
            f(change == visit_change::rename_state ? "u" : "t", std::span<double>(t));
    }
    double train(const shard_range& r) {
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const double g = double(r.sample_index(i));
            const double x[4] = {g / 7 - 1, 1 - g / 5, g / 11, 0.5};
            double y = b[0];
            for (std::size_t k = 0; k < 4; ++k)
                y += (w[k] + v[k]) * x[k];
            const double e = y - (x[0] - 2 * x[1]);
            loss += e * e * r.scale;
            gb[0] += 2 * e * r.scale;
            for (std::size_t k = 0; k < 4; ++k) {
                gw[k] += 2 * e * r.scale * x[k];
                gv[k] += 2 * e * r.scale * x[k];
            }
        }
        return loss;
    }
};

/// What each replica of a 3-replica run threw (text, code; -1: nothing) when replica 1's
/// network switches to `change` before step 2 of 4; `grow` also resizes its w to 5. Local SGD
/// (K = 2) averages, and so packs the visited state, after steps 1 and 3.
template <class SyncPolicy>
std::vector<std::pair<std::string, int>> run_changed(visit_change change, bool grow) {
    std::vector<std::pair<std::string, int>> out(3, {std::string(), -1});
    thread_group group(3, {.timeout = std::chrono::seconds(30)});
    // Each replica rethrows what it caught, so the group records the failure (not the
    // departure of its communicator) for the peers; run() then throws the first one.
    try {
        group.run([&](thread_communicator& comm) {
            const auto me = static_cast<std::size_t>(comm.rank());
            try {
                data_parallel<visitor_change, optim::sgd<double>, SyncPolicy, reduce::bucketed<>>
                    dp(comm, [](ctx_type& ctx) { return visitor_change(ctx.rank()); },
                       {.lr = 0.05});
                for (int step = 0; step < 4; ++step) {
                    if (step == 2 && comm.rank() == 1) {
                        dp.network().change = change;
                        if (grow) {
                            dp.network().w.resize(5, 0.0);
                            dp.network().gw.resize(5, 0.0);
                        }
                    }
                    dp.step(12, [](visitor_change& n, const shard_range& r, ctx_type&) {
                        return n.train(r);
                    });
                }
                dp.finish();
            } catch (const error& e) {
                out[me] = {e.what(), static_cast<int>(e.code())};
                throw;
            }
        });
    } catch (const error&) {
    }
    return out;
}

} // namespace

TEST_CASE("a visitor that visits other tensors than it declared fails on its replica, its peers "
          "get peer_failure",
          "[train][visitor][thread]") {
    struct expectation {
        visit_change change;
        bool grow;
        std::vector<std::string> texts;
    };
    const std::string rule = " must visit the same tensors, in the same order, with the same "
                             "sizes, every time";
    const std::array<expectation, 5> cases = {{
        {visit_change::fewer,
         false,
         {"replica 1: data_parallel: for_each_parameter visited 1 tensors, declared 3 at "
          "construction ('v' and after are missing)",
          "for_each_parameter" + rule}},
        {visit_change::swap,
         false,
         {"for_each_parameter visited 'b' of 1 elements as tensor 1, declared at construction "
          "as 'v' of 4 elements",
          "for_each_parameter" + rule}},
        {visit_change::none,
         true,
         {"for_each_parameter visited 'w' of 5 elements as tensor 0, declared at construction "
          "as 'w' of 4 elements",
          "for_each_parameter" + rule}},
        {visit_change::fewer_state,
         false,
         {"for_each_state visited 1 tensors, declared 2 at construction ('t' and after are "
          "missing)",
          "for_each_state" + rule}},
        {visit_change::rename_state,
         false,
         {"for_each_state visited 'u' of 2 elements as tensor 1, declared at construction as "
          "'t' of 2 elements",
          "for_each_state" + rule}},
    }};
    for (const expectation& c : cases) {
        // The synchronous trainer visits only the parameters after construction.
        const bool state =
            c.change == visit_change::fewer_state || c.change == visit_change::rename_state;
        const auto e = state ? run_changed<sync::local_sgd<2>>(c.change, c.grow)
                             : run_changed<sync::synchronous>(c.change, c.grow);
        for (std::size_t r = 0; r < 3; ++r) {
            INFO("case " << static_cast<int>(c.change) << (c.grow ? " (grow)" : "") << ", replica "
                         << r << ": " << e[r].first);
            if (r == 1) {
                CHECK(e[r].second == static_cast<int>(errc::shape_mismatch));
                for (const std::string& text : c.texts)
                    CHECK_THAT(e[r].first, Catch::Contains(text));
            } else {
                CHECK(e[r].second == static_cast<int>(errc::peer_failure));
            }
        }
    }
}

TEST_CASE("a visitor that keeps visiting what it declared trains on", "[train][visitor][thread]") {
    for (const auto& e : {run_changed<sync::synchronous>(visit_change::none, false),
                          run_changed<sync::local_sgd<2>>(visit_change::none, false)})
        for (const auto& [text, code] : e) {
            INFO(text);
            CHECK(code == -1);
        }
}

namespace {

/// How an overlap_net's visitor lays out its spans.
enum class spans_layout { own, values_as_grads, shared_buffer, tied, b_first };

/// y = w x + b against 3 x + 1, x = (sample mod 16) / 8 - 1. `layout`: own buffers; w's values
/// passed as its gradients (a typo); b's values over the buffer that holds w's gradients; w visited
/// again as "w.tied" with the same spans (a tied tensor: allowed); own buffers, b visited first.
struct overlap_net {
    std::vector<double> w = std::vector<double>(1), gw = std::vector<double>(2);
    std::vector<double> b = std::vector<double>(2), gb = std::vector<double>(2);
    spans_layout layout;
    explicit overlap_net(spans_layout l) : layout(l) {}
    template <class F>
    void for_each_parameter(F&& f) {
        const bool shared = layout == spans_layout::shared_buffer;
        const std::span<double> wv(w), wg(gw.data() + (shared ? 1 : 0), 1);
        auto visit_b = [&] {
            f("b", shared ? std::span<double>(gw) : std::span<double>(b), std::span<double>(gb));
        };
        if (layout == spans_layout::b_first)
            visit_b();
        f("w", wv, layout == spans_layout::values_as_grads ? wv : wg);
        if (layout != spans_layout::b_first)
            visit_b();
        if (layout == spans_layout::tied)
            f("w.tied", wv, wg);
    }
    double train(const shard_range& r) {
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const double x = double(r.sample_index(i) % 16) / 8 - 1,
                         e = w[0] * x + b[0] - (3 * x + 1);
            loss += e * e * r.scale;
            gw[0] += 2 * e * r.scale * x;
            gb[0] += 2 * e * r.scale;
        }
        return loss;
    }
};

} // namespace

TEST_CASE("visited spans that overlap are refused at construction on every replica, naming the "
          "tensors and the fix",
          "[train][visitor][thread]") {
    const std::string fix = ": give every tensor its own value and gradient buffers, f(name, "
                            "values, gradients), disjoint from every other tensor's (a tied "
                            "tensor may be visited again with the same two spans)";
    const std::array<std::pair<spans_layout, std::string>, 2> cases = {{
        {spans_layout::values_as_grads, "the values of 'w' and the gradients of 'w' overlap (1 "
                                        "and 1 values at "},
        {spans_layout::shared_buffer, "the values of 'b' and the gradients of 'w' overlap (2 "
                                      "and 1 values at "},
    }};
    for (const auto& c : cases) {
        const spans_layout layout = c.first;
        const std::string& text = c.second;
        const auto errors = lockstep_test::errors_of(2, [&](int, thread_communicator& comm) {
            data_parallel<overlap_net, optim::sgd<double>> dp(
                comm, [&](ctx_type&) { return overlap_net(layout); }, {.lr = 0.1});
        });
        for (std::size_t r = 0; r < errors.size(); ++r) {
            INFO("layout " << static_cast<int>(layout) << ", replica " << r << ": "
                           << errors[r].first);
            CHECK(errors[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(errors[r].first,
                       Catch::Contains("replica " + std::to_string(r) +
                                       ": data_parallel: for_each_parameter: " + text) &&
                           Catch::Contains(fix));
        }
    }
}

TEST_CASE("a tied tensor visited twice with the same spans trains as if visited once",
          "[train][visitor][thread]") {
    auto train = [](spans_layout layout) {
        std::vector<double> wb(2);
        const auto errors = lockstep_test::errors_of(2, [&](int rank, thread_communicator& comm) {
            data_parallel<overlap_net, optim::sgd<double>> dp(
                comm, [&](ctx_type&) { return overlap_net(layout); }, {.lr = 0.05});
            for (int s = 0; s < 20; ++s)
                dp.step(16,
                        [](overlap_net& n, const shard_range& r, ctx_type&) { return n.train(r); });
            if (rank == 0)
                wb = {dp.network().w[0], dp.network().b[0]};
        });
        for (const auto& [text, code] : errors) {
            INFO(text);
            CHECK(code == -1);
        }
        return wb;
    };
    const std::vector<double> tied = train(spans_layout::tied);
    CHECK(tied == train(spans_layout::own));
    CHECK(tied[0] > 1); // it trained: w moved from 0 towards 3
}

namespace {

/// Each replica's error when replica 1 visits in the other order (`swap`) or decays only 'b'.
std::vector<std::pair<std::string, int>> order_errors(bool swap, bool decay_b_only) {
    return lockstep_test::errors_of(2, [&](int rank, thread_communicator& comm) {
        train_params tp;
        if (decay_b_only && rank == 1)
            tp.decay = [](const tensor_info& t) { return t.name == "b"; };
        data_parallel<overlap_net, optim::sgd<double>> dp(
            comm,
            [&](ctx_type&) {
                return overlap_net(swap && rank == 1 ? spans_layout::b_first : spans_layout::own);
            },
            {.lr = 0.1}, tp);
    });
}

} // namespace

TEST_CASE("replicas visiting their tensors in different orders are told so, and not that "
          "their decay sets differ",
          "[train][visitor][thread]") {
    const auto swapped = order_errors(true, false);
    for (std::size_t r = 0; r < swapped.size(); ++r) {
        INFO("replica " << r << ": " << swapped[r].first);
        CHECK(swapped[r].second == static_cast<int>(errc::shape_mismatch));
        CHECK_THAT(swapped[r].first,
                   Catch::Contains("tensor #0: replica 0 declares parameter 'w' with shape {1} "
                                   "(double), replica 1 declares parameter 'b' with shape {2}"));
        CHECK_THAT(swapped[r].first, !Catch::Contains("different settings"));
    }
    // A decay set that differs is still named, as a set of names.
    const auto decay = order_errors(false, true);
    for (std::size_t r = 0; r < decay.size(); ++r) {
        INFO("replica " << r << ": " << decay[r].first);
        CHECK(decay[r].second == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(decay[r].first, Catch::Contains("replicas use different settings: decay: {b,w} "
                                                   "on replica 0, {b} on replica 1;"));
    }
}

namespace {

/// One parameter from the registry and state 'stats' from the registry (`registered`), visited by
/// for_each_state as 'stats' (`visited_too`) or twice (`visited_twice`), or once (`distinct`).
enum class state_names { distinct, visited_too, visited_twice };
struct state_net {
    ctx_type::handle w;
    std::vector<double> mine = std::vector<double>(3), other = std::vector<double>(2);
    state_names names;
    state_net(ctx_type& ctx, state_names n) : names(n) {
        auto& reg = ctx.registry();
        w = reg.add("w", {1});
        (void)reg.add_state("stats", {4});
        reg.finalize();
    }
    template <class F>
    void for_each_state(F&& f) {
        f(names == state_names::visited_too ? "stats" : "layer.stats", std::span<double>(mine));
        if (names == state_names::visited_twice)
            f("layer.stats", std::span<double>(other));
    }
};

std::vector<std::pair<std::string, int>> state_name_errors(state_names names) {
    return lockstep_test::errors_of(2, [&](int, thread_communicator& comm) {
        data_parallel<state_net, optim::sgd<double>> dp(
            comm, [&](ctx_type& ctx) { return state_net(ctx, names); }, {.lr = 0.1});
    });
}

} // namespace

TEST_CASE("state declared twice under one name is refused at construction, naming both sources",
          "[train][visitor][thread]") {
    const std::string fix = "): a checkpoint keeps each state tensor under its name; give each "
                            "its own name (e.g. prefix a layer's running statistics with the "
                            "layer's name)";
    const std::array<std::pair<state_names, std::string>, 2> cases = {{
        {state_names::visited_too, "data_parallel: state 'stats' is declared twice (state tensors "
                                   "0 from registry().add_state and 1 from for_each_state"},
        {state_names::visited_twice, "data_parallel: state 'layer.stats' is declared twice (state "
                                     "tensors 1 from for_each_state and 2 from for_each_state"},
    }};
    for (const auto& [names, text] : cases) {
        const auto errors = state_name_errors(names);
        for (std::size_t r = 0; r < errors.size(); ++r) {
            INFO("case " << static_cast<int>(names) << ", replica " << r << ": "
                         << errors[r].first);
            CHECK(errors[r].second == static_cast<int>(errc::invalid_argument));
            std::string want = "replica " + std::to_string(r) + ": ";
            want += text;
            want += fix;
            CHECK_THAT(errors[r].first, Catch::Contains(want));
        }
    }
    for (const auto& [text, code] : state_name_errors(state_names::distinct)) {
        INFO(text);
        CHECK(code == -1);
    }
}

TEST_CASE("a tied tensor is refused with clipping, or with decay or frozen that tell its two names "
          "apart",
          "[train][visitor][thread]") {
    const auto is = [](const char* name) {
        return [name](const tensor_info& t) { return t.name == name; };
    };
    struct refusal {
        train_params tp;
        errc code;
        std::string text;
    };
    std::vector<refusal> cases;
    cases.push_back({{.max_grad_norm = 1.0},
                     errc::unsupported,
                     "data_parallel: max_grad_norm = 1 with 'w.tied' visited again with the spans "
                     "of 'w' (a tied tensor): its gradient would count twice in the norm; visit a "
                     "tied tensor once, or clip in a gradient hook"});
    cases.push_back({{.frozen = is("w.tied")},
                     errc::invalid_argument,
                     "data_parallel: 'w.tied' is visited with the spans of 'w' (a tied tensor) but "
                     "train_params::frozen is false for 'w' and true for 'w.tied': the update "
                     "unpacked last would win; give both names the same answer"});
    cases.push_back({{.decay = is("w")},
                     errc::invalid_argument,
                     "train_params::decay is true for 'w' and false for 'w.tied'"});
    for (const auto& c : cases) {
        const auto errors = lockstep_test::errors_of(2, [&](int, thread_communicator& comm) {
            data_parallel<overlap_net, optim::sgd<double>> dp(
                comm, [&](ctx_type&) { return overlap_net(spans_layout::tied); }, {.lr = 0.1},
                c.tp);
        });
        for (std::size_t r = 0; r < errors.size(); ++r) {
            INFO("replica " << r << ": " << errors[r].first);
            CHECK(errors[r].second == static_cast<int>(c.code));
            CHECK_THAT(errors[r].first, Catch::Contains("replica " + std::to_string(r) + ": ") &&
                                            Catch::Contains(c.text));
        }
    }
    // Both names frozen (decay then acts on neither, and clipping sees their zeroed gradient),
    // or decayed alike: accepted.
    for (const train_params& tp :
         {train_params{.decay = is("w"),
         .max_grad_norm = 1.0,
         .frozen = [](const tensor_info& t) { return t.name != "b"; }},
          train_params{.decay = [](const tensor_info& t) { return t.name != "b"; }}}) {
        for (const auto& [text, code] :
             lockstep_test::errors_of(2, [&](int, thread_communicator& comm) {
                 data_parallel<overlap_net, optim::sgd<double>> dp(
                     comm, [&](ctx_type&) { return overlap_net(spans_layout::tied); }, {.lr = 0.1},
                     tp);
             })) {
            INFO(text);
            CHECK(code == -1);
        }
    }
}

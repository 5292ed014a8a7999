// Tests of nn::batch_norm on one replica: against a double-precision reference, finite
// differences, numerical stability, options, bad input. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/nn/batch_norm.hpp"

#include "bn_reference.hpp"
#include "support/contains.hpp"
#include "support/counting_communicator.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

using namespace lockstep;
using bn_test::dims;
using lockstep_test::contains;

namespace {

template <class T, class L>
struct cfg {
    using value_type = T;
    using layout = L;
};

/// Runs f(comm) on a single replica (a thread group of one).
template <class F>
void solo(F&& f) {
    thread_group group(1, {.timeout = std::chrono::seconds(30)});
    group.run([&](thread_communicator& comm) { f(comm); });
}

/// Assertions made on solo()'s replica thread: recorded there (what, passed) and asserted on the
/// test's thread once run() returned (Catch2's assertions belong on the main thread).
struct deferred_checks {
    std::vector<std::pair<std::string, bool>> results;
    void operator()(bool passed, std::string what) {
        results.emplace_back(std::move(what), passed);
    }
    void assert_all() const {
        CHECK_FALSE(results.empty());
        for (const auto& [what, passed] : results) {
            INFO(what);
            CHECK(passed);
        }
    }
};

std::vector<double> as_double(std::span<const float> s) {
    return {s.begin(), s.end()};
}
std::vector<double> as_double(std::span<const double> s) {
    return {s.begin(), s.end()};
}

} // namespace

TEMPLATE_TEST_CASE("batch_norm matches the double-precision reference on one replica", "[nn][bn]",
                   (cfg<float, nn::nchw>), (cfg<float, nn::nhwc>), (cfg<float, nn::nc>),
                   (cfg<double, nn::nchw>), (cfg<double, nn::nhwc>), (cfg<double, nn::nc>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    const dims d = bn_test::make_dims<L>(6, 5, 7, 9); // odd extents exercise the vector tails
    const nn::batch_norm_params p{.eps = 1e-3, .momentum = 0.25};
    std::vector<double> gamma{0.5, 1.5, -2.0, 1.0, 3.0}, beta{0.1, -0.2, 0.3, 0.0, 1.0};
    std::vector<double> rm(5, 0.0), rv(5, 1.0);

    std::vector<T> y(d.size()), dx(d.size());
    nn::batch_norm<T, bn::local, L> layer(d.c, p);
    for (std::size_t c = 0; c < d.c; ++c) {
        layer.gamma()[c] = static_cast<T>(gamma[c]);
        layer.beta()[c] = static_cast<T>(beta[c]);
    }
    deferred_checks check_later;
    solo([&](auto& comm) {
        testing::counting_communicator counted(comm);
        for (unsigned step = 0; step < 3; ++step) {
            const auto x = bn_test::random_values<T>(d.size(), 100 + step, 2.0 + step, 3.0);
            const auto dy = bn_test::random_values<T>(d.size(), 200 + step);
            layer.forward_train(counted, std::span<const T>(x), bn_test::shape_of<L>(d),
                                std::span<T>(y));
            std::vector<double> dg0 = as_double(layer.dgamma()), db0 = as_double(layer.dbeta());
            layer.backward(counted, std::span<const T>(dy), std::span<T>(dx));
            const auto ref =
                bn_test::reference<L>(d, x, dy, gamma, beta, p.eps, p.momentum, rm, rv);
            rm = ref.running_mean;
            rv = ref.running_var;
            const double tol = bn_test::tolerance<T>();
            check_later(bn_test::rel_error(y, ref.y) <= tol,
                        "step " + std::to_string(step) + ": bn_test::rel_error(y, ref.y) <= tol");
            check_later(bn_test::rel_error(dx, ref.dx) <= tol,
                        "step " + std::to_string(step) + ": bn_test::rel_error(dx, ref.dx) <= tol");
            std::vector<double> dg(d.c), db(d.c);
            for (std::size_t c = 0; c < d.c; ++c) {
                dg[c] = layer.dgamma()[c] - dg0[c]; // backward accumulates
                db[c] = layer.dbeta()[c] - db0[c];
            }
            check_later(bn_test::rel_error(dg, ref.dgamma) <= tol,
                        "step " + std::to_string(step) +
                            ": bn_test::rel_error(dg, ref.dgamma) <= tol");
            check_later(bn_test::rel_error(db, ref.dbeta) <= tol,
                        "step " + std::to_string(step) +
                            ": bn_test::rel_error(db, ref.dbeta) <= tol");
            check_later(bn_test::rel_error(layer.running_mean(), rm) <= tol,
                        "step " + std::to_string(step) +
                            ": bn_test::rel_error(layer.running_mean(), rm) <= tol");
            check_later(bn_test::rel_error(layer.running_var(), rv) <= tol,
                        "step " + std::to_string(step) +
                            ": bn_test::rel_error(layer.running_var(), rv) <= tol");
            check_later(bn_test::rel_error(layer.batch_mean(), ref.mean) <= tol,
                        "step " + std::to_string(step) +
                            ": bn_test::rel_error(layer.batch_mean(), ref.mean) <= tol");
        }
        check_later(layer.num_batches_tracked() == 3, "layer.num_batches_tracked() == 3");
        check_later(counted.counts().collectives() == 0,
                    "counted.counts().collectives() == 0"); // bn::local never communicates

        // Inference uses the running statistics and no communication.
        const auto x = bn_test::random_values<T>(d.size(), 300, -1.0, 2.0);
        layer.forward_eval(std::span<const T>(x), bn_test::shape_of<L>(d), std::span<T>(y));
        std::vector<double> expect(d.size());
        for (std::size_t n = 0; n < d.n; ++n)
            for (std::size_t c = 0; c < d.c; ++c)
                for (std::size_t s = 0; s < d.s(); ++s) {
                    const std::size_t i = bn_test::index<L>(d, n, c, s);
                    expect[i] = (x[i] - rm[c]) / std::sqrt(rv[c] + p.eps) * gamma[c] + beta[c];
                }
        check_later(bn_test::rel_error(y, expect) <= bn_test::tolerance<T>(),
                    "bn_test::rel_error(y, expect) <= bn_test::tolerance<T>()");
        check_later(counted.counts().collectives() == 0, "counted.counts().collectives() == 0");
    });
    check_later.assert_all();
}

TEMPLATE_TEST_CASE("batch_norm backward matches finite differences", "[nn][bn]", nn::nchw, nn::nhwc,
                   nn::nc) {
    using L = TestType;
    const dims d = bn_test::make_dims<L>(3, 2, 2, 3);
    const auto x0 = bn_test::random_values<double>(d.size(), 7, 0.5, 2.0);
    const auto w = bn_test::random_values<double>(d.size(), 8); // loss = sum(w * y), dy = w
    nn::batch_norm<double, bn::local, L> layer(d.c, {.eps = 1e-2});
    layer.gamma()[0] = 1.7;
    layer.gamma()[1] = -0.6;
    layer.beta()[1] = 0.4;
    std::vector<double> y(d.size()), dx(d.size());
    deferred_checks check_later;
    solo([&](auto& comm) {
        auto loss = [&](const std::vector<double>& x) {
            layer.forward_train(comm, std::span<const double>(x), bn_test::shape_of<L>(d),
                                std::span<double>(y));
            double l = 0;
            for (std::size_t i = 0; i < y.size(); ++i)
                l += w[i] * y[i];
            return l;
        };
        loss(x0);
        layer.backward(comm, std::span<const double>(w), std::span<double>(dx));
        const double h = 1e-5;
        std::vector<double> fd(d.size());
        for (std::size_t i = 0; i < d.size(); ++i) {
            auto xp = x0, xm = x0;
            xp[i] += h;
            xm[i] -= h;
            fd[i] = (loss(xp) - loss(xm)) / (2 * h);
        }
        check_later(bn_test::rel_error(dx, fd) <= 1e-7,
                    "bn_test::rel_error(dx, fd) <= 1e-7"); // central differences: O(h^2) + rounding
        const std::vector<double> dgamma(layer.dgamma().begin(), layer.dgamma().end());
        const std::vector<double> dbeta(layer.dbeta().begin(), layer.dbeta().end());
        std::vector<double> fdg(d.c), fdb(d.c);
        for (std::size_t c = 0; c < d.c; ++c) {
            const double g = layer.gamma()[c], b = layer.beta()[c];
            layer.gamma()[c] = g + h;
            const double lgp = loss(x0);
            layer.gamma()[c] = g - h;
            const double lgm = loss(x0);
            layer.gamma()[c] = g;
            layer.beta()[c] = b + h;
            const double lbp = loss(x0);
            layer.beta()[c] = b - h;
            const double lbm = loss(x0);
            layer.beta()[c] = b;
            fdg[c] = (lgp - lgm) / (2 * h);
            fdb[c] = (lbp - lbm) / (2 * h);
        }
        check_later(bn_test::rel_error(dgamma, fdg) <= 1e-7,
                    "bn_test::rel_error(dgamma, fdg) <= 1e-7");
        check_later(bn_test::rel_error(dbeta, fdb) <= 1e-7,
                    "bn_test::rel_error(dbeta, fdb) <= 1e-7");
    });
    check_later.assert_all();
}

TEST_CASE("batch_norm statistics are stable for data with a large mean", "[nn][bn]") {
    // Mean 1e4, std 1 in float: sum / sum-of-squares loses every digit of the variance here.
    const dims d{64, 3, 16, 16};
    const auto x = bn_test::random_values<float>(d.size(), 11, 1e4, 1.0);
    std::vector<float> y(d.size());
    nn::batch_norm<float, bn::local, nn::nchw> layer(d.c, {.eps = 1e-5, .momentum = 1.0});
    solo([&](auto& comm) {
        layer.forward_train(comm, std::span<const float>(x), {d.n, d.c, d.h, d.w},
                            std::span<float>(y));
    });
    const std::vector<double> ones(d.c, 1.0), zeros(d.c, 0.0);
    const auto ref = bn_test::reference<nn::nchw>(d, x, x, ones, zeros, 1e-5, 1.0, zeros, ones);
    const double m = static_cast<double>(d.n * d.s());
    for (std::size_t c = 0; c < d.c; ++c) {
        // momentum 1: running_var is the unbiased batch variance
        CHECK(std::abs(layer.running_var()[c] - ref.var[c] * m / (m - 1)) <= 1e-3 * ref.var[c]);
        CHECK(std::abs(layer.running_mean()[c] - ref.mean[c]) <= 1e-6 * ref.mean[c]);
    }
    CHECK(bn_test::rel_error(y, ref.y) <= 1e-3); // y = (x - mean) * scale: no cancellation
}

TEST_CASE("batch_norm without affine normalizes only", "[nn][bn]") {
    const dims d{4, 3, 2, 2};
    const auto x = bn_test::random_values<double>(d.size(), 5, 1.0, 2.0);
    const auto dy = bn_test::random_values<double>(d.size(), 6);
    std::vector<double> y(d.size()), dx(d.size());
    nn::batch_norm<double> layer(d.c, {.affine = false});
    CHECK(layer.gamma().empty());
    CHECK(layer.dgamma().empty());
    solo([&](auto& comm) {
        layer.forward_train(comm, std::span<const double>(x), {4, 3, 2, 2}, std::span<double>(y));
        layer.backward(comm, std::span<const double>(dy), std::span<double>(dx));
    });
    const std::vector<double> ones(d.c, 1.0), zeros(d.c, 0.0);
    const auto ref = bn_test::reference<nn::nchw>(d, x, dy, ones, zeros, 1e-5, 0.1, zeros, ones);
    CHECK(bn_test::rel_error(y, ref.y) <= 1e-12);
    CHECK(bn_test::rel_error(dx, ref.dx) <= 1e-12);
}

TEST_CASE("batch_norm can keep its parameters in caller-provided storage", "[nn][bn]") {
    std::vector<float> flat(std::size_t{4} * 3,
                            -7.0f); // gamma | beta | dgamma | dbeta, as a registry would
    std::span<float> all(flat);
    nn::batch_norm<float, bn::local, nn::nc> layer(3, {all.subspan(0, 3), all.subspan(3, 3),
                                                       all.subspan(6, 3), all.subspan(9, 3),
                                                       nn::initial_values::reset});
    CHECK(flat == std::vector<float>{1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0});
    flat[0] = 2.0f; // the layer reads gamma from the caller's storage
    const dims d{5, 3, 1, 1};
    const auto x = bn_test::random_values<float>(d.size(), 9);
    const auto dy = bn_test::random_values<float>(d.size(), 10);
    std::vector<float> y(d.size()), dx(d.size());
    solo([&](auto& comm) {
        for (int pass = 0; pass < 2; ++pass) { // the second pass accumulates
            layer.forward_train(comm, std::span<const float>(x), {5, 3}, std::span<float>(y));
            layer.backward(comm, std::span<const float>(dy), std::span<float>(dx));
        }
    });
    const auto ref =
        bn_test::reference<nn::nc>(d, x, dy, {2, 1, 1}, {0, 0, 0}, 1e-5, 0.1, {0, 0, 0}, {1, 1, 1});
    CHECK(bn_test::rel_error(y, ref.y) <= 1e-5);
    for (std::size_t c = 0; c < 3; ++c) {
        CHECK(flat[6 + c] == Approx(2 * ref.dgamma[c]).margin(1e-5));
        CHECK(flat[9 + c] == Approx(2 * ref.dbeta[c]).margin(1e-5));
    }
    CHECK_THROWS_AS(
        (nn::batch_norm<float, bn::local, nn::nc>(
            3, {all.subspan(0, 2), all.subspan(3, 3), all.subspan(6, 3), all.subspan(9, 3)})),
        error);
}

TEST_CASE("batch_norm over caller spans never silently overwrites values the caller set",
          "[nn][bn]") {
    using layer_t = nn::batch_norm<float, bn::local, nn::nc>;
    std::vector<float> flat(std::size_t{4} * 3, 0.0f); // gamma | beta | dgamma | dbeta
    std::span<float> all(flat);
    auto spans = [&](nn::initial_values v) {
        return layer_t::parameter_spans{all.subspan(0, 3), all.subspan(3, 3), all.subspan(6, 3),
                                        all.subspan(9, 3), v};
    };
    // Fresh (all zeros, as a new registry tensor): gamma = 1, beta = 0 written.
    { layer_t fresh(3, spans(nn::initial_values::fresh)); }
    CHECK(flat == std::vector<float>{1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0});
    // Values set by the caller (here gamma = 1 and beta[2] = 0.5) are refused by default, with a
    // message that names the count and the two ways out; the spans stay as they were.
    flat[5] = 0.5f;
    const std::vector<float> before = flat;
    try {
        layer_t refused(3, spans(nn::initial_values::fresh));
        FAIL("a layer over spans holding values was built");
    } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        CHECK_THAT(e.what(), Catch::Contains("4 non-zero value(s) of 6") &&
                                 Catch::Contains("initial_values::keep") &&
                                 Catch::Contains("initial_values::reset"));
    }
    CHECK(flat == before);
    // keep: trains from them (gradients still zeroed).
    flat[1] = 0.25f;
    flat[7] = 3.0f;
    { layer_t kept(3, spans(nn::initial_values::keep)); }
    CHECK(flat == std::vector<float>{1, 0.25f, 1, 0, 0, 0.5f, 0, 0, 0, 0, 0, 0});
    // reset: overwritten.
    { layer_t reset(3, spans(nn::initial_values::reset)); }
    CHECK(flat == std::vector<float>{1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0});
}

TEST_CASE("batch_norm's construction errors name the replica of its communicator, and spans "
          "another layer set are asked about",
          "[nn][bn][thread]") {
    using layer_t = nn::batch_norm<float, bn::local, nn::nc>;
    std::vector<std::string> bad_eps(2), bad_spans(2), second(2);
    thread_group(2).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        std::vector<float> flat(std::size_t{4} * 3, 0.0f); // gamma | beta | dgamma | dbeta
        std::span<float> all(flat);
        auto spans = [&](std::size_t gamma) {
            return layer_t::parameter_spans{all.subspan(0, gamma), all.subspan(3, 3),
                                            all.subspan(6, 3), all.subspan(9, 3)};
        };
        auto text = [](auto&& make) -> std::string {
            try {
                make();
            } catch (const error& e) {
                return e.what();
            }
            return "no error";
        };
        bad_eps[r] = text([&] { layer_t l(comm, 3, {.eps = 0}); });
        bad_spans[r] = text([&] { layer_t l(comm, 3, spans(2)); });
        // Two layers over one registry tensor pair: the first wrote gamma = 1.
        const layer_t first(comm, 3, spans(3));
        second[r] = text([&] { layer_t l(comm, 3, spans(3)); });
    });
    for (std::size_t r = 0; r < 2; ++r) {
        const std::string me = "replica " + std::to_string(r) + ": batch_norm: ";
        INFO(bad_eps[r] << "\n" << bad_spans[r] << "\n" << second[r]);
        CHECK(contains(bad_eps[r], "[invalid_argument] " + me + "channels = 3, eps = 0"));
        CHECK(contains(bad_spans[r], "[shape_mismatch] " + me + "external parameters need"));
        CHECK(contains(second[r], "[invalid_argument] " + me +
                                      "gamma and beta over caller spans already hold 3 non-zero "
                                      "value(s) of 6 (set by the caller, or by another layer over "
                                      "the same spans?); a layer over fresh spans would overwrite "
                                      "them with gamma = 1, beta = 0: give each layer spans of "
                                      "its own, or pass parameter_spans{..., .values = "
                                      "nn::initial_values::keep}"));
    }
}
TEST_CASE("batch_norm rejects bad input with a clear error", "[nn][bn]") {
    nn::batch_norm<float, bn::local, nn::nchw> layer(3);
    std::vector<float> x(std::size_t{2} * 3 * 4, 1.0f), y(x.size());
    auto message = [&](auto&& call) -> std::string {
        try {
            solo(call);
        } catch (const error& e) {
            return e.what();
        }
        return "no error";
    };
    const std::string channels = message([&](auto& comm) {
        layer.forward_train(comm, std::span<const float>(x), {2, 4, 3, 1}, std::span<float>(y));
    });
    CHECK(channels.find("shape_mismatch") != std::string::npos);
    CHECK(channels.find("replica 0: batch_norm.forward_train: the layer has 3 channels, the "
                        "input 4") != std::string::npos);
    const std::string rank = message([&](auto& comm) {
        layer.forward_train(comm, std::span<const float>(x), {2, 3, 4}, std::span<float>(y));
    });
    CHECK(rank.find("expected a rank-4 nchw tensor, got shape (2, 3, 4) of rank 3") !=
          std::string::npos);
    const std::string size = message([&](auto& comm) {
        layer.forward_train(comm, std::span<const float>(x), {2, 3, 2, 1}, std::span<float>(y));
    });
    CHECK(size.find("has 12 values, x has 24") != std::string::npos);
    const std::string one = message([&](auto& comm) {
        layer.forward_train(comm, std::span<const float>(x).first(3), {1, 3, 1, 1},
                            std::span<float>(y).first(3));
    });
    CHECK(one.find("invalid_argument") != std::string::npos);
    CHECK(one.find("expected more than 1 value per channel when training") != std::string::npos);
    const std::string no_forward = message(
        [&](auto& comm) { layer.backward(comm, std::span<const float>(x), std::span<float>(y)); });
    CHECK(no_forward.find("backward needs a preceding forward_train") != std::string::npos);
    CHECK_THROWS_AS(nn::batch_norm<float>(0), error);
    CHECK_THROWS_AS(nn::batch_norm<float>(3, {.momentum = 1.5}), error);
    // One value per channel is fine for inference, and an empty batch is fine for training.
    CHECK_NOTHROW(layer.forward_eval(std::span<const float>(x).first(3), {1, 3, 1, 1},
                                     std::span<float>(y).first(3)));
    CHECK(message([&](auto& comm) {
              layer.forward_train(comm, std::span<const float>(), {0, 3, 4, 4}, std::span<float>());
          }) == "no error");
}

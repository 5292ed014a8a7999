// optim::adam and optim::adamw against torch.optim.Adam / AdamW's update equations, with
// hand-computed values. SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/adam.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

using lockstep::optim::adam;
using lockstep::optim::adamw;

namespace {
// Two steps from w = {1, -2} with g1 = {0.5, 0.25}, g2 = {-0.5, 1}; w after each step.
template <class Opt, class T = typename Opt::value_type>
std::vector<std::vector<T>> two_steps(typename Opt::params_type p) {
    Opt opt(2, p);
    std::vector<T> w{T(1), T(-2)};
    const std::vector<T> g1{T(0.5), T(0.25)}, g2{T(-0.5), T(1)};
    std::vector<std::vector<T>> out;
    opt.step(w, g1);
    out.push_back(w);
    opt.step(w, g2);
    out.push_back(w);
    return out;
}
} // namespace

TEMPLATE_TEST_CASE("adam: hand-computed steps", "[optim][adam][host]", float, double) {
    using T = TestType;
    const double tol = sizeof(T) == 4 ? 2e-6 : 1e-13;
    const double eps = 1e-8;

    SECTION("no weight decay") {
        // step 1: m = 0.1 g = {0.05, 0.025}; v = 0.001 g^2 = {2.5e-4, 6.25e-5};
        //         bc1 = 0.1, bc2 = 0.001: step size 0.1 / 0.1 = 1, sqrt(v / bc2) = |g|;
        //         w = {1 - 0.05 / (0.5 + eps), -2 - 0.025 / (0.25 + eps)}  (about lr sign(g)).
        // step 2: m = 0.9 m + 0.1 g2 = {-0.005, 0.1225};
        //         v = 0.999 v + 0.001 g2^2 = {4.9975e-4, 1.0624375e-3};
        //         bc1 = 1 - 0.81 = 0.19, bc2 = 1 - 0.998001 = 0.001999;
        //         sqrt(v0 / bc2) = sqrt(0.25) = 0.5, sqrt(v1 / bc2) = sqrt(1.0624375e-3 /
        //         0.001999); w -= (0.1 / 0.19) m / (sqrt(v / bc2) + eps).
        const auto w = two_steps<adam<T>>({.lr = 0.1});
        const double w10 = 1 - 0.05 / (0.5 + eps), w11 = -2 - 0.025 / (0.25 + eps);
        CHECK(w[0][0] == Approx(w10).margin(tol).epsilon(0));
        CHECK(w[0][1] == Approx(w11).margin(tol).epsilon(0));
        CHECK(w[1][0] == Approx(w10 - (0.1 / 0.19) * -0.005 / (0.5 + eps)).margin(tol).epsilon(0));
        CHECK(w[1][1] ==
              Approx(w11 - (0.1 / 0.19) * 0.1225 / (std::sqrt(1.0624375e-3 / 0.001999) + eps))
                  .margin(tol)
                  .epsilon(0));
    }
    SECTION("eps is added outside the square root") {
        // step 1 with eps = 0.1: w = {1 - 0.05 / (0.5 + 0.1), -2 - 0.025 / (0.25 + 0.1)}
        // = {0.91666..., -2.0714285...}; eps inside the root would give 1 - 0.05 / sqrt(0.35).
        const auto w = two_steps<adam<T>>({.lr = 0.1, .eps = 0.1});
        CHECK(w[0][0] == Approx(1 - 0.05 / 0.6).margin(tol).epsilon(0));
        CHECK(w[0][1] == Approx(-2 - 0.025 / 0.35).margin(tol).epsilon(0));
    }
    SECTION("L2 weight decay 0.1 enters the moments") {
        // step 1: g' = g + 0.1 w = {0.6, 0.05}; sqrt(v / bc2) = |g'|; step size 1;
        //         w = {1 - 0.06 / (0.6 + eps), -2 - 0.005 / (0.05 + eps)}.
        const auto w = two_steps<adam<T>>({.lr = 0.1, .weight_decay = 0.1});
        CHECK(w[0][0] == Approx(1 - 0.06 / (0.6 + eps)).margin(tol).epsilon(0));
        CHECK(w[0][1] == Approx(-2 - 0.005 / (0.05 + eps)).margin(tol).epsilon(0));
    }
}

TEMPLATE_TEST_CASE("adamw: decoupled weight decay", "[optim][adam][host]", float, double) {
    using T = TestType;
    const double tol = sizeof(T) == 4 ? 2e-6 : 1e-13;
    const double eps = 1e-8;
    // step 1: w' = w (1 - 0.1 * 0.1) = {0.99, -1.98}; the Adam step on the raw g is as above:
    //         w = {0.99 - 0.05 / (0.5 + eps), -1.98 - 0.025 / (0.25 + eps)}.
    // step 2: w'' = 0.99 w; then the same moment arithmetic as Adam's step 2.
    const auto w = two_steps<adamw<T>>({.lr = 0.1, .weight_decay = 0.1});
    const double w10 = 0.99 - 0.05 / (0.5 + eps), w11 = -1.98 - 0.025 / (0.25 + eps);
    CHECK(w[0][0] == Approx(w10).margin(tol).epsilon(0));
    CHECK(w[0][1] == Approx(w11).margin(tol).epsilon(0));
    CHECK(w[1][0] ==
          Approx(0.99 * w10 - (0.1 / 0.19) * -0.005 / (0.5 + eps)).margin(tol).epsilon(0));
    CHECK(w[1][1] ==
          Approx(0.99 * w11 - (0.1 / 0.19) * 0.1225 / (std::sqrt(1.0624375e-3 / 0.001999) + eps))
              .margin(tol)
              .epsilon(0));
    // PyTorch's AdamW default weight decay.
    CHECK(lockstep::optim::adamw_params{}.weight_decay == 0.01);
}

TEST_CASE("adam: invalid parameters throw lockstep::error", "[optim][adam][host]") {
    CHECK_THROWS_AS(adam<float>(3, {.beta1 = 1.0}), lockstep::error);
    CHECK_THROWS_AS(adam<float>(3, {.eps = 0.0}), lockstep::error);
    CHECK_THROWS_AS(adamw<float>(3, {.weight_decay = -0.1}), lockstep::error);
}

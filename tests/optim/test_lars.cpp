// optim::lars against You, Gitman, Ginsburg 2017 (Algorithm 1), with hand-computed values.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/lars.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

using lockstep::tensor_segment;
using lockstep::optim::lars;

TEMPLATE_TEST_CASE("lars: hand-computed steps with per-tensor trust ratios", "[optim][lars][host]",
                   float, double) {
    using T = TestType;
    const double tol = sizeof(T) == 4 ? 1e-6 : 1e-14;
    // Tensor 0: w = {3, 4}; tensor 1 (a bias: no decay, no adaptation): w = {1};
    // tensor 2: w = {0, 0} (zero norm: ratio 1).
    const tensor_segment segs[] = {{0, 2, true, true}, {2, 1, false, false}, {3, 2, true, true}};
    lars<T> opt(5, {.lr = 0.1, .momentum = 0.9, .eta = 0.01, .weight_decay = 0.5, .eps = 0.0},
                lockstep::host_system{}, segs);
    CHECK(opt.trust_ratios()[0] == 1.0);
    std::vector<T> w{T(3), T(4), T(1), T(0), T(0)};

    // Step 1, g = {0.6, 0.8 | 0.5 | 1, -1}.
    // tensor 0: ||w|| = 5, ||g|| = 1, trust = 0.01 * 5 / (1 + 0.5 * 5) = 1/70;
    //           v = 0.1 / 70 * (g + 0.5 w) = {2.1, 2.8} / 700 = {0.003, 0.004};
    //           w = {2.997, 3.996} (= 0.999 {3, 4}).
    // tensor 1: trust 1, no decay: v = 0.1 * 0.5 = 0.05, w = 0.95.
    // tensor 2: ||w|| = 0 -> trust 1: v = 0.1 g = {0.1, -0.1}, w = {-0.1, 0.1}.
    const std::vector<T> g1{T(0.6), T(0.8), T(0.5), T(1), T(-1)};
    opt.step(w, g1);
    // float: g and w are rounded to float first (relative 2^-24 each), so the ratio is good
    // to about 1e-7 relative there; double to 1e-14.
    CHECK(opt.trust_ratios()[0] == Approx(1.0 / 70.0).epsilon(sizeof(T) == 4 ? 1e-6 : 1e-14));
    CHECK(opt.trust_ratios()[1] == 1.0);
    CHECK(opt.trust_ratios()[2] == 1.0);
    CHECK(w[0] == Approx(2.997).margin(tol).epsilon(0));
    CHECK(w[1] == Approx(3.996).margin(tol).epsilon(0));
    CHECK(w[2] == Approx(0.95).margin(tol).epsilon(0));
    CHECK(w[3] == Approx(-0.1).margin(tol).epsilon(0));
    CHECK(w[4] == Approx(0.1).margin(tol).epsilon(0));

    // Step 2, g = {-0.3, 0.4 | -0.5 | 0, 0}.
    // tensor 0: ||w|| = 4.995, ||g|| = 0.5, trust = 0.04995 / (0.5 + 2.4975) = 0.04995 / 2.9975;
    //           g + 0.5 w = {-0.3 + 1.4985, 0.4 + 1.998} = {1.1985, 2.398};
    //           v = 0.9 {0.003, 0.004} + 0.1 trust {1.1985, 2.398}; w -= v.
    // tensor 1: v = 0.9 * 0.05 - 0.1 * 0.5 = -0.005, w = 0.955.
    // tensor 2: ||g|| = 0 -> trust 1; g + 0.5 w = {-0.05, 0.05};
    //           v = 0.9 {0.1, -0.1} + 0.1 {-0.05, 0.05} = {0.085, -0.085}; w = {-0.185, 0.185}.
    const std::vector<T> g2{T(-0.3), T(0.4), T(-0.5), T(0), T(0)};
    opt.step(w, g2);
    const double trust = 0.04995 / 2.9975;
    CHECK(opt.trust_ratios()[0] == Approx(trust).epsilon(sizeof(T) == 4 ? 1e-6 : 1e-13));
    CHECK(w[0] == Approx(2.997 - (0.0027 + 0.1 * trust * 1.1985)).margin(tol).epsilon(0));
    CHECK(w[1] == Approx(3.996 - (0.0036 + 0.1 * trust * 2.398)).margin(tol).epsilon(0));
    CHECK(w[2] == Approx(0.955).margin(tol).epsilon(0));
    CHECK(w[3] == Approx(-0.185).margin(tol).epsilon(0));
    CHECK(w[4] == Approx(0.185).margin(tol).epsilon(0));
}

TEST_CASE("lars: invalid parameters throw lockstep::error", "[optim][lars][host]") {
    CHECK_THROWS_AS(lars<float>(3, {.eta = 0.0}), lockstep::error);
    CHECK_THROWS_AS(lars<float>(3, {.eps = -1.0}), lockstep::error);
    lars<float> opt(3);
    std::vector<float> w(3), g(4);
    CHECK_THROWS_AS(opt.step(w, g), lockstep::error);
}

// optim::lamb against You et al. 2019 (Algorithm 2, with bias correction), with hand-computed
// values. SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/lamb.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

using lockstep::tensor_segment;
using lockstep::optim::lamb;

TEMPLATE_TEST_CASE("lamb: hand-computed steps with per-tensor trust ratios", "[optim][lamb][host]",
                   float, double) {
    using T = TestType;
    const double tol = sizeof(T) == 4 ? 2e-6 : 1e-13;
    const double eps = 1e-6;
    // Tensor 0: w = {3, 4}, decayed and adapted; tensor 1 (a bias): w = {1}, neither.
    const tensor_segment segs[] = {{0, 2, true, true}, {2, 1, false, false}};
    lamb<T> opt(3, {.lr = 0.1, .eps = eps, .weight_decay = 0.1}, lockstep::host_system{}, segs);
    std::vector<T> w{T(3), T(4), T(1)};
    const std::vector<T> g{T(0.6), T(-0.8), T(0.5)};

    // Step 1: m = 0.1 g, v = 0.001 g^2; bias correction gives m_hat = g, v_hat = g^2, so
    //   r = g / (|g| + eps) + 0.1 w = {0.6/(0.6+eps) + 0.3, -0.8/(0.8+eps) + 0.4} (about
    //   {1.3, -0.6}), ||w|| = 5, ratio = 5 / ||r|| (about 3.49); w -= 0.1 ratio r.
    //   Bias: r = 0.5 / (0.5 + eps), ratio 1: w = 1 - 0.1 r.
    opt.step(w, g);
    const double r0 = 0.6 / (0.6 + eps) + 0.3, r1 = -0.8 / (0.8 + eps) + 0.4;
    const double ratio = 5.0 / std::sqrt(r0 * r0 + r1 * r1);
    const double w0 = 3 - 0.1 * ratio * r0, w1 = 4 - 0.1 * ratio * r1;
    const double wb = 1 - 0.1 * (0.5 / (0.5 + eps));
    CHECK(opt.trust_ratios()[0] == Approx(ratio).epsilon(sizeof(T) == 4 ? 1e-6 : 1e-13));
    CHECK(opt.trust_ratios()[1] == 1.0);
    CHECK(w[0] == Approx(w0).margin(tol).epsilon(0));
    CHECK(w[1] == Approx(w1).margin(tol).epsilon(0));
    CHECK(w[2] == Approx(wb).margin(tol).epsilon(0));

    // Step 2 with the same g: m = (0.09 + 0.1) g = 0.19 g, v = (0.000999 + 0.001) g^2 =
    //   0.001999 g^2; bc1 = 0.19, bc2 = 0.001999, so again m_hat = g, v_hat = g^2 and
    //   r = g / (|g| + eps) + 0.1 w1 with the new w; ratio = ||w1|| / ||r||.
    opt.step(w, g);
    const double s0 = 0.6 / (0.6 + eps) + 0.1 * w0, s1 = -0.8 / (0.8 + eps) + 0.1 * w1;
    const double ratio2 = std::sqrt(w0 * w0 + w1 * w1) / std::sqrt(s0 * s0 + s1 * s1);
    CHECK(w[0] == Approx(w0 - 0.1 * ratio2 * s0).margin(tol).epsilon(0));
    CHECK(w[1] == Approx(w1 - 0.1 * ratio2 * s1).margin(tol).epsilon(0));
    CHECK(w[2] == Approx(wb - 0.1 * (0.5 / (0.5 + eps))).margin(tol).epsilon(0));
}

TEST_CASE("lamb: phi clamps the weight norm in the trust ratio", "[optim][lamb][host]") {
    // Same first step as above with phi = clamp(., 0, 2): ratio = 2 / ||r|| instead of 5 / ||r||.
    const double eps = 1e-6;
    lamb<double> opt(2, {.lr = 0.1, .eps = eps, .weight_decay = 0.1, .phi_max = 2.0});
    std::vector<double> w{3, 4};
    const std::vector<double> g{0.6, -0.8};
    opt.step(w, g);
    const double r0 = 0.6 / (0.6 + eps) + 0.3, r1 = -0.8 / (0.8 + eps) + 0.4;
    const double ratio = 2.0 / std::sqrt(r0 * r0 + r1 * r1);
    CHECK(opt.trust_ratios()[0] == Approx(ratio).epsilon(1e-13));
    CHECK(w[0] == Approx(3 - 0.1 * ratio * r0).margin(1e-13).epsilon(0));
    // And phi_min lifts a small norm: w = {0.003, 0.004} (norm 0.005) with phi_min = 0.01.
    lamb<double> lifted(2, {.lr = 0.1, .eps = eps, .weight_decay = 0.0, .phi_min = 0.01});
    std::vector<double> small{0.003, 0.004};
    lifted.step(small, g);
    const double q0 = 0.6 / (0.6 + eps), q1 = -0.8 / (0.8 + eps);
    CHECK(lifted.trust_ratios()[0] == Approx(0.01 / std::sqrt(q0 * q0 + q1 * q1)).epsilon(1e-13));
}

TEST_CASE("lamb: invalid parameters throw lockstep::error", "[optim][lamb][host]") {
    CHECK_THROWS_AS(lamb<float>(3, {.beta2 = 1.0}), lockstep::error);
    CHECK_THROWS_AS(lamb<float>(3, {.phi_min = 2.0, .phi_max = 1.0}), lockstep::error);
}

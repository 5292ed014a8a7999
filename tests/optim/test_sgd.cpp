// optim::sgd against torch.optim.SGD's update equations, with hand-computed values.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/sgd.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using lockstep::optim::sgd;
using lockstep::optim::sgd_params;

namespace {
// Runs two steps from w = {1, -2} with g1 = {0.5, 0.25} then g2 = {-0.5, 1}; returns w after
// each step.
template <class T>
std::vector<std::vector<T>> two_steps(sgd_params p) {
    sgd<T> opt(2, p);
    std::vector<T> w{T(1), T(-2)};
    const std::vector<T> g1{T(0.5), T(0.25)}, g2{T(-0.5), T(1)};
    std::vector<std::vector<T>> out;
    opt.step(w, g1);
    out.push_back(w);
    opt.step(w, g2);
    out.push_back(w);
    CHECK(opt.step_count() == 2);
    return out;
}
} // namespace

TEMPLATE_TEST_CASE("sgd: hand-computed steps", "[optim][sgd][host]", float, double) {
    using T = TestType;
    const double tol = sizeof(T) == 4 ? 1e-6 : 1e-14;

    SECTION("plain: w -= lr g") {
        // w1 = {1 - 0.1*0.5, -2 - 0.1*0.25} = {0.95, -2.025};
        // w2 = {0.95 + 0.05, -2.025 - 0.1} = {1.0, -2.125}.
        const auto w = two_steps<T>({.lr = 0.1});
        CHECK(w[0][0] == Approx(0.95).margin(tol).epsilon(0));
        CHECK(w[0][1] == Approx(-2.025).margin(tol).epsilon(0));
        CHECK(w[1][0] == Approx(1.0).margin(tol).epsilon(0));
        CHECK(w[1][1] == Approx(-2.125).margin(tol).epsilon(0));
    }
    SECTION("momentum 0.9 and weight decay 0.1") {
        // step 1: d = g + 0.1 w = {0.6, 0.05}; b = d; w = w - 0.1 b = {0.94, -2.005}.
        // step 2: d = {-0.5 + 0.094, 1 - 0.2005} = {-0.406, 0.7995};
        //         b = 0.9 {0.6, 0.05} + d = {0.134, 0.8445}; w = {0.94 - 0.0134, -2.005 - 0.08445}.
        const auto w = two_steps<T>({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1});
        CHECK(w[0][0] == Approx(0.94).margin(tol).epsilon(0));
        CHECK(w[0][1] == Approx(-2.005).margin(tol).epsilon(0));
        CHECK(w[1][0] == Approx(0.9266).margin(tol).epsilon(0));
        CHECK(w[1][1] == Approx(-2.08945).margin(tol).epsilon(0));
    }
    SECTION("Nesterov momentum 0.9 and weight decay 0.1") {
        // step 1: d = {0.6, 0.05}; b = d; d' = d + 0.9 b = {1.14, 0.095}; w = {0.886, -2.0095}.
        // step 2: d = {-0.5 + 0.0886, 1 - 0.20095} = {-0.4114, 0.79905};
        //         b = {0.54 - 0.4114, 0.045 + 0.79905} = {0.1286, 0.84405};
        //         d' = d + 0.9 b = {-0.29566, 1.558695}; w = {0.915566, -2.1653695}.
        const auto w =
            two_steps<T>({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1, .nesterov = true});
        CHECK(w[0][0] == Approx(0.886).margin(tol).epsilon(0));
        CHECK(w[0][1] == Approx(-2.0095).margin(tol).epsilon(0));
        CHECK(w[1][0] == Approx(0.915566).margin(tol).epsilon(0));
        CHECK(w[1][1] == Approx(-2.1653695).margin(tol).epsilon(0));
    }
    SECTION("dampening 0.5 is not applied on the first step") {
        // step 1: b = g = {0.5, 0.25}; w = {0.95, -2.025}.
        // step 2: b = 0.9 {0.5, 0.25} + 0.5 {-0.5, 1} = {0.2, 0.725}; w = {0.93, -2.0975}.
        const auto w = two_steps<T>({.lr = 0.1, .momentum = 0.9, .dampening = 0.5});
        CHECK(w[0][0] == Approx(0.95).margin(tol).epsilon(0));
        CHECK(w[0][1] == Approx(-2.025).margin(tol).epsilon(0));
        CHECK(w[1][0] == Approx(0.93).margin(tol).epsilon(0));
        CHECK(w[1][1] == Approx(-2.0975).margin(tol).epsilon(0));
    }
}

TEST_CASE("sgd: weight decay skips segments without decay, gaps are untouched",
          "[optim][sgd][host]") {
    // Elements 0-1: decay; 2: gap; 3-4: no decay. lr 0.5, wd 1, g = 0:
    // decayed w = w - 0.5 * (0 + 1 * w) = w / 2; the others keep w.
    const lockstep::tensor_segment segs[] = {{0, 2, true, true}, {3, 2, false, true}};
    sgd<double> opt(5, {.lr = 0.5, .weight_decay = 1.0}, lockstep::host_system{}, segs);
    std::vector<double> w{2, 4, 8, 16, 32}, g(5, 0.0);
    opt.step(w, g);
    CHECK(w == std::vector<double>{1, 2, 8, 16, 32});
}

TEST_CASE("sgd: invalid parameters and sizes throw lockstep::error", "[optim][sgd][host]") {
    using lockstep::errc;
    auto code = [](auto&& f) {
        try {
            f();
        } catch (const lockstep::error& e) {
            return e.code();
        }
        return errc::internal;
    };
    CHECK(code([] { sgd<float>(4, {.lr = -1}); }) == errc::invalid_argument);
    CHECK(code([] { sgd<float>(4, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}); }) ==
          errc::invalid_argument);
    CHECK(code([] { sgd<float>(4, {.nesterov = true}); }) == errc::invalid_argument);
    CHECK(code([] {
              const lockstep::tensor_segment s[] = {{0, 3}, {2, 2}}; // overlap
              sgd<float>(4, {}, lockstep::host_system{}, s);
          }) == errc::invalid_argument);
    CHECK(code([] {
              const lockstep::tensor_segment s[] = {{0, 5}}; // beyond the buffer
              sgd<float>(4, {}, lockstep::host_system{}, s);
          }) == errc::invalid_argument);
    CHECK(code([] {
              sgd<float> opt(4, {.lr = 0.1});
              std::vector<float> w(4), g(3);
              opt.step(w, g);
          }) == errc::shape_mismatch);
    CHECK(code([] { sgd<float>(4).set_lr(std::nan("")); }) == errc::invalid_argument);
}

TEST_CASE("sgd: a bad layout names the optimizer, the segment and the values",
          "[optim][sgd][host]") {
    const lockstep::tensor_segment s[] = {{0, 3}, {2, 2}};
    try {
        const sgd<float> opt(4, {}, lockstep::host_system{}, s);
        FAIL("an overlapping layout was accepted");
    } catch (const lockstep::error& e) {
        const std::string what = e.what();
        CHECK(what.find("sgd: segment 1 starts at 2, before the end of segment 0 (3)") !=
              std::string::npos);
    }
}

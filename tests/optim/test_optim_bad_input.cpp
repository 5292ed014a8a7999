// Optimizer hyperparameters that are non-finite or out of range are refused at construction and
// in set_lr, naming the optimizer, the parameter and its value. SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/sgd.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <limits>
#include <string>

using namespace lockstep;
using namespace lockstep::optim;

using lockstep_test::contains;

namespace {
const double infinity = std::numeric_limits<double>::infinity();
const double not_a_number = std::numeric_limits<double>::quiet_NaN();
template <class F>
std::string message_of(F f) {
    try {
        f();
    } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        return e.what();
    }
    return "no error";
}
} // namespace

TEST_CASE("sgd and lars refuse bad lr, momentum, weight decay", "[optim][host]") {
    for (double lr : {-0.1, infinity, not_a_number}) {
        CAPTURE(lr);
        CHECK(contains(message_of([&] { sgd<float>(4, {.lr = lr}); }), "lr = "));
        CHECK(contains(message_of([&] { lars<float>(4, {.lr = lr}); }), "lr = "));
        sgd<float> s(4);
        CHECK(contains(message_of([&] { s.set_lr(lr); }), "sgd.set_lr"));
        CHECK(s.lr() == 0.01); // unchanged
    }
    for (double mu : {-0.5, 1.5, infinity, not_a_number}) {
        CAPTURE(mu);
        CHECK(contains(message_of([&] { sgd<float>(4, {.momentum = mu}); }), "momentum = "));
        CHECK(contains(message_of([&] { lars<float>(4, {.momentum = mu}); }), "momentum = "));
    }
    for (double wd : {-1.0, infinity, not_a_number}) {
        CAPTURE(wd);
        CHECK(contains(message_of([&] { sgd<float>(4, {.weight_decay = wd}); }), "weight_decay"));
    }
    CHECK(contains(message_of([&] { lars<float>(4, {.eta = infinity}); }), "eta = "));
    CHECK(contains(message_of([&] { lars<float>(4, {.eps = not_a_number}); }), "eps = "));
}

TEST_CASE("adam and lamb refuse bad betas and eps", "[optim][host]") {
    for (double beta : {-0.1, 1.0, 1.5, not_a_number}) {
        CAPTURE(beta);
        CHECK(message_of([&] { adam<float>(4, {.beta1 = beta}); }) != "no error");
        CHECK(message_of([&] { adamw<float>(4, {.beta2 = beta}); }) != "no error");
        CHECK(message_of([&] { lamb<float>(4, {.beta1 = beta}); }) != "no error");
    }
    for (double eps : {0.0, -1e-8, infinity, not_a_number}) {
        CAPTURE(eps);
        CHECK(message_of([&] { adam<float>(4, {.eps = eps}); }) != "no error");
        CHECK(message_of([&] { lamb<float>(4, {.eps = eps}); }) != "no error");
    }
    CHECK(contains(message_of([&] { adam<float>(4, {.eps = infinity}); }), "finite eps > 0"));
    adam<float> a(4);
    CHECK(contains(message_of([&] { a.set_lr(not_a_number); }), "lr = "));
    CHECK(message_of([&] { adam<float>(4, {.lr = 1e-3, .beta1 = 0.0, .eps = 1e-6}); }) ==
          "no error");
}

TEST_CASE("values that are finite in double but not in the step's type are refused",
          "[optim][host]") {
    // eps = 1e-50 is 0 in float: a zero gradient element stepped by 0 / 0 (NaN in the weights).
    CHECK(contains(message_of([&] { adam<float>(4, {.eps = 1e-50}); }),
                   "eps = 1e-50 is 0 or subnormal in the optimizer's 32-bit floating point"));
    CHECK(
        contains(message_of([&] { adamw<float>(4, {.eps = 1e-40}); }), "use at least 1.17549e-38"));
    CHECK(contains(message_of([&] { lamb<float>(4, {.eps = 1e-50}); }), "eps = 1e-50 is 0"));
    CHECK_NOTHROW(adam<double>(4, {.eps = 1e-50})); // a normal double
    CHECK_NOTHROW(adam<float>(4, {.eps = 1e-30}));
    // lr = 1e39 is infinite in float.
    CHECK(contains(message_of([&] { sgd<float>(4, {.lr = 1e39}); }),
                   "lr = 1e+39 is infinite in the optimizer's 32-bit floating point"));
    CHECK(contains(message_of([&] { lars<float>(4, {.weight_decay = 1e39}); }), "weight_decay"));
    CHECK(contains(message_of([&] { lamb<float>(4, {.lr = 1e39}); }), "lr = 1e+39 is infinite"));
    sgd<float> s(4);
    CHECK(contains(message_of([&] { s.set_lr(1e39); }), "sgd.set_lr: lr = 1e+39 is infinite"));
    CHECK(s.lr() == 0.01); // unchanged
    CHECK_NOTHROW(sgd<double>(4, {.lr = 1e39}));
}

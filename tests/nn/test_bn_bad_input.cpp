// batch_norm's constructor and input checks: non-finite or out-of-range eps and momentum,
// channel counts and shapes whose sizes overflow. SPDX-License-Identifier: Apache-2.0
#include "lockstep/nn/batch_norm.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

using namespace lockstep;

using lockstep_test::contains;

namespace {
template <class F>
std::string message_of(F f) {
    try {
        f();
    } catch (const error& e) {
        return e.what();
    }
    return "no error";
}
} // namespace

TEST_CASE("batch_norm refuses non-finite or out-of-range eps and momentum", "[nn][bn]") {
    using layer = nn::batch_norm<float, bn::local, nn::nc>;
    const double inf = std::numeric_limits<double>::infinity();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    // 1e39 is inf and 1e-60 is 0 in float, the layer's precision: refused there, fine in double.
    for (double eps : {inf, nan, 0.0, -1e-5, 1e39, 1e-60}) {
        CAPTURE(eps);
        CHECK(contains(message_of([&] { layer(4, {.eps = eps}); }), "finite eps > 0"));
    }
    for (double eps : {1e39, 1e-60}) {
        CAPTURE(eps);
        CHECK(message_of([&] { nn::batch_norm<double, bn::local, nn::nc>(4, {.eps = eps}); }) ==
              "no error");
    }
    for (double momentum : {-0.1, 1.5, nan}) {
        CAPTURE(momentum);
        CHECK(
            contains(message_of([&] { layer(4, {.momentum = momentum}); }), "0 <= momentum <= 1"));
    }
    CHECK(contains(message_of([&] { layer(0); }), "channels = 0"));
    // 4 * channels values would overflow (2^62 channels).
    CHECK(contains(message_of([&] { layer(std::size_t(1) << 62); }), "overflows"));
    layer fine(4, {.eps = 1e-3, .momentum = 1.0});
    CHECK(fine.channels() == 4);
}

TEST_CASE("batch_norm refuses a shape whose element count overflows", "[nn][bn]") {
    nn::batch_norm<float, bn::local, nn::nc> layer(4);
    // {2^62, 4} has 2^64 elements: 0 after wrapping, which an empty x would match.
    const nn::tensor_shape shape{std::size_t(1) << 62, 4};
    CHECK(shape.elements_overflow());
    CHECK(shape.elements() == static_cast<std::size_t>(-1));
    std::vector<float> y;
    const std::string m = message_of(
        [&] { layer.forward_eval(std::span<const float>(), shape, std::span<float>(y)); });
    CHECK(contains(m, "overflows std::size_t"));
    CHECK(contains(m, "batch_norm.forward_eval"));
}

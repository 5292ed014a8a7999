// What holds when a user compiles lockstep with -ffast-math and LOCKSTEP_ALLOW_FAST_MATH (this
// file and tests/kernels/test_anchored_sum.cpp are compiled so: tests/core/CMakeLists.txt): every
// finiteness test reads the bits (-ffinite-math-only folds std::isfinite, std::isnan and x != x to
// constants), so a non-finite value is still counted, reported with its replica and refused as a
// setting; test_anchored_sum's cases check the anchored sums' bits under the same flags.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/detail/anchored_combine.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/optim/detail/flat_layout.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/detail/anchored_row.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/loss_scaler.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <vector>

using namespace lockstep;

namespace {

// Read at run time, so that no test folds them as constants.
volatile std::uint32_t inf_bits = 0x7f800000u;
volatile std::uint32_t nan_bits = 0x7fc00000u;
float inf_f() {
    return std::bit_cast<float>(static_cast<std::uint32_t>(inf_bits));
}
float nan_f() {
    return std::bit_cast<float>(static_cast<std::uint32_t>(nan_bits));
}

} // namespace

TEST_CASE("this test is compiled with -ffast-math", "[core][fast_math]") {
#if defined(__FAST_MATH__) && defined(LOCKSTEP_ALLOW_FAST_MATH)
    SUCCEED("-ffast-math and LOCKSTEP_ALLOW_FAST_MATH");
#else
    FAIL("tests/core/CMakeLists.txt must compile test_fast_math with -ffast-math");
#endif
}

TEST_CASE("finiteness is read from the bits under -ffast-math", "[core][fast_math]") {
    const float inf = inf_f(), nan = nan_f();
    for (const float x : {inf, -inf, nan, -nan}) {
        CHECK_FALSE(is_finite(x));
        CHECK_FALSE(is_finite(static_cast<double>(x)));
        CHECK(detail::non_finite_fn<float>{}(x) == 1);
        CHECK(detail::non_finite_fn<double>{}(static_cast<double>(x)) == 1);
        CHECK_FALSE(kernels::is_finite_fn{}(x));
    }
    CHECK(is_nan(nan));
    CHECK(is_nan(static_cast<double>(-nan)));
    CHECK_FALSE(is_nan(inf));
    CHECK_FALSE(is_nan(static_cast<double>(-inf)));
    for (const float x : {0.0f, -0.0f, 0x1p-149f, 0x1.fffffep127f}) {
        CHECK(is_finite(x));
        CHECK_FALSE(is_nan(x));
        CHECK(detail::non_finite_fn<float>{}(x) == 0);
    }
}

TEST_CASE("a replica's non-finite loss terms reach its status loss under -ffast-math",
          "[core][fast_math]") {
    const double terms[] = {1.0, static_cast<double>(inf_f()), 2.0, 0.5};
    const double global = 3.0;
    double loss = 0.0;
    detail::status_loss_fn{terms, 4, &global, false, &loss}(0);
    CHECK_FALSE(is_finite(loss)); // the infinite term names this replica
    loss = 0.0;
    detail::status_loss_fn{terms, 1, &global, true, &loss}(0);
    CHECK(loss == 3.0); // finite terms add nothing; replica 0 adds the global loss
}

TEST_CASE("the anchored sums report the group holding a NaN under -ffast-math",
          "[core][fast_math]") {
    const std::size_t n = 24;
    std::vector<float> a(n, 1.0f), b(n, 2.0f);
    b[5] = nan_f();
    b[9] = inf_f();
    const float* src[] = {a.data(), b.data()};
    std::vector<float> out(n);
    std::vector<double> words(kernels::detail::anchored_combine_report::words_for(2), 0.0);
    kernels::detail::anchored_combine_fn<float>{{words.data(), 2, 1, 100}}(src, 2, 0, n,
                                                                           out.data());
    // Group 1 (array b) holds both non-finite values, the first at flat index 100 + 5.
    CHECK(words == std::vector<double>{1, 0, 0, 2, 106});
    CHECK(std::bit_cast<std::uint32_t>(out[5]) == 0x7fc00000u);
    CHECK(std::bit_cast<std::uint32_t>(out[9]) == 0x7fc00000u);
    CHECK(out[0] == 3.0f);
}

TEST_CASE("settings that must be finite refuse infinities under -ffast-math", "[core][fast_math]") {
    loss_scaling c;
    c.init_scale = static_cast<double>(inf_f());
    CHECK_THROWS_AS(loss_scaler<host_system>::check_config(c, 0), lockstep::error);
    CHECK_THROWS_AS(optim::detail::check_param("lars", "eta", static_cast<double>(inf_f()), 0.0),
                    lockstep::error);
    CHECK_THROWS_AS(optim::detail::check_param("lars", "eta", static_cast<double>(nan_f()), 0.0),
                    lockstep::error);
    CHECK_THROWS_AS(parse_timeout_seconds("inf"), lockstep::error);
}

// Learning-rate schedules against hand-computed values. SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/lr_schedule.hpp"

#include <catch2/catch.hpp>

#include <functional>

using namespace lockstep::optim;

static_assert(lr_schedule<constant_lr>);
static_assert(lr_schedule<linear_scaling>);
static_assert(lr_schedule<cosine>);

TEST_CASE("constant_lr", "[optim][lr]") {
    const constant_lr c{.value = 0.25};
    CHECK(c.lr(0) == 0.25);
    CHECK(c.lr(1000000) == 0.25);
    CHECK_THROWS_AS(c.lr(-1), lockstep::error);
}

TEST_CASE("linear scaling rule with warm-up from base_lr (Goyal et al.)", "[optim][lr]") {
    // base 0.1 at batch 256, global batch 8192: k = 32, target 3.2; 5 warm-up steps:
    // increments of (3.2 - 0.1) / 5 = 0.62: 0.1, 0.72, 1.34, 1.96, 2.58, then 3.2.
    const linear_scaling s{
        .base_lr = 0.1, .base_batch = 256, .global_batch = 8192, .warmup_steps = 5};
    CHECK(s.target() == Approx(3.2).epsilon(1e-15));
    const double expected[] = {0.1, 0.72, 1.34, 1.96, 2.58, 3.2, 3.2};
    for (int i = 0; i < 7; ++i)
        CHECK(s.lr(i) == Approx(expected[i]).epsilon(1e-14));
    CHECK(s.lr(1000) == Approx(3.2).epsilon(1e-15));
}

TEST_CASE("linear scaling rule with warm-up from zero", "[optim][lr]") {
    // base 0.1 at 256, global 512: target 0.2; 4 steps from 0: 0, 0.05, 0.1, 0.15, 0.2.
    const linear_scaling s{.base_lr = 0.1,
                           .base_batch = 256,
                           .global_batch = 512,
                           .warmup_steps = 4,
                           .start = warmup_start::zero};
    const double expected[] = {0.0, 0.05, 0.1, 0.15, 0.2, 0.2};
    for (int i = 0; i < 6; ++i)
        CHECK(s.lr(i) == Approx(expected[i]).margin(1e-15).epsilon(0));
    // No warm-up: the target from step 0; a smaller batch scales down (0.1 * 64 / 256).
    CHECK(linear_scaling{.base_lr = 0.1, .global_batch = 64}.lr(0) == Approx(0.025).epsilon(1e-15));
    CHECK_THROWS_AS((linear_scaling{.base_batch = 0}.lr(0)), lockstep::error);
    CHECK_THROWS_AS((linear_scaling{.warmup_steps = -1}.lr(0)), lockstep::error);
    CHECK(scaled_lr(0.1, 1024, 256) == Approx(0.4).epsilon(1e-15));
}

TEST_CASE("cosine decay with warm-up", "[optim][lr]") {
    // Warm-up 2 steps from 0 to 1: 0, 0.5; then cosine from 1 to 0.1 over steps 2..10 (8 steps):
    // lr(2 + j) = 0.1 + 0.9 (1 + cos(pi j / 8)) / 2: j = 0: 1; j = 2: 0.1 + 0.45 (1 + sqrt(2)/2)
    // = 0.86819805...; j = 4: 0.55; j = 6: 0.1 + 0.45 (1 - sqrt(2)/2) = 0.23180194...;
    // step >= 10: 0.1.
    const cosine c{.base_lr = 1.0, .final_lr = 0.1, .total_steps = 10, .warmup_steps = 2};
    CHECK(c.lr(0) == 0.0);
    CHECK(c.lr(1) == Approx(0.5).epsilon(1e-15));
    CHECK(c.lr(2) == Approx(1.0).epsilon(1e-15));
    CHECK(c.lr(4) == Approx(0.86819805153394639).epsilon(1e-14));
    CHECK(c.lr(6) == Approx(0.55).epsilon(1e-14));
    CHECK(c.lr(8) == Approx(0.23180194846605361).epsilon(1e-14));
    CHECK(c.lr(10) == 0.1);
    CHECK(c.lr(100) == 0.1);
    // Without warm-up: half way is the mean of base and final.
    const cosine plain{.base_lr = 0.4, .final_lr = 0.0, .total_steps = 100};
    CHECK(plain.lr(0) == 0.4);
    CHECK(plain.lr(50) == Approx(0.2).epsilon(1e-14));
    CHECK_THROWS_AS((cosine{.total_steps = 5, .warmup_steps = 5}.lr(0)), lockstep::error);
}

TEST_CASE("schedules are callable as std::function<double(int64_t)>", "[optim][lr]") {
    const std::function<double(std::int64_t)> f = cosine{.base_lr = 2.0, .total_steps = 4};
    CHECK(f(0) == 2.0);
    CHECK(f(2) == Approx(1.0).epsilon(1e-14));
}

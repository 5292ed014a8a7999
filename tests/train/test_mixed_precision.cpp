// Mixed precision: the 16-bit casts, the dynamic loss scaler (unit behaviour, identical decisions
// on every replica when one replica overflows, no host synchronisation added to a step), and
// training in half / bfloat16 against float training within a bound derived from the 16-bit unit
// roundoff. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/train/checkpoint.hpp"
#include "lockstep/train/compute_copy.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/loss_scaler.hpp"

#include "checkpoint_support.hpp"
#include "mixed_fixture.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

using namespace lockstep;
using namespace lockstep_test;

namespace {

using comm_type = thread_communicator;
using ctx_type = replica_context<float, comm_type>;

template <class Compute, class Sync = sync::synchronous, class Reduce = reduce::per_tensor>
using trainer_t = data_parallel<linreg<Compute>, optim::sgd<float>, Sync, Reduce, comm_type>;

/// What one replica saw of a run.
struct record {
    std::vector<std::vector<float>> weights; ///< before step 0, after each step
    std::vector<bool> skipped;
    std::vector<double> scales;       ///< step_result::loss_scale
    std::vector<double> ctx_scales;   ///< ctx.loss_scale() in the step function
    std::vector<std::uint64_t> syncs; ///< host synchronisations per step
    std::vector<double> losses;
    loss_scaler_state state{};
    std::string error;
};

struct run_options {
    int replicas = 3;
    int steps = 30;
    std::optional<loss_scaling> scaling = {};
    bool read_result = true;
    bool skip_non_finite = true;
    std::set<std::pair<int, int>> poison = {};      ///< (step, replica): an infinite gradient
    std::set<std::pair<int, int>> poison_loss = {}; ///< (step, replica): a NaN loss
    double weight = 1.0; ///< loss weight (the learning rate is lr / weight: the same dynamics)
};

/// Runs `steps` full-batch steps on `replicas` thread replicas; returns every replica's record.
template <class Compute, class Sync = sync::synchronous, class Reduce = reduce::per_tensor>
std::vector<record> run(const run_options& o) {
    std::vector<record> recs(static_cast<std::size_t>(o.replicas));
    thread_group group(o.replicas, {.timeout = std::chrono::seconds(60)});
    group.run([&](comm_type& comm) {
        record& rec = recs[static_cast<std::size_t>(comm.rank())];
        try {
            trainer_t<Compute, Sync, Reduce> trainer(
                comm, [](ctx_type& ctx) { return linreg<Compute>(ctx); }, {.lr = lr / o.weight},
                {.skip_non_finite = o.skip_non_finite,
                 .read_result = o.read_result,
                 .loss_scale = o.scaling});
            auto snap = [&] {
                const auto p = trainer.parameters();
                rec.weights.emplace_back(p.begin(), p.end());
            };
            snap();
            for (int k = 0; k < o.steps; ++k) {
                trainer.network().poison = o.poison.count({k, comm.rank()}) != 0;
                trainer.network().poison_loss = o.poison_loss.count({k, comm.rank()}) != 0;
                trainer.network().weight = o.weight;
                const auto before = host_sync_count();
                step_result r =
                    trainer.step(n_samples, [](linreg<Compute>& net, shard_range sr,
                                               ctx_type& ctx) { return net.train(sr, ctx); });
                rec.syncs.push_back(host_sync_count() - before);
                if (!r.ready)
                    r = trainer.read_result();
                rec.skipped.push_back(r.skipped);
                rec.scales.push_back(r.loss_scale);
                rec.losses.push_back(r.loss);
                snap();
            }
            trainer.finish();
            rec.ctx_scales = trainer.network().scales_seen;
            rec.state = trainer.scaler().state();
        } catch (const error& e) {
            rec.error = e.what();
        }
    });
    return recs;
}

/// GradScaler's rule on the host, as an independent reference.
struct scaler_model {
    loss_scaling c;
    double scale = c.init_scale;
    std::int64_t tracker = 0;
    /// Returns the scale the step used.
    double step(bool overflow) {
        const double used = scale;
        if (overflow) {
            scale *= c.backoff_factor;
            tracker = 0;
        } else if (++tracker >= c.growth_interval) {
            scale *= c.growth_factor;
            tracker = 0;
        }
        return used;
    }
};

// ---------------------------------------------------------------------------------------------
// The bound. Every value v stored in a 16-bit format is off by at most rho(v) = u |v| + tau
// (u: unit roundoff, 2^-11 half / 2^-8 bfloat16; tau: half the smallest subnormal, 2^-25
// lockstep::half, 2^-134 bfloat16); float arithmetic adds relative errors of 2^-24 per operation.
// Following one gradient element g_ok = (1/N) sum_s r_so x_sk through the 16-bit path of linreg
// (weights, inputs, output, seed and gradient each rounded once; products accumulated in float):
//   |dy_so|  <= (3u + I 2^-24) P_so + tau (sum_k |w_ok| + sum_k |x_sk| + 1) + 2^-24 |r_so|,
//               P_so = sum_k |w_ok x_sk|   (w and x rounded: 2u P, y stored: u |y| <= u P)
//   |e_ok|   <= (1/N) sum_s [ |x_sk| (|dy_so| + (3u + (n + 2) 2^-24) |r_so|) + tau |r_so| ]
//               + tau (sum_s |x_sk| + R) / S
//               (seed rounded, x rounded, the stored gradient rounded: 3u |r x|; the seed's and
//               the stored gradient's subnormal error divided by the scale S; n = samples per
//               replica, R replicas)
// to first order; second-order terms are covered by a factor (1 + 8u). The float run has the
// same bound with u = 2^-24 (its "16-bit" roundings are exact, so this overestimates it).
// Gradient descent on this quadratic loss, W <- W - lr grad, maps a difference of weights D to
// (I - lr H) D exactly, H = X^T X / N, whose norm is c = max |1 - lr lambda| over H's eigenvalues
// (computed by Jacobi rotations; c < 1 is checked): with D_k the Frobenius distance between the
// two runs after k applied steps,
//   D_{k+1} <= c D_k + lr (||E16_k|| + ||E32_k||) + 2^-23 ||W_{k+1}||   (the update's roundings)
// where E is evaluated at the float run's weights with |r| and P widened by D_k ||x_s|| and
// D_k sum|x| (the 16-bit run's weights are within D_k). The final losses differ by at most
// ||grad L(W32)|| D + lambda_max D^2 / 2.

struct precision {
    double u, tau;
};
constexpr precision half_precision{1.0 / 2048, 1.0 / 33554432.0}; // 2^-11, 2^-25
constexpr precision bfloat16_precision{1.0 / 256, 0x1p-134};      // 2^-8, 2^-134
constexpr precision float_precision{1.0 / 16777216.0, 0x1p-150};  // 2^-24, 2^-150

double frobenius(const std::vector<double>& a) {
    double s = 0;
    for (const double v : a)
        s += v * v;
    return std::sqrt(s);
}

/// ||E||_F of the gradient error at weights W widened by D (see above).
double gradient_error(const std::vector<float>& W, double D, precision p, double S, int R) {
    const double u = p.u, tau = p.tau, e24 = 1.0 / 16777216.0;
    const double n = std::ceil(double(n_samples) / R);
    std::vector<double> e(n_out * n_in, 0.0);
    for (std::size_t s = 0; s < n_samples; ++s) {
        double sumx = 0, norm2 = 0;
        for (std::size_t k = 0; k < n_in; ++k) {
            sumx += std::fabs(x_of(s, k));
            norm2 += x_of(s, k) * x_of(s, k);
        }
        for (std::size_t o = 0; o < n_out; ++o) {
            double y = 0, P = 0, sumw = 0;
            for (std::size_t k = 0; k < n_in; ++k) {
                y += double(W[o * n_in + k]) * x_of(s, k);
                P += std::fabs(double(W[o * n_in + k]) * x_of(s, k));
                sumw += std::fabs(double(W[o * n_in + k]));
            }
            const double r = std::fabs(y - t_of(s, o)) + D * std::sqrt(norm2);
            P += D * sumx;
            sumw += double(n_in) * D;
            const double dy = (3 * u + n_in * e24) * P + tau * (sumw + sumx + 1) + e24 * r;
            for (std::size_t k = 0; k < n_in; ++k)
                e[o * n_in + k] +=
                    (std::fabs(x_of(s, k)) * (dy + (3 * u + (n + 2) * e24) * r) + tau * r) /
                        double(n_samples) +
                    tau * std::fabs(x_of(s, k)) / S;
        }
    }
    for (double& v : e)
        v = (v + tau * R / S) * (1 + 8 * u);
    return frobenius(e);
}

/// The extreme eigenvalues {min, max} of the loss's Hessian X^T X / N (per output row), by
/// cyclic Jacobi rotations in double (converged to ~1e-15 relative).
std::pair<double, double> hessian_eigenvalues() {
    double a[n_in][n_in] = {};
    for (std::size_t s = 0; s < n_samples; ++s)
        for (std::size_t i = 0; i < n_in; ++i)
            for (std::size_t j = 0; j < n_in; ++j)
                a[i][j] += x_of(s, i) * x_of(s, j) / double(n_samples);
    for (int sweep = 0; sweep < 60; ++sweep)
        for (std::size_t p = 0; p < n_in; ++p)
            for (std::size_t q = p + 1; q < n_in; ++q) {
                if (std::fabs(a[p][q]) < 1e-300)
                    continue;
                const double theta = (a[q][q] - a[p][p]) / (2 * a[p][q]);
                const double t =
                    (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
                const double c = 1 / std::sqrt(t * t + 1), sn = t * c;
                for (std::size_t k = 0; k < n_in; ++k) { // A <- A J
                    const double akp = a[k][p], akq = a[k][q];
                    a[k][p] = c * akp - sn * akq;
                    a[k][q] = sn * akp + c * akq;
                }
                for (std::size_t k = 0; k < n_in; ++k) { // A <- J^T A
                    const double apk = a[p][k], aqk = a[q][k];
                    a[p][k] = c * apk - sn * aqk;
                    a[q][k] = sn * apk + c * aqk;
                }
            }
    double lo = a[0][0], hi = a[0][0];
    for (std::size_t i = 1; i < n_in; ++i) {
        lo = std::min(lo, a[i][i]);
        hi = std::max(hi, a[i][i]);
    }
    return {lo, hi};
}

/// ||I - lr H||_2: the factor by which a gradient descent step scales a difference of weights.
double contraction() {
    const auto [lo, hi] = hessian_eigenvalues();
    return std::max(std::fabs(1 - lr * lo), std::fabs(1 - lr * hi));
}

/// The loss (1/2N) sum ||W x - t||^2 in double, and its gradient's norm.
std::pair<double, double> loss_and_grad(const std::vector<float>& W) {
    double L = 0;
    std::vector<double> g(n_out * n_in, 0.0);
    for (std::size_t s = 0; s < n_samples; ++s)
        for (std::size_t o = 0; o < n_out; ++o) {
            double y = -t_of(s, o);
            for (std::size_t k = 0; k < n_in; ++k)
                y += double(W[o * n_in + k]) * x_of(s, k);
            L += 0.5 * y * y / n_samples;
            for (std::size_t k = 0; k < n_in; ++k)
                g[o * n_in + k] += y * x_of(s, k) / n_samples;
        }
    return {L, frobenius(g)};
}

/// The bound on the distance after `steps` applied steps, along the float run's weights.
double distance_bound(const std::vector<std::vector<float>>& float_weights, int steps, precision p,
                      double S, int R) {
    double D = 0;
    for (int k = 0; k < steps; ++k) {
        const auto& W = float_weights[static_cast<std::size_t>(k)];
        std::vector<double> next(float_weights[static_cast<std::size_t>(k) + 1].begin(),
                                 float_weights[static_cast<std::size_t>(k) + 1].end());
        D = contraction() * D +
            lr * (gradient_error(W, D, p, S, R) + gradient_error(W, D, float_precision, 1.0, R)) +
            2.0 / 16777216.0 * (frobenius(next) + D);
    }
    return D;
}

double distance(const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<double> d(a.size());
    for (std::size_t i = 0; i < a.size(); ++i)
        d[i] = double(a[i]) - double(b[i]);
    return frobenius(d);
}

void require_same_everywhere(const std::vector<record>& recs) {
    for (const record& r : recs) {
        INFO(r.error);
        REQUIRE(r.error.empty());
        CHECK(r.weights == recs[0].weights);
        CHECK(r.skipped == recs[0].skipped);
        CHECK(r.scales == recs[0].scales);
        CHECK(r.state == recs[0].state);
    }
}

} // namespace

// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("16-bit casts give the scalar conversions' bits; accumulate_up adds exactly",
                   "[train][mixed]", lockstep::half, bfloat16) {
    const host_system sys{2};
    std::vector<float> src;
    for (int i = -300; i < 9000; ++i) // 9300 values: more than two host tiles
        src.push_back(std::ldexp(1.0f + 0.37f * float(i % 7), i % 40 - 20) * (i % 2 ? -1 : 1));
    src.push_back(std::numeric_limits<float>::infinity());
    src.push_back(std::numeric_limits<float>::quiet_NaN());
    src.push_back(1e-7f);    // half subnormal
    src.push_back(70000.0f); // overflows half
    buffer<TestType> low(src.size(), sys);
    kernels::cast_down(sys, std::span<const float>(src), low.span());
    std::vector<float> acc(src.size(), 1.0f);
    const double factor = 0.25;
    kernels::accumulate_up(sys, std::span<const TestType>(low.span()), std::span<float>(acc),
                           &factor);
    for (std::size_t i = 0; i < src.size(); ++i) {
        INFO(i << ": " << src[i]);
        REQUIRE(low[i].bits == TestType(src[i]).bits);
        const float want = 1.0f + static_cast<float>(low[i]) * 0.25f;
        if (std::isnan(want))
            CHECK(std::isnan(acc[i]));
        else
            CHECK(acc[i] == want);
    }
    std::vector<double> d{1.0, -3.0, 0.5};
    const double inv = 0.125;
    kernels::multiply_by(sys, std::span<double>(d), &inv);
    CHECK(d == std::vector<double>{0.125, -0.375, 0.0625});
}

TEST_CASE("loss_scaler: backoff on overflow, growth after the interval, state round trip",
          "[train][mixed]") {
    const host_system sys{1};
    const loss_scaling cfg{
        .init_scale = 1024, .growth_factor = 4, .backoff_factor = 0.25, .growth_interval = 3};
    loss_scaler<host_system> s(cfg, sys);
    REQUIRE(s.enabled());
    CHECK(s.state() == loss_scaler_state{1024, 0});
    CHECK(*s.scale_device() == 1024);
    CHECK(*s.inverse_device() == 1.0 / 1024);
    double non_finite = 0, skip = 0;
    kernels::loss_scale_record report{-1, -1, -1};
    auto step = [&](double overflow, double skipped) {
        non_finite = overflow;
        skip = skipped;
        s.update(&non_finite, &skip, &report);
        return s.observe(report, true);
    };
    // Two good steps: the tracker counts; the third grows the scale and resets it.
    CHECK(step(0, 0).next == loss_scaler_state{1024, 1});
    CHECK(step(0, 0).next == loss_scaler_state{1024, 2});
    loss_scale_report r = step(0, 0);
    CHECK(r.used == 1024);
    CHECK(r.next == loss_scaler_state{4096, 0});
    CHECK(s.known_scale() == 4096.0);
    // Good, then an overflow: backoff, tracker reset.
    CHECK(step(0, 0).next == loss_scaler_state{4096, 1});
    r = step(5, 1);
    CHECK(r.used == 4096);
    CHECK(r.next == loss_scaler_state{1024, 0});
    // Skipped for another reason (a layer error, a non-finite loss): nothing changes.
    CHECK(step(0, 0).next == loss_scaler_state{1024, 1});
    CHECK(step(0, 1).next == loss_scaler_state{1024, 1});
    CHECK(*s.inverse_device() == 1.0 / 1024);
    // Round trip through a fresh scaler.
    const loss_scaler_state saved = s.state();
    loss_scaler<host_system> t(cfg, sys);
    t.restore(saved);
    CHECK(t.state() == saved);
    CHECK(*t.inverse_device() == 1.0 / 1024);
    // The restored scaler continues exactly as the original.
    kernels::loss_scale_record report2{};
    non_finite = 0;
    skip = 0;
    s.update(&non_finite, &skip, &report);
    t.update(&non_finite, &skip, &report2);
    CHECK(std::bit_cast<std::array<double, 3>>(report) ==
          std::bit_cast<std::array<double, 3>>(report2));
    CHECK(t.state() == loss_scaler_state{1024, 2});
    // Invalid states and knobs are refused, naming the values; a refused restore changes nothing.
    CHECK_THROWS_WITH(t.restore({0.0, 0}), Catch::Contains("scale = 0"));
    CHECK_THROWS_WITH(t.restore({std::numeric_limits<double>::infinity(), 0}),
                      Catch::Contains("must be finite"));
    CHECK_THROWS_WITH(t.restore({8, 3}), Catch::Contains("growth_tracker = 3"));
    CHECK(t.state() == loss_scaler_state{1024, 2});
    CHECK_THROWS_WITH(loss_scaler<host_system>(loss_scaling{.growth_factor = 1}, sys, 2),
                      Catch::Contains("replica 2") && Catch::Contains("growth_factor = 1"));
    CHECK_THROWS_WITH(loss_scaler<host_system>(loss_scaling{.backoff_factor = 1}, sys),
                      Catch::Contains("backoff_factor = 1"));
    CHECK_THROWS_WITH(loss_scaler<host_system>(loss_scaling{.init_scale = -1}, sys),
                      Catch::Contains("init_scale = -1"));
    CHECK_THROWS_WITH(loss_scaler<host_system>(loss_scaling{.growth_interval = 0}, sys),
                      Catch::Contains("growth_interval = 0"));
    // Growth stops at max_scale: float's bound by default, double's when given.
    static_assert(max_loss_scale<float>() == 0x1p126 && max_loss_scale<double>() == 0x1p1022);
    loss_scaler<host_system> big(loss_scaling{.init_scale = 0x1p126, .growth_interval = 1}, sys);
    CHECK(big.max_scale() == 0x1p126);
    skip = 0;
    big.update(&non_finite, &skip, &report);
    CHECK(big.state() == loss_scaler_state{0x1p126, 0});
    CHECK(*big.inverse_device() == 0x1p-126);
    loss_scaler<host_system> wide(loss_scaling{.init_scale = 0x1p1021, .growth_interval = 1}, sys,
                                  -1, max_loss_scale<double>());
    wide.update(&non_finite, &skip, &report);
    wide.update(&non_finite, &skip, &report);
    CHECK(wide.state() == loss_scaler_state{0x1p1022, 0});
    // A scale past the bound, or a floor below its inverse, is refused, naming both values.
    CHECK_THROWS_WITH(loss_scaler<host_system>(loss_scaling{.init_scale = 0x1p127}, sys, 1),
                      Catch::Contains("replica 1") &&
                          Catch::Contains("init_scale = 1.70141e+38 is above the largest loss "
                                          "scale 8.50706e+37 = 2^126"));
    CHECK_THROWS_WITH(
        loss_scaler<host_system>(loss_scaling{.min_scale = 0x1p-127}, sys),
        Catch::Contains("min_scale = 5.87747e-39 is below the smallest loss scale 1.17549e-38 = "
                        "2^-126"));
    CHECK_THROWS_WITH(loss_scaler<host_system>(std::nullopt, sys, 0, 3.0),
                      Catch::Contains("max_scale = 3 (must be a power of two"));
    // Disabled: scale 1 forever, update does nothing.
    loss_scaler<host_system> off(std::nullopt, sys);
    CHECK(!off.enabled());
    non_finite = 3;
    off.update(&non_finite, &skip, &report);
    CHECK(off.state() == loss_scaler_state{1, 0});
    CHECK(off.observe(report, true).used == 1.0);
    CHECK_THROWS_WITH(off.restore({2, 0}), Catch::Contains("loss scaling is off but the state has "
                                                           "scale = 2"));
}

TEMPLATE_TEST_CASE("an overflow on ONE replica skips the step and backs off the scale on every "
                   "replica",
                   "[train][mixed][thread]", reduce::per_tensor, reduce::parameter_server<0>,
                   reduce::compressed<lockstep::half>) {
    // parameter_server<0>: only replica 0 holds the reduced gradient, so replica 1's overflow
    // reaches replica 2 through the summed status alone.
    const loss_scaling cfg{.init_scale = 1024, .growth_interval = 2};
    for (const bool read_each : {true, false}) {
        run_options o{.replicas = 3,
                      .steps = 9,
                      .scaling = cfg,
                      .read_result = read_each,
                      .skip_non_finite = false, // overflows skip under loss scaling regardless
                      .poison = {{1, 1}, {2, 2}, {5, 1}}};
        const auto recs = run<lockstep::half, sync::synchronous, TestType>(o);
        require_same_everywhere(recs);
        scaler_model model{cfg};
        std::vector<bool> want_skip;
        std::vector<double> want_scale;
        for (int k = 0; k < o.steps; ++k) {
            const bool overflow = k == 1 || k == 2 || k == 5;
            want_skip.push_back(overflow);
            want_scale.push_back(model.step(overflow));
        }
        CHECK(recs[0].skipped == want_skip);
        CHECK(recs[0].scales == want_scale);
        CHECK(recs[0].state == loss_scaler_state{model.scale, model.tracker});
        for (const record& r : recs) {
            CHECK(r.ctx_scales == want_scale); // ctx.loss_scale() is known on a host system
            // A skipped step leaves the weights alone; an applied one changes them.
            for (int k = 0; k < o.steps; ++k)
                CHECK((r.weights[std::size_t(k) + 1] == r.weights[std::size_t(k)]) ==
                      want_skip[std::size_t(k)]);
        }
    }
}

TEST_CASE("under loss scaling a non-finite loss still throws with skip_non_finite = false",
          "[train][mixed][thread]") {
    // The scale multiplies the backward seed, never the loss: a NaN loss is no overflow, so
    // skip_non_finite = false must throw for it as without scaling (it used to skip silently).
    const loss_scaling cfg{.init_scale = 1024, .growth_interval = 2};
    for (const bool read_each : {true, false}) {
        CAPTURE(read_each);
        const auto recs = run<lockstep::half>({.replicas = 3,
                                               .steps = 4,
                                               .scaling = cfg,
                                               .read_result = read_each,
                                               .skip_non_finite = false,
                                               .poison_loss = {{2, 1}}});
        for (const record& r : recs) {
            INFO(r.error);
            CHECK(lockstep_test::contains(r.error, "[non_finite]"));
            CHECK(lockstep_test::contains(r.error, "step 2: "));
            CHECK(r.skipped == std::vector<bool>{false, false});
        }
        // With skipping on, the same step is skipped and the scale does not back off.
        const auto skipping = run<lockstep::half>(
            {.replicas = 3, .steps = 4, .scaling = cfg, .poison_loss = {{2, 1}}});
        require_same_everywhere(skipping);
        CHECK(skipping[0].error.empty());
        CHECK(skipping[0].skipped == std::vector<bool>{false, false, true, false});
        CHECK(skipping[0].scales == std::vector<double>{1024, 1024, 2048, 2048});
    }
}

TEST_CASE("local SGD: the loss scale is per replica (only the replica that overflows backs off)",
          "[train][mixed][thread]") {
    const loss_scaling cfg{.init_scale = 256, .growth_interval = 100};
    const auto recs = run<lockstep::half, sync::local_sgd<4>>(
        {.replicas = 2, .steps = 3, .scaling = cfg, .poison = {{1, 1}}});
    for (const record& r : recs)
        REQUIRE(r.error.empty());
    CHECK(recs[0].skipped == std::vector<bool>{false, false, false});
    CHECK(recs[1].skipped == std::vector<bool>{false, true, false});
    CHECK(recs[0].state == loss_scaler_state{256, 3});
    CHECK(recs[1].state == loss_scaler_state{128, 1});
}

TEST_CASE("with loss scaling a step still waits on the host once, or never with read_result off",
          "[train][mixed][thread]") {
    const loss_scaling cfg{.init_scale = 1024, .growth_interval = 2};
    const auto waiting =
        run<lockstep::half>({.replicas = 2, .steps = 4, .scaling = cfg, .poison = {{1, 0}}});
    const auto deferred = run<lockstep::half>(
        {.replicas = 2, .steps = 4, .scaling = cfg, .read_result = false, .poison = {{1, 0}}});
    const auto unscaled = run<lockstep::half>({.replicas = 2, .steps = 4, .poison = {{1, 0}}});
    for (const auto* recs : {&waiting, &deferred, &unscaled})
        require_same_everywhere(*recs);
    CHECK(waiting[0].syncs == std::vector<std::uint64_t>(4, 1));
    CHECK(unscaled[0].syncs == std::vector<std::uint64_t>(4, 1));
    CHECK(deferred[0].syncs == std::vector<std::uint64_t>(4, 0));
    CHECK(deferred[0].weights == waiting[0].weights);
    CHECK(deferred[0].scales == waiting[0].scales);
    CHECK(waiting[0].skipped == std::vector<bool>{false, true, false, false});
    CHECK(waiting[0].scales == std::vector<double>{1024, 1024, 512, 512});
    CHECK(unscaled[0].scales == std::vector<double>(4, 1.0));
}

TEST_CASE("loss scaling by a power of two is exact: float training is bitwise unchanged",
          "[train][mixed][thread]") {
    const auto plain = run<float>({.replicas = 3, .steps = 12});
    const auto scaled =
        run<float>({.replicas = 3,
                    .steps = 12,
                    .scaling = loss_scaling{.init_scale = 4096, .growth_interval = 5}});
    require_same_everywhere(plain);
    require_same_everywhere(scaled);
    CHECK(scaled[0].weights == plain[0].weights);
    CHECK(scaled[0].losses == plain[0].losses);
    CHECK(scaled[0].scales.back() == 4096.0 * 4); // grown twice (after steps 5 and 10)
}

namespace {

/// Trains in Compute for `steps`, the float run for the applied steps, and checks the final
/// weights and loss against the bound. Returns the 16-bit run's record.
template <class Compute>
record check_against_float(precision p, std::optional<loss_scaling> scaling, int steps,
                           int expect_skipped_min, double weight = 1.0) {
    constexpr int replicas = 3;
    const auto low =
        run<Compute>({.replicas = replicas, .steps = steps, .scaling = scaling, .weight = weight});
    require_same_everywhere(low);
    const record& r = low[0];
    int skipped = 0;
    while (skipped < steps && r.skipped[std::size_t(skipped)])
        ++skipped;
    for (int k = skipped; k < steps; ++k) // overflows happen only at the start
        REQUIRE(!r.skipped[std::size_t(k)]);
    REQUIRE(skipped >= expect_skipped_min);
    const int applied = steps - skipped;
    REQUIRE(applied >= 20);
    const auto flt = run<float>({.replicas = replicas, .steps = applied, .weight = weight});
    require_same_everywhere(flt);
    const double S = r.scales.back();
    REQUIRE(contraction() < 1.0);
    // The loss weight scales the seed and the gradient like the loss scale does (and the
    // learning rate undoes it): the subnormal terms see S * weight.
    const double B = distance_bound(flt[0].weights, applied, p, S * weight, replicas);
    const std::vector<float>& w16 = r.weights.back();
    const std::vector<float>& w32 = flt[0].weights.back();
    const double D = distance(w16, w32);
    const auto [L16, g16] = loss_and_grad(w16);
    const auto [L32, g32] = loss_and_grad(w32);
    const auto [L0, g0] = loss_and_grad(flt[0].weights.front());
    INFO("distance " << D << ", bound " << B << ", losses " << L16 << " vs " << L32 << " (start "
                     << L0 << "), skipped " << skipped << ", final scale " << S);
    CHECK(D <= B);
    CHECK(std::fabs(L16 - L32) <= g32 * B + 0.5 * hessian_eigenvalues().second * B * B);
    // The test can fail: the 16-bit run is not the float run, training made progress, and the
    // bound is small against the distance the weights travelled.
    CHECK(D > 0);
    CHECK(L32 < 0.2 * L0);
    CHECK(B < 0.1 * distance(w32, flt[0].weights.front()));
    return r;
}

} // namespace

TEST_CASE("float training whose loss scale would pass 2^150 stays bitwise unchanged, the scale "
          "stopping at 2^126",
          "[train][mixed][thread]") {
    // Growing every step from 2^120, the scale would pass 2^150 at step 30, where 1 / S rounds
    // to 0 in float: every unscaled gradient would be 0. The loss weight 2^-64 (and lr * 2^64)
    // keeps the scaled gradients finite up to S = 2^160, so nothing overflows either way.
    const double weight = 0x1p-64;
    const auto plain = run<float>({.replicas = 3, .steps = 40, .weight = weight});
    const auto scaled =
        run<float>({.replicas = 3,
                    .steps = 40,
                    .scaling = loss_scaling{.init_scale = 0x1p120, .growth_interval = 1},
                    .weight = weight});
    require_same_everywhere(plain);
    require_same_everywhere(scaled);
    CHECK(scaled[0].skipped == std::vector<bool>(40, false));
    for (std::size_t k = 0; k < scaled[0].scales.size(); ++k) {
        CAPTURE(k);
        CHECK(scaled[0].scales[k] == std::ldexp(1.0, std::min(120 + int(k), 126)));
    }
    CHECK(scaled[0].state == loss_scaler_state{0x1p126, 0});
    CHECK(scaled[0].weights == plain[0].weights);
    CHECK(scaled[0].losses == plain[0].losses);
    CHECK(plain[0].weights.back() != plain[0].weights.front()); // it trained
}

TEST_CASE("loss_scaler.restore: a scale below min_scale starts at min_scale, one above the "
          "largest at the largest",
          "[train][mixed]") {
    const host_system sys{1};
    loss_scaler<host_system> s(
        loss_scaling{.init_scale = 4096, .growth_interval = 100, .min_scale = 1024}, sys);
    s.restore({2.0, 7}); // e.g. saved with min_scale 1, resumed with min_scale 1024
    CHECK(s.state() == loss_scaler_state{1024, 0});
    CHECK(*s.inverse_device() == 1.0 / 1024);
    s.restore({2048, 7}); // within the bounds: as given
    CHECK(s.state() == loss_scaler_state{2048, 7});
    s.restore({0x1p150, 7}); // saved before the scale was bounded
    CHECK(s.state() == loss_scaler_state{0x1p126, 0});
    CHECK(*s.inverse_device() == 0x1p-126);
    // At the floor an overflow keeps the scale.
    s.restore({1.0, 0});
    double overflow = 1, skipped = 1;
    kernels::loss_scale_record report{};
    s.update(&overflow, &skipped, &report);
    CHECK(report.used == 1024);
    CHECK(s.state() == loss_scaler_state{1024, 0});
}

TEST_CASE("training in bfloat16 stays within the unit-roundoff bound of float training",
          "[train][mixed][thread]") {
    check_against_float<bfloat16>(bfloat16_precision, std::nullopt, 30, 0);
}

TEST_CASE("training in half with loss scaling stays within the unit-roundoff bound of float "
          "training",
          "[train][mixed][thread]") {
    const record r = check_against_float<lockstep::half>(
        half_precision, loss_scaling{.init_scale = 1024, .growth_interval = 1000}, 30, 0);
    CHECK(r.scales == std::vector<double>(30, 1024.0));
}

TEST_CASE("half with a huge initial scale: the first steps overflow and are skipped, then "
          "training proceeds within the bound",
          "[train][mixed][thread]") {
    const loss_scaling cfg{.init_scale = 16777216.0, .growth_interval = 1000}; // 2^24
    const record r = check_against_float<lockstep::half>(half_precision, cfg, 40, 1);
    // Halved once per skipped step, then constant.
    double s = cfg.init_scale;
    for (std::size_t k = 0; k < r.scales.size(); ++k) {
        CHECK(r.scales[k] == s);
        if (r.skipped[k])
            s *= 0.5;
    }
    CHECK(r.state.scale == s);
}

TEST_CASE("the asynchronous trainers refuse loss scaling on every replica",
          "[train][mixed][thread]") {
    std::vector<std::string> errors(2);
    thread_group group(2, {.timeout = std::chrono::seconds(30)});
    group.run([&](comm_type& comm) {
        try {
            data_parallel<linreg<float>, optim::sgd<float>, sync::asynchronous> trainer(
                comm, [](ctx_type& ctx) { return linreg<float>(ctx); }, {.lr = lr},
                {.loss_scale = loss_scaling{}});
        } catch (const error& e) {
            errors[static_cast<std::size_t>(comm.rank())] = e.what();
        }
    });
    for (const std::string& e : errors) {
        CHECK(e.find("unsupported") != std::string::npos);
        CHECK(e.find("train_params::loss_scale is not supported") != std::string::npos);
    }
}

TEST_CASE("a loss too small for half: without scaling its gradients underflow to zero, with "
          "scaling it trains within the bound of float training",
          "[train][mixed][thread]") {
    // Seeds ~ 2^-24 r / 48: below half the smallest half subnormal (2^-25) for |r| < 24.
    const double weight = std::ldexp(1.0, -24);
    const auto plain = run<lockstep::half>({.replicas = 3, .steps = 10, .weight = weight});
    require_same_everywhere(plain);
    for (const auto& w : plain[0].weights) // every gradient flushed to zero: no training
        CHECK(w == plain[0].weights.front());
    const record r = check_against_float<lockstep::half>(
        half_precision, loss_scaling{.init_scale = 16777216.0, .growth_interval = 1000}, 30, 0,
        weight);
    CHECK(r.scales == std::vector<double>(30, 16777216.0));
}

// A network's compute_copy outlives a load_checkpoint on the same trainer. Loading another run's
// checkpoint made at a step the copy was already cast for (here step 2, after the trainer
// computed step 2 with its own weights) must not keep the copy of the replaced weights: the
// next step computes with the loaded weights, as a fresh trainer that loads the same checkpoint.
TEST_CASE("a load that returns to a step the 16-bit copy was cast for recasts it",
          "[train][mixed][checkpoint]") {
    using net_type = linreg<lockstep::half>;
    temp_dir dir("mixed");
    const auto path = dir.path / "other.ckpt";
    const auto step = [](auto& trainer, double weight) {
        trainer.network().weight = weight;
        (void)trainer.step(n_samples, [](net_type& net, shard_range sr, ctx_type& ctx) {
            return net.train(sr, ctx);
        });
    };
    const auto make = [](comm_type& comm) {
        return trainer_t<lockstep::half>(comm, [](ctx_type& ctx) { return net_type(ctx); },
                                         {.lr = lr});
    };
    std::vector<std::vector<float>> loaded(2), fresh(2);
    thread_group(2).run([&](comm_type& comm) { // the other run: another loss weight
        auto trainer = make(comm);
        step(trainer, 3.0);
        step(trainer, 3.0);
        save_checkpoint(trainer, path);
        trainer.finish();
    });
    const auto load_and_step = [&](std::vector<std::vector<float>>& out, int steps_before) {
        thread_group(2).run([&](comm_type& comm) {
            auto trainer = make(comm);
            for (int k = 0; k < steps_before; ++k)
                step(trainer, 1.0);
            load_checkpoint(trainer, path);
            step(trainer, 1.0);
            const auto p = trainer.parameters();
            out[static_cast<std::size_t>(comm.rank())].assign(p.begin(), p.end());
            trainer.finish();
        });
    };
    load_and_step(loaded, 3); // computed step 2 before the load
    load_and_step(fresh, 0);
    CHECK(loaded[0] == fresh[0]);
    CHECK(loaded[1] == fresh[1]);
}

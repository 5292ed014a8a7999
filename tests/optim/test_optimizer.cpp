// Every optimizer against a naive double-precision reference over many steps, state
// round trips, thread-count independence, skipped steps, the optimizer concept and all_finite.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/optim/sgd.hpp"

#include "reference.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using namespace lockstep;

namespace {
// The layout used throughout: two decayed tensors, a gap of 3 padding elements, a bias-like
// tensor without decay or adaptation, and an empty tensor. 1000 elements in all.
const std::vector<tensor_segment> layout = {
    {0, 600, true, true}, {600, 250, true, true}, {853, 140, false, false}, {993, 0}, {993, 7}};
constexpr std::size_t n = 1000;

// Per optimizer: its params and the matching reference.
template <class O>
struct setup;
template <class T>
struct setup<optim::sgd<T>> {
    static optim::sgd_params params() {
        return {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-2};
    }
    static ref::sgd reference() {
        return {.lr = 0.05, .mu = 0.9, .damp = 0.1, .wd = 1e-2, .nesterov = false, .segs = layout};
    }
};
template <class T>
struct nesterov {}; // a tag: sgd with Nesterov momentum
template <class T>
struct setup<nesterov<T>> {
    using type = optim::sgd<T>;
    static optim::sgd_params params() {
        return {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-2, .nesterov = true};
    }
    static ref::sgd reference() {
        return {.lr = 0.05, .mu = 0.9, .damp = 0.0, .wd = 1e-2, .nesterov = true, .segs = layout};
    }
};
template <class T>
struct setup<optim::adam<T>> {
    static optim::adam_params params() { return {.lr = 1e-2, .weight_decay = 1e-2}; }
    static ref::adam reference() {
        return {.lr = 1e-2,
                .b1 = 0.9,
                .b2 = 0.999,
                .eps = 1e-8,
                .wd = 1e-2,
                .decoupled = false,
                .segs = layout};
    }
};
template <class T>
struct setup<optim::adamw<T>> {
    static optim::adamw_params params() { return {.lr = 1e-2, .weight_decay = 0.1}; }
    static ref::adam reference() {
        return {.lr = 1e-2,
                .b1 = 0.9,
                .b2 = 0.999,
                .eps = 1e-8,
                .wd = 0.1,
                .decoupled = true,
                .segs = layout};
    }
};

template <class T>
struct setup<optim::lars<T>> {
    static optim::lars_params params() {
        return {.lr = 0.5, .momentum = 0.9, .eta = 0.02, .weight_decay = 1e-3, .eps = 1e-9};
    }
    static ref::lars reference() {
        return {.lr = 0.5, .mu = 0.9, .eta = 0.02, .wd = 1e-3, .eps = 1e-9, .segs = layout};
    }
};
template <class T>
struct setup<optim::lamb<T>> {
    static optim::lamb_params params() {
        return {.lr = 1e-2, .eps = 1e-6, .weight_decay = 1e-2, .phi_max = 10.0};
    }
    static ref::lamb reference() {
        return {.lr = 1e-2,
                .b1 = 0.9,
                .b2 = 0.999,
                .eps = 1e-6,
                .wd = 1e-2,
                .phi_min = 0.0,
                .phi_max = 10.0,
                .segs = layout};
    }
};

template <class S>
struct opt_type {
    using type = S;
};
template <class T>
struct opt_type<nesterov<T>> {
    using type = optim::sgd<T>;
};

std::vector<double> initial_weights() {
    return ref::normals(n, 1, 0, 0, 0.5);
}
std::vector<double> gradient(int step) {
    return ref::normals(n, 1, 1, step, 1.0);
}
} // namespace

static_assert(optimizer<optim::sgd<float>>);
static_assert(optimizer<optim::adam<double>>);
static_assert(optimizer<optim::adamw<float>>);
static_assert(optimizer<optim::lars<float>>);
static_assert(optimizer<optim::lamb<double>>);

#define LOCKSTEP_OPTIMIZERS(T)                                                                     \
    optim::sgd<T>, nesterov<T>, optim::adam<T>, optim::adamw<T>, optim::lars<T>, optim::lamb<T>

TEMPLATE_TEST_CASE("optimizers follow the double reference over 50 steps", "[optim][host]",
                   LOCKSTEP_OPTIMIZERS(float), LOCKSTEP_OPTIMIZERS(double)) {
    using O = typename opt_type<TestType>::type;
    using T = typename O::value_type;
    // float: each step adds a few roundings (2^-24 relative) of O(1) quantities to w and the
    // moments; 50 steps x ~10 operations x 6e-8 = 3e-5 is a worst-case bound on |w - ref| /
    // (1 + |ref|). double: the same count of 2^-53 roundings, bounded by 1e-12.
    const double tol = sizeof(T) == 4 ? 3e-5 : 1e-12;
    O opt(n, setup<TestType>::params(), host_system{}, layout);
    auto reference = setup<TestType>::reference();
    std::vector<double> wref = initial_weights();
    std::vector<T> w(wref.begin(), wref.end());
    for (int s = 0; s < 50; ++s) {
        const std::vector<double> gd = gradient(s);
        const std::vector<T> g(gd.begin(), gd.end());
        opt.step(w, g);
        reference.step(wref, gd);
    }
    CHECK(opt.step_count() == 50);
    double worst = 0;
    for (std::size_t i = 0; i < n; ++i)
        worst = std::max(worst, std::abs(w[i] - wref[i]) / (1 + std::abs(wref[i])));
    INFO("worst relative error " << worst);
    CHECK(worst <= tol);
    if constexpr (requires { opt.trust_ratios(); }) {
        // LARS/LAMB: the last step's per-tensor ratios (1 for the non-adapted bias and the
        // empty tensor).
        REQUIRE(opt.trust_ratios().size() == reference.trust.size());
        for (std::size_t k = 0; k < reference.trust.size(); ++k)
            CHECK(opt.trust_ratios()[k] == Approx(reference.trust[k]).epsilon(tol));
        CHECK(opt.trust_ratios()[2] == 1.0);
        CHECK(opt.trust_ratios()[3] == 1.0);
    }
    // Padding (elements 850..852) is never touched.
    const std::vector<double> w0 = initial_weights();
    for (std::size_t i = 850; i < 853; ++i)
        CHECK(w[i] == static_cast<T>(w0[i]));
}

TEMPLATE_TEST_CASE("optimizer state round trip is bitwise", "[optim][host]",
                   LOCKSTEP_OPTIMIZERS(float)) {
    using O = typename opt_type<TestType>::type;
    using T = typename O::value_type;
    O opt(n, setup<TestType>::params(), host_system{}, layout);
    const std::vector<double> w0 = initial_weights();
    std::vector<T> w(w0.begin(), w0.end());
    auto run = [&](O& o, int from, int to) {
        for (int s = from; s < to; ++s) {
            const std::vector<double> gd = gradient(s);
            const std::vector<T> g(gd.begin(), gd.end());
            o.step(w, g);
        }
    };
    run(opt, 0, 3);
    // Save: the weights, the step count and a copy of every state buffer.
    const std::vector<T> w_saved = w;
    const state_view<const T> live = std::as_const(opt).state();
    std::vector<std::vector<T>> copies;
    for (const auto& slot : live.slots)
        copies.emplace_back(slot.data.begin(), slot.data.end());
    state_view<const T> saved{live.step, {}};
    for (std::size_t k = 0; k < copies.size(); ++k)
        saved.slots.push_back({live.slots[k].name, copies[k]});
    CHECK(saved.step == 3);

    run(opt, 3, 7);
    const std::vector<T> w_first = w;

    // Restore into the same optimizer and into a fresh one: both replay bitwise.
    w = w_saved;
    opt.load_state(saved);
    CHECK(opt.step_count() == 3);
    run(opt, 3, 7);
    CHECK(w == w_first);
    O fresh(n, setup<TestType>::params(), host_system{}, layout);
    fresh.load_state(saved);
    w = w_saved;
    run(fresh, 3, 7);
    CHECK(w == w_first);

    // A checkpoint of another shape or kind is refused.
    O small(n - 1, setup<TestType>::params());
    try {
        small.load_state(saved);
        FAIL("load_state accepted a state of the wrong size");
    } catch (const error& e) {
        CHECK(e.code() == errc::checkpoint);
    }
    state_view<const T> renamed = saved;
    renamed.slots.back().name = "something_else";
    CHECK_THROWS_AS(fresh.load_state(renamed), error);
}

TEMPLATE_TEST_CASE("optimizer results do not depend on the thread count", "[optim][host]",
                   LOCKSTEP_OPTIMIZERS(float)) {
    using O = typename opt_type<TestType>::type;
    using T = typename O::value_type;
    const std::size_t big = 100003; // several tiles, odd size
    const std::vector<tensor_segment> segs = {{0, 50000}, {50000, 3}, {50003, 50000, false}};
    const std::vector<double> w0 = ref::normals(big, 5, 0, 0);
    std::vector<std::vector<T>> grads;
    for (int s = 0; s < 3; ++s) {
        const std::vector<double> gd = ref::normals(big, 5, 1, s);
        grads.emplace_back(gd.begin(), gd.end());
    }
    std::vector<std::vector<T>> results;
    for (int threads : {1, 2, 3}) {
        O opt(big, setup<TestType>::params(), host_system{threads}, segs);
        std::vector<T> w(w0.begin(), w0.end());
        for (const auto& g : grads)
            opt.step(w, g);
        results.push_back(w);
    }
    CHECK(results[0] == results[1]);
    CHECK(results[0] == results[2]);
}

TEMPLATE_TEST_CASE("all_finite finds NaN and infinities", "[optim][host]", float, double) {
    using T = TestType;
    host_system sys{2};
    // 100001 elements: above kernels::host_serial_below, so the OpenMP path runs.
    std::vector<T> x(100001, T(1.5));
    CHECK(all_finite(std::span<const T>(x), sys));
    CHECK(all_finite(std::span<const T>(), sys));
    x[77777] = std::numeric_limits<T>::quiet_NaN();
    CHECK_FALSE(all_finite(std::span<const T>(x), sys));
    x[77777] = -std::numeric_limits<T>::infinity();
    CHECK_FALSE(all_finite(std::span<const T>(x), sys));
    x[77777] = std::numeric_limits<T>::max();
    x[0] = std::numeric_limits<T>::denorm_min();
    CHECK(all_finite(std::span<const T>(x), sys));
    // The serial path for short spans.
    std::vector<T> y(100, T(0));
    CHECK(all_finite(std::span<const T>(y), sys));
    y[99] = std::numeric_limits<T>::infinity();
    CHECK_FALSE(all_finite(std::span<const T>(y), sys));
}

namespace {
// True when a and b hold the same bytes (bitwise: -0 differs from 0, a NaN equals itself).
template <class V>
bool same_bits(const std::vector<V>& a, const std::vector<V>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0);
}

// Everything a step may change, copied to the host: the weights, the step count, every state
// slot and (LARS, LAMB) the trust ratios. Compared bitwise.
template <class O, class T = typename O::value_type>
struct snapshot {
    std::vector<T> w;
    std::int64_t step = 0;
    std::vector<std::vector<T>> slots;
    std::vector<double> trust;
    bool operator==(const snapshot& o) const {
        if (step != o.step || slots.size() != o.slots.size() || !same_bits(w, o.w) ||
            !same_bits(trust, o.trust))
            return false;
        for (std::size_t k = 0; k < slots.size(); ++k)
            if (!same_bits(slots[k], o.slots[k]))
                return false;
        return true;
    }
};
template <class O, class T = typename O::value_type>
snapshot<O> take(const O& opt, const std::vector<T>& w) {
    snapshot<O> s{w, opt.step_count(), {}, {}};
    for (const auto& slot : opt.state().slots)
        s.slots.emplace_back(slot.data.begin(), slot.data.end());
    if constexpr (requires { opt.trust_ratios(); })
        s.trust.assign(opt.trust_ratios().begin(), opt.trust_ratios().end());
    return s;
}
template <class T>
std::vector<T> gradient_t(int step) {
    const std::vector<double> gd = gradient(step);
    return {gd.begin(), gd.end()};
}
} // namespace

TEMPLATE_TEST_CASE("a step with the skip flag set changes nothing", "[optim][skip][host]",
                   LOCKSTEP_OPTIMIZERS(float), LOCKSTEP_OPTIMIZERS(double)) {
    using O = typename opt_type<TestType>::type;
    using T = typename O::value_type;
    O opt(n, setup<TestType>::params(), host_system{}, layout);
    const std::vector<double> w0 = initial_weights();
    std::vector<T> w(w0.begin(), w0.end());
    const int skip = 1;
    // Skipped before the first step (SGD's momentum must still start as the first d after it),
    // and after two applied steps, with a gradient full of NaN as a real skip would see.
    std::vector<T> bad = gradient_t<T>(7);
    bad[0] = std::numeric_limits<T>::quiet_NaN();
    bad[700] = std::numeric_limits<T>::infinity();
    const snapshot<O> fresh = take(opt, w);
    opt.step(w, bad, &skip);
    CHECK(take(opt, w) == fresh);
    CHECK(opt.step_count() == 0);
    for (int s = 0; s < 2; ++s)
        opt.step(w, gradient_t<T>(s));
    const snapshot<O> before = take(opt, w);
    REQUIRE(before.step == 2);
    opt.step(w, bad, &skip);
    opt.step(w, gradient_t<T>(2), &skip);
    const snapshot<O> after = take(opt, w);
    CHECK(same_bits(after.w, before.w));
    CHECK(after.step == 2);
    CHECK(after == before);
}

TEMPLATE_TEST_CASE("bias corrections count applied steps only", "[optim][skip][host]",
                   LOCKSTEP_OPTIMIZERS(float), LOCKSTEP_OPTIMIZERS(double)) {
    using O = typename opt_type<TestType>::type;
    using T = typename O::value_type;
    const std::vector<double> w0 = initial_weights();
    // Five steps with gradients 0..4, the third (gradient 2) skipped, against four unskipped
    // steps over gradients 0, 1, 3, 4: bitwise equal, t = 3 and 4 in both.
    O skipping(n, setup<TestType>::params(), host_system{}, layout);
    std::vector<T> w_skipping(w0.begin(), w0.end());
    for (int s = 0; s < 5; ++s) {
        const int flag = s == 2 ? 1 : 0;
        skipping.step(w_skipping, gradient_t<T>(s), &flag);
    }
    O plain(n, setup<TestType>::params(), host_system{}, layout);
    std::vector<T> w_plain(w0.begin(), w0.end());
    for (int s : {0, 1, 3, 4})
        plain.step(w_plain, gradient_t<T>(s));
    const snapshot<O> a = take(skipping, w_skipping), b = take(plain, w_plain);
    CHECK(a.step == 4);
    CHECK(same_bits(a.w, b.w));
    CHECK(a == b);
}

TEMPLATE_TEST_CASE("a clear skip flag is the plain step", "[optim][skip][host]",
                   LOCKSTEP_OPTIMIZERS(float), LOCKSTEP_OPTIMIZERS(double)) {
    using O = typename opt_type<TestType>::type;
    using T = typename O::value_type;
    const std::vector<double> w0 = initial_weights();
    O flagged(n, setup<TestType>::params(), host_system{}, layout);
    O plain(n, setup<TestType>::params(), host_system{}, layout);
    O null_flag(n, setup<TestType>::params(), host_system{}, layout);
    std::vector<T> w_flagged(w0.begin(), w0.end()), w_plain = w_flagged, w_null = w_flagged;
    const int clear = 0;
    for (int s = 0; s < 4; ++s) {
        const std::vector<T> g = gradient_t<T>(s);
        flagged.step(w_flagged, g, &clear);
        plain.step(w_plain, g);
        null_flag.step(w_null, g, nullptr);
    }
    CHECK(take(flagged, w_flagged) == take(plain, w_plain));
    CHECK(take(null_flag, w_null) == take(plain, w_plain));
    CHECK(plain.step_count() == 4);
}

TEMPLATE_TEST_CASE("a restored step count drives the next bias corrections", "[optim][skip][host]",
                   LOCKSTEP_OPTIMIZERS(double)) {
    using O = typename opt_type<TestType>::type;
    using T = typename O::value_type;
    const std::vector<double> w0 = initial_weights();
    // Three steps with the second skipped, saved, restored into a fresh optimizer: the next
    // step uses t = 3 in both.
    O first(n, setup<TestType>::params(), host_system{}, layout);
    std::vector<T> w(w0.begin(), w0.end());
    for (int s = 0; s < 3; ++s) {
        const int flag = s == 1 ? 1 : 0;
        first.step(w, gradient_t<T>(s), &flag);
    }
    const state_view<const T> saved = std::as_const(first).state();
    CHECK(saved.step == 2);
    O second(n, setup<TestType>::params(), host_system{}, layout);
    second.load_state(saved);
    CHECK(second.step_count() == 2);
    std::vector<T> w2 = w;
    first.step(w, gradient_t<T>(3));
    second.step(w2, gradient_t<T>(3));
    CHECK(same_bits(w, w2));
    CHECK(second.step_count() == 3);
}

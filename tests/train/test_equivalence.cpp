// Synchronous data parallelism equals one replica with the whole global batch: per_tensor,
// bucketed and parameter_server x every optimizer x float/double, 1-4 replicas, uneven and empty
// shards, bn::global and dropout. SPDX-License-Identifier: Apache-2.0
#include "optimizer_cases.hpp"
#include "train_runner.hpp"

#include <catch2/catch.hpp>

using namespace lockstep_test;

namespace {

// Relative error bound of N replicas against one (normwise per tensor, after 20 steps): the
// replicas sum the same per-sample gradients in a different order, so the results differ by
// rounding only; the bound is the 1e-5 (float) / 1e-10 (double).
template <class T>
constexpr double tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-10;

// The single-replica run with the whole global batch, once per (T, optimizer).
template <class T, template <class> class Case>
const run_record<T>& reference() {
    static const run_record<T> ref =
        train_run<T, typename Case<T>::type, sync::synchronous, reduce::per_tensor,
                  storage::registry>({.replicas = 1}, Case<T>::params());
    return ref;
}

// Every optimizer runs on 4 replicas (37 samples over 4: uneven; 3 over 4: an empty replica);
// SGD also on 2 and 3 replicas. (Every run costs collectives on oversubscribed cores.)
template <class Reduce, class T, template <class> class Case>
void check_equivalence(std::initializer_list<int> replica_counts) {
    using opt = typename Case<T>::type;
    const run_record<T>& ref = reference<T, Case>();
    // The reference itself must have trained: weights moved away from the initial ones.
    const auto first = ref.params[0].front();
    REQUIRE(rel_error(ref.params[0].back(), first) > 1e-3);
    for (int replicas : replica_counts) {
        const auto run = train_run<T, opt, sync::synchronous, Reduce, storage::registry>(
            {.replicas = replicas}, Case<T>::params());
        INFO("replicas " << replicas);
        // Bitwise identical weights on every replica after every step.
        CHECK(first_divergence(run) == "");
        for (std::size_t s = 0; s < run.params[0].size(); ++s) {
            INFO("step " << s << " (global batch " << batch_schedule()[s] << ")");
            CHECK(max_tensor_rel_error(run.params[0][s], ref.params[0][s], ref.layout) <=
                  tolerance<T>);
            // The loss within the parameters' bound: it is computed from the previous step's
            // parameters (within that bound), and a float sum's rounding (37 terms) is below it.
            CHECK(run.results[0][s].loss == Approx(ref.results[0][s].loss).epsilon(tolerance<T>));
            CHECK_FALSE(run.results[0][s].skipped);
            for (int r = 1; r < replicas; ++r)
                CHECK(run.results[r][s].loss == run.results[0][s].loss);
        }
        // Running statistics of the global batch (bn::global) agree with one replica's.
        CHECK(rel_error(run.state[0].back(), ref.state[0].back()) <= tolerance<T>);
    }
}

template <class Reduce, class T>
void check_all_optimizers() {
    SECTION("sgd") {
        check_equivalence<Reduce, T, sgd_case>({2, 3, 4});
    }
    SECTION("adam") {
        check_equivalence<Reduce, T, adam_case>({4});
    }
    SECTION("adamw") {
        check_equivalence<Reduce, T, adamw_case>({4});
    }
    SECTION("lars") {
        check_equivalence<Reduce, T, lars_case>({4});
    }
    SECTION("lamb") {
        check_equivalence<Reduce, T, lamb_case>({4});
    }
}

} // namespace

// bucketed<64, 32>: the 83 parameters (332 float bytes) make several buckets, launched from
// mark_ready during backward; bucketed<> is one bucket.
TEMPLATE_TEST_CASE("N replicas train like one replica with the global batch", "[train][thread]",
                   reduce::per_tensor, reduce::bucketed<>, (reduce::bucketed<64, 32>),
                   reduce::parameter_server<0>, reduce::parameter_server<1>) {
    // parameter_server<1> needs >= 2 replicas; every run here has.
    SECTION("float") {
        check_all_optimizers<TestType, float>();
    }
    SECTION("double") {
        check_all_optimizers<TestType, double>();
    }
}

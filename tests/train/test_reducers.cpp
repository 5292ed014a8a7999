// The collectives' reducers on their own: bucket plans, in-order launching, and every
// ReducePolicy's sum and average against a double-precision reference over replicas with different
// data. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/train/detail/bucketed_collective.hpp"
#include "lockstep/train/detail/compressed_collective.hpp"
#include "lockstep/train/detail/parameter_server_collective.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace lockstep;
using detail::bucket;

namespace {
std::vector<tensor_info> layout(std::initializer_list<std::size_t> sizes) {
    std::vector<tensor_info> out;
    std::size_t offset = 0;
    for (std::size_t n : sizes) {
        std::string name = "t"; // (not "t" + to_string: GCC 12 misreads that as -Wrestrict)
        name += std::to_string(out.size());
        out.push_back(tensor_info{std::move(name), {n}, offset, n});
        offset += n;
    }
    return out;
}
// The value element i of rank r contributes (different on every replica).
double contribution(int r, std::size_t i) {
    return std::sin(0.37 * double(i) + 1.3 * r) * (r + 1);
}
} // namespace

TEST_CASE("bucket plans cover the flat buffer in reverse registration order", "[train][reducer]") {
    const auto ts = layout({10, 300, 5, 64, 64, 1000, 7});
    const auto plan = detail::plan_buckets(ts, sizeof(float), 64, 512);
    // Launch order walks tensors from the last registered; each bucket is contiguous and the
    // buckets tile [0, total) backwards.
    std::size_t end = ts.back().offset + ts.back().size;
    std::size_t next_last = ts.size() - 1;
    for (const bucket& b : plan) {
        CHECK(b.offset + b.size == end);
        CHECK(b.last_tensor == next_last);
        CHECK(b.offset == ts[b.first_tensor].offset);
        end = b.offset;
        next_last = b.first_tensor - 1;
    }
    CHECK(end == 0);
    // {t6 (28 B), t5 (4000 B)}: the first bucket closes once >= 64 bytes; later ones at 512.
    // Then {t4, t3} (512 bytes), {t2, t1} (1220 bytes), {t0}.
    REQUIRE(plan.size() == 4);
    CHECK(plan[0].first_tensor == 5);
    CHECK(plan[1].first_tensor == 3);
    CHECK(plan[2].first_tensor == 1);
    CHECK(plan[3].first_tensor == 0);
    // One tensor per piece at 1 byte: per_tensor.
    CHECK(detail::plan_buckets(ts, 4, 1, 1).size() == ts.size());
}

TEST_CASE("the last bucket launched is cut below the first bucket's target", "[train][reducer]") {
    // Bytes 20, 20, 20, 400, 1200. Without the tail cut the second bucket would take t3 and
    // everything before it (460 bytes < 512); the tail is the longest prefix below 64 bytes.
    const auto ts = layout({5, 5, 5, 100, 300});
    const auto plan = detail::plan_buckets(ts, sizeof(float), 64, 512);
    REQUIRE(plan.size() == 3);
    CHECK((plan[0].first_tensor == 4 && plan[0].last_tensor == 4));
    CHECK((plan[1].first_tensor == 3 && plan[1].last_tensor == 3));
    CHECK((plan[2].first_tensor == 0 && plan[2].last_tensor == 2));
    CHECK((plan[2].offset == 0 && plan[2].size == 15));
    // A first tensor at or above the target is a tail of its own.
    const auto big = layout({100, 5, 300});
    const auto p2 = detail::plan_buckets(big, sizeof(float), 64, 512);
    REQUIRE(p2.size() == 3);
    CHECK((p2[2].first_tensor == 0 && p2[2].last_tensor == 0));
    // Everything below the target: one bucket.
    CHECK(detail::plan_buckets(layout({1, 2, 3}), sizeof(float), 64, 512).size() == 1);
}

TEST_CASE("buckets launch in plan order, each once its prefix is ready", "[train][reducer]") {
    const auto ts = layout({1, 1, 1, 1, 1});
    detail::ordered_launcher l(detail::plan_buckets(ts, 4, 8, 8), ts.size(), 2); // {4,3} {2,1} {0}
    std::vector<std::size_t> launched;
    auto launch = [&](const bucket& b) { launched.push_back(b.first_tensor); };
    l.mark_ready(1, launch); // bucket 1 half ready, bucket 0 not: nothing
    l.mark_ready(2, launch); // bucket 1 complete but waits for bucket 0
    CHECK(launched.empty());
    l.mark_ready(4, launch);
    l.mark_ready(4, launch); // again: no effect
    CHECK(launched.empty());
    l.mark_ready(3, launch); // bucket 0 complete: 0 and the waiting 1 launch, in order
    CHECK(launched == std::vector<std::size_t>{3, 1});
    l.finish(launch);
    CHECK(launched == std::vector<std::size_t>{3, 1, 0});
    l.reset();
    launched.clear();
    l.finish(launch);
    CHECK(launched == std::vector<std::size_t>{3, 1, 0});
    CHECK_THROWS_WITH(l.mark_ready(9, launch),
                      "lockstep error [invalid_argument] replica 2: mark_ready: tensor index 9 out "
                      "of range (5 parameters)");
}

namespace {
template <class Policy>
constexpr int root_of() {
    return Policy::update_root;
}

template <class Policy>
void check_sum_and_average(int replicas, double tol, double floor = 0) {
    const auto ts = layout({3, 700, 1, 5000, 17, 4096, 2});
    const std::size_t n = ts.back().offset + ts.back().size;
    std::vector<std::vector<double>> sums(static_cast<std::size_t>(replicas)),
        means(static_cast<std::size_t>(replicas));
    thread_group(replicas).run([&](thread_communicator& comm) {
        detail::collective<Policy, double, thread_communicator> red(comm, ts);
        std::vector<double> g(n), v(n);
        for (std::size_t i = 0; i < n; ++i)
            g[i] = v[i] = contribution(comm.rank(), i);
        red.begin(g);
        // Mark a few tensors ready out of order, as backward would; finish does the rest.
        red.mark_ready(6);
        red.mark_ready(2);
        red.mark_ready(5);
        red.finish();
        sums[comm.rank()] = g;
        if constexpr (!Policy::rounds_on_wire) {
            red.average(v);
            means[comm.rank()] = v;
        }
    });
    for (int r = 0; r < replicas; ++r) {
        const bool holds_sum = Policy::update_root < 0 || r == root_of<Policy>();
        double worst_sum = 0, worst_mean = 0;
        for (std::size_t i = 0; i < n; ++i) {
            double ref = 0, mag = 0;
            for (int q = 0; q < replicas; ++q) {
                ref += contribution(q, i);
                mag += std::abs(contribution(q, i));
            }
            worst_sum = std::max(worst_sum, std::abs(sums[r][i] - ref) / (mag + floor / tol));
            if (!means[r].empty())
                worst_mean = std::max(worst_mean, std::abs(means[r][i] - ref / replicas) / mag);
        }
        INFO("replica " << r);
        if (holds_sum)
            CHECK(worst_sum <= tol);
        CHECK(worst_mean <= tol);
        // Everyone who holds the result holds the same bits.
        if (holds_sum && r > 0 && Policy::update_root < 0)
            CHECK(sums[r] == sums[0]);
        if (!means[r].empty())
            CHECK(means[r] == means[0]);
    }
}
} // namespace

TEST_CASE("every reducer sums (and averages) like a double-precision reference",
          "[train][reducer][thread]") {
    // Exact reducers: only double rounding of a few additions (error relative to sum |x|).
    for (int replicas : {1, 2, 3, 4}) {
        INFO("replicas " << replicas);
        check_sum_and_average<reduce::per_tensor>(replicas, 1e-15);
        check_sum_and_average<reduce::bucketed<1024, 64>>(replicas, 1e-15);
        check_sum_and_average<reduce::bucketed<>>(replicas, 1e-15);
        check_sum_and_average<reduce::parameter_server<0>>(replicas, 1e-15);
        if (replicas > 2)
            check_sum_and_average<reduce::parameter_server<2>>(replicas, 1e-15);
        // Every contribution is rounded once to the wire type (after double -> float), the
        // float sum once more: |error| <= (2 u + replicas 2^-24) sum |x| (below 2^-14 half is
        // subnormal: an absolute error of up to 2^-25 per rounding, replicas + 1 of them).
        const double f = replicas * std::ldexp(1.0, -24);
        check_sum_and_average<reduce::compressed<lockstep::half>>(
            replicas, 2 * lockstep::half::unit_roundoff + f, (replicas + 1) * std::ldexp(1.0, -25));
        check_sum_and_average<reduce::compressed<lockstep::bfloat16>>(
            replicas, 2 * lockstep::bfloat16::unit_roundoff + f);
    }
}

TEST_CASE("parameter_server rejects a root that is not a replica", "[train][reducer][thread]") {
    std::vector<std::string> messages(2);
    thread_group(2).run([&](thread_communicator& comm) {
        try {
            detail::collective<reduce::parameter_server<2>, float, thread_communicator> red(
                comm, layout({4}));
        } catch (const error& e) {
            messages[comm.rank()] = e.what();
        }
    });
    for (const auto& m : messages)
        CHECK_THAT(m, Catch::Contains("root 2 is not a replica"));
}

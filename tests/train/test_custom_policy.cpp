// A ReducePolicy written outside the library, as docs/writing_a_reduce_policy.md describes: its
// tag, its collective (a specialisation of detail::collective) and this test, nothing else. The
// policy reduces every tensor with its own all_reduce, as reduce::per_tensor does, but launches
// them in registration order (the reverse of per_tensor's): each all_reduce sums the same values
// of the same tensor, so the training must equal per_tensor's bit for bit at every step, on every
// replica, with as many collectives.
// SPDX-License-Identifier: Apache-2.0
#include "train_runner.hpp"

#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/detail/bucketed_collective.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

using namespace lockstep;
using namespace lockstep_test;

namespace test_policy {
/// The tag: a name and the traits of a plain all-reduce.
struct forward_per_tensor : reduce::policy_traits {
    static std::string name() { return "test_policy::forward_per_tensor"; }
};
} // namespace test_policy

namespace lockstep::detail {
/// Its collective: one piece per tensor, in registration order; one all_reduce per piece. The
/// rest of the step (gradient, agree, update, average) is piecewise_collective's.
template <class T, class Communicator>
class collective<test_policy::forward_per_tensor, T, Communicator>
    : public piecewise_collective<collective<test_policy::forward_per_tensor, T, Communicator>, T,
                                  Communicator> {
    using base = piecewise_collective<collective, T, Communicator>;

public:
    collective(Communicator& comm, const std::vector<tensor_info>& tensors,
               overlap_setting overlap = {}, const train_params& /*params*/ = {})
        : base(comm, forward_plan(tensors), tensors.size(), overlap) {}

    void reduce_piece(Communicator& c, std::span<T> piece) {
        c.all_reduce(std::span<const T>(piece), piece, reduce_op::sum);
    }

private:
    static std::vector<bucket> forward_plan(const std::vector<tensor_info>& tensors) {
        std::vector<bucket> plan;
        for (std::size_t t = 0; t < tensors.size(); ++t)
            plan.push_back(bucket{tensors[t].offset, tensors[t].size, t, t});
        return plan;
    }
};
} // namespace lockstep::detail

namespace {
template <storage S>
void check_equal_to_per_tensor(int replicas, overlap_mode overlap) {
    run_options o;
    o.replicas = replicas;
    o.overlap = overlap;
    using opt = optim::sgd<float>;
    const auto mine = train_run<float, opt, sync::synchronous, test_policy::forward_per_tensor, S>(
        o, {.lr = 0.1});
    const auto ref =
        train_run<float, opt, sync::synchronous, reduce::per_tensor, S>(o, {.lr = 0.1});
    REQUIRE(mine.params.size() == ref.params.size());
    for (std::size_t r = 0; r < ref.params.size(); ++r) {
        INFO("replica " << r);
        REQUIRE(mine.params[r].size() == ref.params[r].size());
        for (std::size_t s = 0; s < ref.params[r].size(); ++s) {
            INFO("step " << s);
            const auto& a = mine.params[r][s];
            const auto& b = ref.params[r][s];
            REQUIRE(a.size() == b.size());
            CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
            CHECK(mine.state[r][s] == ref.state[r][s]);
            CHECK(mine.results[r][s].loss == ref.results[r][s].loss);
        }
        CHECK(mine.collectives[r] == ref.collectives[r]);
    }
    // The runs are not trivially equal: training moved the weights.
    CHECK(ref.params[0].front() != ref.params[0].back());
}
} // namespace

TEST_CASE("a policy defined outside the library: its tag and collective are all it takes",
          "[train][thread]") {
    for (int replicas : {1, 2, 3}) {
        INFO("replicas " << replicas);
        check_equal_to_per_tensor<storage::registry>(replicas, overlap_mode::never);
        check_equal_to_per_tensor<storage::registry>(replicas, overlap_mode::always);
        check_equal_to_per_tensor<storage::visitor>(replicas, overlap_mode::never);
    }
}

TEST_CASE("the policy's plan is per_tensor's in the other order", "[train][thread]") {
    // {first_tensor, offset} of each plan item, recorded on the replica thread.
    std::vector<std::pair<std::size_t, std::size_t>> mine_plan, ref_plan;
    thread_group(1).run([&](thread_communicator& comm) {
        const std::vector<tensor_info> ts = {{"a", {3}, 0, 3}, {"b", {5}, 3, 5}, {"c", {2}, 8, 2}};
        const detail::collective<test_policy::forward_per_tensor, float, thread_communicator> mine(
            comm, ts);
        const detail::collective<reduce::per_tensor, float, thread_communicator> ref(comm, ts);
        for (const auto& item : mine.plan())
            mine_plan.emplace_back(item.first_tensor, item.offset);
        for (const auto& item : ref.plan())
            ref_plan.emplace_back(item.first_tensor, item.offset);
    });
    REQUIRE(mine_plan.size() == 3);
    REQUIRE(ref_plan.size() == 3);
    for (std::size_t k = 0; k < 3; ++k) {
        CHECK(mine_plan[k].first == k);
        CHECK(ref_plan[2 - k].first == k);
        CHECK(mine_plan[k].second == ref_plan[2 - k].second);
    }
}

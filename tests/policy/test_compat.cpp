// The policy tags, their concepts and the combinations check_compatible accepts (the rejected
// ones are the compile-fail cases in compile_fail/). SPDX-License-Identifier: Apache-2.0
#include "compile_fail/fake_collective_communicator.hpp"
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/policy/compat.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <vector>

using namespace lockstep;

static_assert(sync_policy<sync::synchronous> && sync_policy<sync::asynchronous> &&
              sync_policy<sync::bounded_staleness<3>> && sync_policy<sync::local_sgd<4>>);
static_assert(!sync_policy<int> && !sync_policy<reduce::per_tensor>);
static_assert(reduce_policy<reduce::per_tensor> && reduce_policy<reduce::bucketed<>> &&
              reduce_policy<reduce::parameter_server<1>> &&
              reduce_policy<reduce::compressed<lockstep::half>> &&
              reduce_policy<reduce::sharded<>>);
static_assert(!reduce_policy<sync::synchronous> && !reduce_policy<double>);
// What each tag tells the trainer (reduce::policy_traits and the overrides).
static_assert(reduce::per_tensor::update_root == -1 &&
              reduce::parameter_server<1>::update_root == 1);
static_assert(reduce::sharded<>::shards_optimizer_state &&
              !reduce::bucketed<>::shards_optimizer_state);
static_assert(reduce::reproducible<8>::chunk_samples == 8 &&
              reduce::bucketed<>::chunk_samples == 0);
static_assert(reduce::compressed<lockstep::half>::rounds_on_wire &&
              !reduce::sharded<>::rounds_on_wire);

// Everything synchronous goes with every BN policy and every reducer.
static_assert(
    check_compatible<sync::synchronous, reduce::parameter_server<0>, collective_only_communicator,
                     std::tuple<bn::global, bn::group<2>, bn::tower<1>>>());
static_assert(check_compatible<sync::synchronous, reduce::compressed<lockstep::bfloat16>,
                               thread_communicator, std::tuple<bn::global>>());
static_assert(check_compatible<sync::synchronous, reduce::sharded<4096>,
                               collective_only_communicator, std::tuple<bn::global>>());
// Local SGD steps in lockstep, so BN policies that only share running statistics are fine.
static_assert(check_compatible<sync::local_sgd<4>, reduce::bucketed<>, collective_only_communicator,
                               std::tuple<bn::local, bn::running_only, bn::tower<0>>>());
static_assert(
    check_compatible<sync::local_sgd<4>, reduce::parameter_server<0>, thread_communicator>());
// reduce::reproducible<C>: synchronous, with bn::ghost<C> in every BN layer or no BN at all.
static_assert(reduce_policy<reduce::reproducible<8>> && bn_stat_policy<bn::ghost<8>>);
static_assert(
    check_compatible<sync::synchronous, reduce::reproducible<8>, collective_only_communicator,
                     std::tuple<bn::ghost<8>, bn::ghost<8>>>());
static_assert(check_compatible<sync::synchronous, reduce::reproducible<1>, thread_communicator>());
static_assert(bn::ghost_chunk<bn::ghost<16>> == 16 && bn::ghost_chunk<bn::local> == 0);
static_assert(reduce::chunks_of(37, 8, 0, 3).first == 0 &&
              reduce::chunks_of(37, 8, 0, 3).count == 2 &&
              reduce::chunks_of(37, 8, 2, 3).first == 4 &&
              reduce::chunks_of(37, 8, 2, 3).count == 1 &&
              reduce::chunks_of(37, 8, 7, 8).count == 0);
// Asynchronous: bn::local over a point-to-point communicator.
static_assert(check_compatible<sync::asynchronous, reduce::per_tensor, thread_communicator,
                               std::tuple<bn::local>>());
static_assert(check_compatible<sync::bounded_staleness<2>, reduce::compressed<lockstep::half>,
                               thread_communicator>());

struct net_without_bn {};
struct net_with_bn {
    using bn_policies = std::tuple<bn::global>;
};
static_assert(std::is_same_v<network_bn_policies_t<net_without_bn>, std::tuple<>>);
static_assert(std::is_same_v<network_bn_policies_t<net_with_bn>, std::tuple<bn::global>>);

TEST_CASE("policy tags carry their constants", "[policy]") {
    CHECK(sync::synchronous::kind == sync_kind::synchronous);
    CHECK(sync::bounded_staleness<5>::max_staleness == 5);
    CHECK(is_asynchronous_v<sync::bounded_staleness<5>>);
    CHECK_FALSE(is_asynchronous_v<sync::local_sgd<2>>);
    CHECK(sync::local_sgd<7>::period == 7);
    CHECK(reduce::bucketed<>::bucket_bytes == 25u << 20);
    CHECK(reduce::bucketed<>::first_bucket_bytes == 1u << 20);
    CHECK(reduce::bucketed<100, 1000>::first_bucket_bytes == 100); // never above Bytes
    CHECK(reduce::parameter_server<3>::root == 3);
    CHECK(std::is_same_v<reduce::compressed<lockstep::half>::wire_type, lockstep::half>);
}

TEST_CASE("reduce::chunks_of refuses a chunk of 0 or a replica count < 1 at run time", "[policy]") {
    // Run-time values (in a constant expression these do not compile); unchecked, they divided
    // by zero.
    struct bad_call {
        std::size_t chunk;
        int rank, size;
        const char* names;
    };
    const std::vector<bad_call> calls = {
        {0, 0, 3, "chunk = 0, rank = 0, size = 3"},
        {8, 0, 0, "chunk = 8, rank = 0, size = 0"},
        {8, 0, -2, "chunk = 8, rank = 0, size = -2"},
        {8, 3, 3, "chunk = 8, rank = 3, size = 3"},
    };
    for (const bad_call& c : calls) {
        INFO(c.names);
        try {
            (void)reduce::chunks_of(37, c.chunk, c.rank, c.size);
            FAIL("chunks_of accepted " << c.names);
        } catch (const lockstep::error& e) {
            CHECK(e.code() == errc::invalid_argument);
            CHECK_THAT(e.what(), Catch::Contains(c.names));
        }
    }
    const std::vector<std::size_t> chunk = {8};
    CHECK(reduce::chunks_of(37, chunk[0], 2, 3).first == 4);
    CHECK(reduce::chunks_of(37, chunk[0], 2, 3).count == 1);
}

TEST_CASE("policy tags carry the names checkpoints record", "[policy]") {
    // The exact strings checkpoints have recorded since the format's first version: a change
    // here would make every earlier checkpoint of that policy refuse to load.
    CHECK(sync::synchronous::name() == "sync::synchronous");
    CHECK(sync::local_sgd<4>::name() == "sync::local_sgd<4>");
    CHECK(sync::asynchronous::name() == "sync::asynchronous");
    CHECK(sync::bounded_staleness<2>::name() == "sync::bounded_staleness<2>");
    CHECK(reduce::per_tensor::name() == "reduce::per_tensor");
    CHECK(reduce::bucketed<>::name() == "reduce::bucketed<26214400, 1048576>");
    CHECK(reduce::parameter_server<1>::name() == "reduce::parameter_server<1>");
    CHECK(reduce::sharded<1024, 64>::name() == "reduce::sharded<1024, 64>");
    CHECK(reduce::compressed<lockstep::half>::name() == "reduce::compressed<half>");
    CHECK(reduce::compressed<lockstep::bfloat16>::name() == "reduce::compressed<bfloat16>");
    CHECK(reduce::reproducible<8>::name() == "reduce::reproducible<8>");
    CHECK(bn::traits<bn::local>::name() == "bn::local");
    CHECK(bn::traits<bn::global>::name() == "bn::global");
    CHECK(bn::traits<bn::group<2>>::name() == "bn::group<2>");
    CHECK(bn::traits<bn::running_only>::name() == "bn::running_only");
    CHECK(bn::traits<bn::tower<1>>::name() == "bn::tower<1>");
    CHECK(bn::traits<bn::ghost<8>>::name() == "bn::ghost<8>");
    CHECK(bn_policy_names<std::tuple<>>::get() == "none");
    CHECK(bn_policy_names<std::tuple<bn::global, bn::ghost<4>>>::get() ==
          "bn::global, bn::ghost<4>");
}

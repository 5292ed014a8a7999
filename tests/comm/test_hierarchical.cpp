// Tests of hierarchical_communicator composed of two thread_communicator levels (nodes x local
// replicas as splits of one thread_group): the collective suite, the shapes split accepts and
// refuses, and trainers over it (bucketed, compressed, per-tensor, sharded, reproducible) against
// flat replicas and one replica.
// SPDX-License-Identifier: Apache-2.0
#include "collective_suite.hpp"
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/sgd.hpp"
#include "train/repro_runner.hpp"
#include "train/train_runner.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

using lockstep::hierarchical_communicator;
using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;
using two_level = hierarchical_communicator<thread_communicator, thread_communicator>;

namespace {

/// Runs f(comm) on nodes x local replica threads, each with a two_level communicator whose
/// intra part is its "node" (consecutive ranks) and inter part its local rank across nodes.
template <class F>
void run_two_level(int nodes, int local, F&& f) {
    thread_group group(nodes * local);
    group.run([&](thread_communicator& world) {
        thread_communicator intra = world.split(world.rank() / local, world.rank());
        thread_communicator inter = world.split(world.rank() % local, world.rank());
        two_level comm(std::move(intra), std::move(inter));
        f(comm);
    });
}

} // namespace

TEST_CASE("hierarchical_communicator passes the collective suite", "[comm][hierarchical]") {
    const auto [nodes, local] = GENERATE(table<int, int>({{1, 1}, {1, 3}, {2, 1}, {2, 2}, {3, 2}}));
    CAPTURE(nodes, local);
    std::vector<lockstep::testing::suite_report> reports(static_cast<std::size_t>(nodes * local));
    run_two_level(nodes, local, [&](two_level& comm) {
        // Sums are formed node by node, then across nodes: not the flat rank order (16-bit sums
        // are rounded once per level). The large count still takes the reduce-scatter path
        // (>= local * sharded_from elements) and keeps the test short under ThreadSanitizer.
        reports[static_cast<std::size_t>(comm.rank())] = lockstep::testing::run_collective_suite(
            comm, {.rank_order_sums = false,
                   .large_count = (std::size_t{1} << 16) + 3,
                   .rank_order_float16 = false});
    });
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.failed == 0);
        CHECK(r.checks > 200);
    }
}

TEST_CASE("hierarchical_communicator forwards the caller's call sites: swapped calls of one "
          "shape fail on every replica",
          "[comm][hierarchical]") {
    // Gradient then loss, or loss then gradient: the same collective and shape, told apart only
    // by the call sites. Swapped on odd ranks, the node parts see it; on node 1, the inter parts.
    for (const int pattern : {0, 1}) {
        CAPTURE(pattern);
        thread_group group(4, {.timeout = std::chrono::seconds(10), .check_call_sites = true});
        std::vector<int> codes(4, -1);
        std::vector<std::string> whats(4);
        bool run_threw = false;
        try {
            group.run([&](thread_communicator& world) {
                thread_communicator intra = world.split(world.rank() / 2, world.rank());
                thread_communicator inter = world.split(world.rank() % 2, world.rank());
                two_level comm(std::move(intra), std::move(inter));
                std::vector<float> grad(8, 1.0f), loss(8, 2.0f);
                const auto grads = [&] {
                    comm.all_reduce(std::span<const float>(grad), std::span<float>(grad),
                                    reduce_op::sum);
                };
                const auto losses = [&] {
                    comm.all_reduce(std::span<const float>(loss), std::span<float>(loss),
                                    reduce_op::sum);
                };
                const bool swapped = pattern == 0 ? comm.rank() % 2 == 1 : comm.node() == 1;
                const auto r = static_cast<std::size_t>(comm.rank());
                try {
                    if (swapped) {
                        losses();
                        grads();
                    } else {
                        grads();
                        losses();
                    }
                } catch (const lockstep::error& e) {
                    codes[r] = static_cast<int>(e.code());
                    whats[r] = e.what();
                    throw;
                }
            });
        } catch (const lockstep::error&) {
            run_threw = true;
        }
        CHECK(run_threw);
        // The first part to see the mismatch fails the run: a replica of another part (the other
        // inter part, in pattern 1) may get errc::peer_failure naming it instead.
        const auto mismatch = static_cast<int>(lockstep::errc::shape_mismatch);
        const auto peer = static_cast<int>(lockstep::errc::peer_failure);
        CHECK(std::count(codes.begin(), codes.end(), mismatch) >= 1);
        for (std::size_t r = 0; r < 4; ++r) {
            CAPTURE(r, whats[r]);
            CHECK((codes[r] == mismatch || codes[r] == peer));
            CHECK(whats[r].find("called different collectives, tags or call sites") !=
                  std::string::npos);
            CHECK(whats[r].find("test_hierarchical.cpp:") != std::string::npos);
        }
    }
}

TEST_CASE("hierarchical_communicator ranks node-major and sums each node, then across nodes",
          "[comm][hierarchical]") {
    // 2 nodes x 2: values chosen so that the two summation orders give different float bits:
    // ((a0 + a1) + (a2 + a3)) is what every replica must hold, for a small (one-level at a time)
    // and a large (reduce-scatter / all_gather) message.
    const float v[4] = {1.0f, 1e8f, -1e8f, 1.0f};
    for (std::size_t n : {std::size_t{3}, std::size_t{2} * two_level::sharded_from * 2 + 5}) {
        std::vector<std::vector<float>> got(4);
        std::vector<int> ranks(4, -1);
        run_two_level(2, 2, [&](two_level& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            ranks[r] = comm.node() * 10 + comm.local_rank();
            std::vector<float> x(n, v[r]);
            comm.all_reduce(std::span<const float>(x), std::span<float>(x), reduce_op::sum);
            got[r] = x;
        });
        CHECK(ranks == std::vector<int>{0, 1, 10, 11});
        const float expect = (v[0] + v[1]) + (v[2] + v[3]);
        for (const auto& g : got)
            for (float e : g)
                REQUIRE(std::bit_cast<std::uint32_t>(e) == std::bit_cast<std::uint32_t>(expect));
    }
}

TEST_CASE("hierarchical_communicator refuses a split it cannot represent, on every replica",
          "[comm][hierarchical]") {
    std::vector<int> refused(4, 0), sizes(4, 0);
    run_two_level(2, 2, [&](two_level& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        // {0, 3} and {1, 2}: local ranks 0 and 1 on different nodes, no common shape.
        const int color = comm.rank() == 0 || comm.rank() == 3 ? 0 : 1;
        try {
            (void)comm.split(color, comm.rank());
        } catch (const lockstep::error& e) {
            refused[r] = e.code() == lockstep::errc::unsupported ? 1 : 2;
        }
        // Whole nodes, in reverse order, and one local rank across nodes: both fit.
        two_level nodes_reversed = comm.split(comm.node(), -comm.rank());
        two_level column = comm.split(comm.local_rank(), comm.rank());
        int one[1] = {1};
        column.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
        sizes[r] = nodes_reversed.size() * 10 + one[0];
    });
    CHECK(refused == std::vector<int>{1, 1, 1, 1});
    CHECK(sizes == std::vector<int>{22, 22, 22, 22});
}

TEST_CASE("hierarchical_communicator: nodes with different local sizes are refused",
          "[comm][hierarchical]") {
    std::vector<int> refused(3, 0);
    thread_group group(3);
    group.run([&](thread_communicator& world) {
        // Node 0 = {0, 1}, node 1 = {2}.
        const int node = world.rank() < 2 ? 0 : 1;
        thread_communicator intra = world.split(node, world.rank());
        thread_communicator inter = world.split(world.rank() == 1 ? 1 : 0, world.rank());
        try {
            two_level comm(std::move(intra), std::move(inter));
        } catch (const lockstep::error& e) {
            refused[static_cast<std::size_t>(world.rank())] =
                e.code() == lockstep::errc::invalid_argument ? 1 : 2;
        }
    });
    CHECK(refused == std::vector<int>{1, 1, 1});
}

TEST_CASE("hierarchical_communicator: nodes whose replicas disagree are refused everywhere",
          "[comm][hierarchical]") {
    // 3 nodes of 2: local rank 0's inter communicator orders the nodes A, B, C, local rank 1's
    // A, C, B. Node A's replicas agree with each other, so only the other nodes saw the
    // disagreement; node A must fail too instead of going on alone.
    std::vector<std::string> refused(6);
    thread_group group(6);
    group.run([&](thread_communicator& world) {
        const int node = world.rank() / 2, local = world.rank() % 2;
        thread_communicator intra = world.split(node, local);
        const int order[3] = {0, local == 0 ? 1 : 2, local == 0 ? 2 : 1};
        thread_communicator inter = world.split(local, order[node]);
        try {
            two_level comm(std::move(intra), std::move(inter));
        } catch (const lockstep::error& e) {
            if (e.code() == lockstep::errc::invalid_argument)
                refused[static_cast<std::size_t>(world.rank())] = e.what();
        }
    });
    for (int r = 0; r < 6; ++r) {
        INFO("replica " << r << ": " << refused[static_cast<std::size_t>(r)]);
        CHECK(refused[static_cast<std::size_t>(r)].find(
                  r < 2 ? "another node hold different inter-node ranks"
                        : "of one node hold different inter-node ranks") != std::string::npos);
    }
}

namespace {

using namespace lockstep_test;

/// The test network trained over 2 nodes x 2 replicas; returns replica r's parameters per step.
template <class T, class Opt, class Reduce, class BN>
std::vector<std::vector<std::vector<T>>> train_two_level(typename Opt::params_type p,
                                                         const std::vector<std::size_t>& batches) {
    using net = mlp<T, two_level, storage::registry, BN>;
    std::vector<std::vector<std::vector<T>>> out(4);
    run_two_level(2, 2, [&](two_level& comm) {
        lockstep::data_parallel<net, Opt, lockstep::sync::synchronous, Reduce, two_level> dp(
            comm, [](auto& ctx) { return net(ctx); }, p, {.seed = 42});
        for (std::size_t b : batches) {
            dp.step(b, [](net& n, const lockstep::shard_range& r, auto& ctx) {
                return n.train(r, ctx);
            });
            auto v = dp.parameters();
            out[static_cast<std::size_t>(comm.rank())].emplace_back(v.begin(), v.end());
        }
    });
    return out;
}

template <class T, class Opt, class Reduce, class BN>
void check_like_flat(typename Opt::params_type p, const std::vector<std::size_t>& batches) {
    const auto two = train_two_level<T, Opt, Reduce, BN>(p, batches);
    const auto flat = train_run<T, Opt, lockstep::sync::synchronous, Reduce, storage::registry, BN>(
        {.replicas = 4, .batches = batches}, p);
    const auto one =
        train_run<T, Opt, lockstep::sync::synchronous, lockstep::reduce::per_tensor,
                  storage::registry, lockstep::bn::global>({.replicas = 1, .batches = batches}, p);
    for (std::size_t s = 0; s < two[0].size(); ++s) {
        INFO("step " << s);
        for (std::size_t r = 1; r < 4; ++r) // every replica holds the same bits
            REQUIRE(std::memcmp(two[r][s].data(), two[0][s].data(), two[0][s].size() * sizeof(T)) ==
                    0);
        // Only the summation order differs from the flat replicas: rounding, 1e-10 in double.
        CHECK(max_tensor_rel_error(two[0][s], flat.params[0][s], flat.layout) <= 1e-10);
        if constexpr (Reduce::rounds_on_wire) {
            // all_to_all and all_gather deliver the flat group's blocks in the flat rank order,
            // and compressed sums each shard in rank order itself: the same bits as flat.
            CHECK(std::memcmp(two[0][s].data(), flat.params[0][s].data(),
                              two[0][s].size() * sizeof(T)) == 0);
        } else if constexpr (std::is_same_v<BN, lockstep::bn::global>) {
            CHECK(max_tensor_rel_error(two[0][s], one.params[0][s], one.layout) <= 1e-10);
        }
    }
}

} // namespace

TEST_CASE("data_parallel over 2 nodes x 2 replicas trains like 4 flat replicas (and, with exact "
          "sums and bn::global, like one)",
          "[comm][hierarchical][train]") {
    SECTION("sgd, bucketed, synchronized BN") {
        check_like_flat<double, lockstep::optim::sgd<double>, lockstep::reduce::bucketed<>,
                        lockstep::bn::global>({.lr = 0.1, .momentum = 0.9}, batch_schedule());
    }
    SECTION("sgd, compressed<bfloat16> (all_to_all over both levels): the flat bits only") {
        check_like_flat<float, lockstep::optim::sgd<float>,
                        lockstep::reduce::compressed<lockstep::bfloat16>, lockstep::bn::global>(
            {.lr = 0.1, .momentum = 0.9}, batch_schedule());
    }
    SECTION("lamb, sharded (ZeRO-1: reduce_scatter and all_gather over both levels)") {
        check_like_flat<double, lockstep::optim::lamb<double>, lockstep::reduce::sharded<>,
                        lockstep::bn::global>({.lr = 1e-2, .weight_decay = 1e-2}, batch_schedule());
    }
    SECTION("adam, per-tensor, BN statistics per node (bn::group<2>): like flat only") {
        // Batches whose every pair of replicas holds at least 2 samples (a group BN needs them).
        check_like_flat<double, lockstep::optim::adam<double>, lockstep::reduce::per_tensor,
                        lockstep::bn::group<2>>({.lr = 1e-3}, {37, 12, 20, 9, 16, 37, 12, 20});
    }
}

TEST_CASE("reduce::reproducible over 2 nodes x 2 replicas holds the bits of one replica",
          "[comm][hierarchical][train][reproducible]") {
    // The binned sums are exact, so the two-level summation order cannot show in any bit.
    using T = float;
    using opt = lockstep::optim::adamw<T>;
    const auto batches = repro_schedule(20);
    const lockstep::optim::adamw_params p{.lr = 1e-2, .weight_decay = 1e-2};
    const auto one = repro_threads<T, opt>(1, p, batches);
    std::vector<repro_record<T>> two(4);
    run_two_level(2, 2, [&](two_level& comm) {
        two[static_cast<std::size_t>(comm.rank())] = repro_train<T, opt>(comm, p, batches);
    });
    for (std::size_t r = 0; r < two.size(); ++r) {
        INFO("replica " << r);
        CHECK(repro_difference(two[r], one[0]).empty());
    }
}

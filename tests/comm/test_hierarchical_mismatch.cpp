// hierarchical_communicator when the nodes pass different arguments to one collective: every
// replica throws (none returns with a wrong result), and each error names the replica's
// hierarchical rank and what it passed, not the parts' own replica numbers and derived counts.
// Two "nodes" of two replica threads each, ranked so that a replica's hierarchical rank differs
// from its thread index (the number the thread parts' errors carry).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/thread_group.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

using lockstep::errc;
using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;
using two_level = lockstep::hierarchical_communicator<thread_communicator, thread_communicator>;

namespace {

constexpr int nodes = 2, local = 2, replicas = nodes * local;

/// What one replica's call ended with.
struct outcome {
    bool returned = false; ///< the collective returned normally
    bool threw = false;    ///< it threw lockstep::error
    errc code = errc::internal;
    int replica = -2;
    std::string operation, what;
};

/// Runs f(comm) on every replica of 2 nodes x 2 threads, thread w on node w % 2 at local rank
/// w / 2 (hierarchical rank (w % 2) * 2 + w / 2: threads 1 and 2 swap), and records how the
/// call ended per hierarchical rank.
std::vector<outcome> run_each(const std::function<void(two_level&)>& f) {
    std::vector<outcome> out(replicas);
    thread_group group(replicas, {.timeout = std::chrono::seconds(10)});
    try {
        group.run([&](thread_communicator& world) {
            thread_communicator intra = world.split(world.rank() % nodes, world.rank());
            thread_communicator inter = world.split(world.rank() / nodes, world.rank());
            two_level comm(std::move(intra), std::move(inter));
            // Every replica is past the constructor's collectives before any fails below.
            world.barrier();
            outcome& mine = out[static_cast<std::size_t>(comm.rank())];
            try {
                f(comm);
                mine.returned = true;
            } catch (const lockstep::error& e) {
                mine.threw = true;
                mine.code = e.code();
                mine.replica = e.replica();
                mine.operation = e.operation();
                mine.what = e.what();
                throw;
            }
        });
    } catch (const lockstep::error&) {
        // Each replica's own error is recorded above.
    }
    return out;
}

/// Every replica threw, naming its hierarchical rank, the collective and `passed(rank)` (what
/// that replica passed, as the error must state it); at least one error is the mismatch
/// itself (the rest may be errc::peer_failure, a part released after another part failed).
void check_every_replica_failed(const std::vector<outcome>& out, const std::string& op,
                                const std::function<std::string(int)>& passed) {
    int mismatches = 0;
    for (int r = 0; r < replicas; ++r) {
        const outcome& o = out[static_cast<std::size_t>(r)];
        CAPTURE(r, o.what);
        CHECK_FALSE(o.returned);
        REQUIRE(o.threw);
        CHECK(o.replica == r);
        CHECK(o.operation == "hierarchical_communicator." + op);
        CHECK(o.what.find(passed(r)) != std::string::npos);
        CHECK((o.code == errc::count_mismatch || o.code == errc::shape_mismatch ||
               o.code == errc::peer_failure));
        if (o.code != errc::peer_failure)
            ++mismatches;
    }
    CHECK(mismatches >= 1);
}

/// Replica r's value at element i (distinct per replica and element, exact in float).
float value(int r, std::size_t i) {
    return static_cast<float>((r + 1) * 1000 + (i % 97));
}

} // namespace

TEST_CASE("hierarchical_communicator: the same calls with equal counts give the plain sums",
          "[comm][hierarchical]") {
    // The control for the cases below: the large all_reduce, reduce_scatter and reduce return
    // the plain-loop results when every replica passes the same counts.
    const std::size_t n = static_cast<std::size_t>(local) * two_level::sharded_from + 1;
    const std::vector<std::size_t> counts = {1, 2, 0, 3};
    std::vector<int> bad(replicas, -1);
    run_each([&](two_level& comm) {
        const int me = comm.rank();
        int wrong = 0;
        std::vector<float> x(n), y(n, -1.0f);
        for (std::size_t i = 0; i < n; ++i)
            x[i] = value(me, i);
        comm.all_reduce(std::span<const float>(x), std::span<float>(y), reduce_op::sum);
        for (std::size_t i = 0; i < n; ++i) {
            float sum = 0;
            for (int q = 0; q < replicas; ++q)
                sum += value(q, i);
            wrong += y[i] != sum ? 1 : 0;
        }
        std::vector<float> s(6), got(counts[static_cast<std::size_t>(me)], -1.0f);
        for (std::size_t i = 0; i < s.size(); ++i)
            s[i] = value(me, i);
        comm.reduce_scatter(std::span<const float>(s), std::span<float>(got),
                            std::span<const std::size_t>(counts), reduce_op::sum);
        std::size_t at = 0;
        for (int q = 0; q < me; ++q)
            at += counts[static_cast<std::size_t>(q)];
        for (std::size_t i = 0; i < got.size(); ++i) {
            float sum = 0;
            for (int q = 0; q < replicas; ++q)
                sum += value(q, at + i);
            wrong += got[i] != sum ? 1 : 0;
        }
        std::vector<float> r3(3, -1.0f);
        comm.reduce(std::span<const float>(x.data(), 3), std::span<float>(r3), reduce_op::max, 1);
        if (me == 1)
            for (std::size_t i = 0; i < 3; ++i)
                wrong += r3[i] != value(replicas - 1, i) ? 1 : 0;
        bad[static_cast<std::size_t>(me)] = wrong;
    });
    CHECK(bad == std::vector<int>(replicas, 0));
}

TEST_CASE("hierarchical_communicator: an all_reduce whose count differs between nodes fails "
          "every replica",
          "[comm][hierarchical]") {
    const std::size_t S = two_level::sharded_from;
    // {node 0's count, node 1's}: node 0 takes the reduce-scatter path, node 1 the small one,
    // and each inter step's count is equal on both nodes (n / local_size() == node 1's count);
    // then one where only local rank 0's inter step differs (shards 4097 and 4096 against 4096).
    const auto counts =
        GENERATE_COPY(table<std::size_t, std::size_t>({{2 * S, S}, {2 * S + 1, S}}));
    const std::size_t n0 = std::get<0>(counts), n1 = std::get<1>(counts);
    CAPTURE(n0, n1);
    const auto out = run_each([&](two_level& comm) {
        const std::size_t n = comm.node() == 0 ? n0 : n1;
        std::vector<float> x(n, 1.0f), y(n, -1.0f);
        comm.all_reduce(std::span<const float>(x), std::span<float>(y), reduce_op::sum);
    });
    check_every_replica_failed(out, "all_reduce", [&](int r) {
        return "called it with " + std::to_string(r / local == 0 ? n0 : n1) + " float32 (sum)";
    });
}

TEST_CASE("hierarchical_communicator: reduce_scatter counts that differ between nodes fail every "
          "replica",
          "[comm][hierarchical]") {
    // The entries of local rank 1's replicas differ (1, 1 against 2, 0); local rank 0's inter
    // step sees equal counts. The sums match, so every replica's own arguments are consistent.
    const auto out = run_each([&](two_level& comm) {
        const std::vector<std::size_t> counts = comm.node() == 0
                                                    ? std::vector<std::size_t>{1, 1, 1, 1}
                                                    : std::vector<std::size_t>{1, 2, 1, 0};
        std::vector<float> s(4, 1.0f), r(counts[static_cast<std::size_t>(comm.rank())], -1.0f);
        comm.reduce_scatter(std::span<const float>(s), std::span<float>(r),
                            std::span<const std::size_t>(counts), reduce_op::sum);
    });
    check_every_replica_failed(out, "reduce_scatter", [](int) { return "4 float32 (sum)"; });
}

TEST_CASE("hierarchical_communicator: a reduce whose count differs between nodes fails every "
          "replica, not only the root's local rank",
          "[comm][hierarchical]") {
    const auto out = run_each([&](two_level& comm) {
        const std::size_t n = comm.node() == 0 ? 2 : 3;
        std::vector<float> s(n, 1.0f), r(n, -1.0f);
        comm.reduce(std::span<const float>(s), std::span<float>(r), reduce_op::sum, 0);
    });
    check_every_replica_failed(out, "reduce", [](int r) {
        return std::to_string(r / local == 0 ? 2 : 3) + " float32 (sum)";
    });
}

TEST_CASE("hierarchical_communicator: all_gather, broadcast and all_to_all errors name the "
          "caller's rank and count",
          "[comm][hierarchical]") {
    SECTION("all_gather") {
        const auto out = run_each([&](two_level& comm) {
            const std::size_t s = comm.node() == 0 ? 2 : 3;
            std::vector<float> x(s, 1.0f), all(s * replicas);
            comm.all_gather(std::span<const float>(x), std::span<float>(all));
        });
        check_every_replica_failed(out, "all_gather", [](int r) {
            return "called it with " + std::to_string(r / local == 0 ? 2 : 3) + " float32";
        });
    }
    SECTION("broadcast") {
        const auto out = run_each([&](two_level& comm) {
            std::vector<float> x(comm.node() == 0 ? 2 : 3, 1.0f);
            comm.broadcast(std::span<float>(x), 0);
        });
        check_every_replica_failed(out, "broadcast", [](int r) {
            return std::to_string(r / local == 0 ? 2 : 3) + " float32 (root 0)";
        });
    }
    SECTION("broadcast from roots that differ between nodes inside one node block") {
        // Roots 0 and 1 both lie in node 0: node 1 skips the intra step either way, so without
        // the comparison its replicas would take replica 0's data believing it replica 1's.
        const auto out = run_each([&](two_level& comm) {
            std::vector<float> x(2, static_cast<float>(comm.rank()));
            comm.broadcast(std::span<float>(x), comm.node());
        });
        check_every_replica_failed(out, "broadcast", [](int r) {
            return "2 float32 (root " + std::to_string(r / local) + ")";
        });
    }
    SECTION("all_to_all") {
        const auto out = run_each([&](two_level& comm) {
            const std::size_t n = comm.node() == 0 ? 4 : 8;
            std::vector<float> x(n, 1.0f), y(n);
            comm.all_to_all(std::span<const float>(x), std::span<float>(y));
        });
        check_every_replica_failed(out, "all_to_all", [](int r) {
            return "called it with " + std::to_string(r / local == 0 ? 4 : 8) + " float32";
        });
    }
}

// hierarchical_group under mpiexec: every process runs 2 replica threads, composed with MPI into
// one group of 2 x processes replicas. The collective suite, and data_parallel over it against
// the same number of flat thread replicas and against one replica.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/contains.hpp"
#include "support/mpi_session.hpp"

#include "collective_suite.hpp"
#include "train/train_runner.hpp"

#include "lockstep/comm/hierarchical_group.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/sgd.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using lockstep::hierarchical_group;
using comm_t = hierarchical_group::communicator_type;

namespace {
constexpr int threads_per_process = 2;
} // namespace

TEST_CASE("hierarchical_group passes the collective suite", "[comm][hierarchical][mpi]") {
    hierarchical_group group(MPI_COMM_WORLD, threads_per_process);
    std::vector<lockstep::testing::suite_report> reports(threads_per_process);
    std::vector<int> shape(threads_per_process, -1);
    group.run([&](comm_t& comm) {
        const auto l = static_cast<std::size_t>(comm.local_rank());
        shape[l] = comm.size() * 100 + comm.rank();
        reports[l] = lockstep::testing::run_collective_suite(
            comm, {.rank_order_sums = false, .rank_order_float16 = false});
    });
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    for (int l = 0; l < threads_per_process; ++l) // node-major global ranks
        CHECK(shape[static_cast<std::size_t>(l)] ==
              size * threads_per_process * 100 + rank * threads_per_process + l);
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.failed == 0);
        CHECK(r.checks > 200);
    }
}

namespace {

// The code of the lockstep::error f throws, or nothing.
template <class F>
std::optional<lockstep::errc> code_of(F&& f) {
    try {
        f();
    } catch (const lockstep::error& e) {
        return e.code();
    }
    return std::nullopt;
}

// The code and message of the lockstep::error f throws ("" when none).
template <class F>
std::pair<std::optional<lockstep::errc>, std::string> error_of(F&& f) {
    try {
        f();
    } catch (const lockstep::error& e) {
        return {e.code(), e.what()};
    }
    return {std::nullopt, ""};
}

// A group's parameters for the cases in which a replica fails: errors throw (no abort) and the
// threads' waits give up after 20 s.
hierarchical_group::params failing_params() {
    hierarchical_group::params p;
    p.abort_on_failure = false;
    p.mpi.on_failure = lockstep::mpi_failure_action::throw_error;
    p.threads.timeout = std::chrono::seconds(20);
    return p;
}

// Whether this process is the last of MPI_COMM_WORLD's `processes`.
bool on_last_process(int processes) {
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank == processes - 1;
}

} // namespace

TEST_CASE("hierarchical_group refuses different thread counts on every process",
          "[comm][hierarchical][mpi]") {
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    REQUIRE(size == 2);
    // Bounded and thrown, so that a process left waiting fails this case (nothing waits for
    // long when the processes agree: 20 s leaves room for MPI's progress on busy cores).
    hierarchical_group::params p;
    p.mpi.timeout = std::chrono::milliseconds(20000);
    p.mpi.on_failure = lockstep::mpi_failure_action::throw_error;
    // Process r runs 1 + r threads: both throw, naming both counts.
    const auto [code, what] = error_of([&] { hierarchical_group g(MPI_COMM_WORLD, 1 + rank, p); });
    CHECK(code == lockstep::errc::invalid_argument);
    CHECK_THAT(what, Catch::Contains("process 0 runs 1, process 1 runs 2") &&
                         Catch::Contains("same thread count"));
    // Process 1 asks for 0 threads: it reports its own error, process 0 a peer failure.
    const auto [code0, what0] =
        error_of([&] { hierarchical_group g(MPI_COMM_WORLD, rank == 1 ? 0 : 2, p); });
    if (rank == 1) {
        CHECK(code0 == lockstep::errc::invalid_argument);
        CHECK_THAT(what0, Catch::Contains("threads 0 must be at least 1"));
    } else {
        CHECK(code0 == lockstep::errc::peer_failure);
        CHECK_THAT(what0, Catch::Contains("process 1 could not set up its replicas"));
    }
    // Both processes are free for the next group.
    hierarchical_group ok(MPI_COMM_WORLD, 1, p);
    int ran = 0;
    ok.run([&](comm_t& comm) {
        int one[] = {1};
        comm.all_reduce(std::span<const int>(one), std::span<int>(one), lockstep::reduce_op::sum);
        ran = one[0];
    });
    CHECK(ran == 2);
}

TEST_CASE("hierarchical_group rethrows a failing replica's error, not its handle's departure",
          "[comm][hierarchical][mpi]") {
    // Thread 2 of each process throws while threads 0 and 1 wait for it in an intra-process
    // barrier: its handle departs while the exception leaves, after the failure is recorded.
    hierarchical_group::params p;
    p.abort_on_failure = false;
    p.mpi.timeout = std::chrono::milliseconds(20000);
    p.mpi.on_failure = lockstep::mpi_failure_action::throw_error;
    p.threads.timeout = std::chrono::seconds(20);
    std::vector<std::string> lost;
    for (int attempt = 0; attempt < 10; ++attempt) {
        hierarchical_group g(MPI_COMM_WORLD, 3, p);
        try {
            g.run([&](comm_t& comm) {
                if (comm.local_rank() == 2) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
                    throw std::runtime_error("the real cause");
                }
                comm.intra().barrier();
            });
            lost.emplace_back("run returned");
        } catch (const std::exception& e) {
            if (!Catch::Contains("the real cause").match(e.what()))
                lost.emplace_back(e.what());
        }
    }
    for (const auto& what : lost)
        UNSCOPED_INFO(what);
    CHECK(lost.empty());
}

// A failure the intra-node part raises itself (here a peer thread's departure) numbers the
// process's threads 0..L-1; run() rethrows it as the hierarchical collective reported it, naming
// the replica's rank in the whole job, its node and local rank.
TEST_CASE("hierarchical_group rethrows an intra-node failure naming the replica's rank in the job",
          "[comm][hierarchical][mpi]") {
    hierarchical_group g(MPI_COMM_WORLD, 2, failing_params());
    // Read before run(): a replica returning moves its MPI part back into the group.
    const int processes = g.processes();
    const int last = processes * 2 - 1;
    const auto [code, what] = error_of([&] {
        g.run([&](comm_t& comm) {
            std::vector<float> v(4, 1.0f);
            comm.all_reduce(std::span<const float>(v), std::span<float>(v),
                            lockstep::reduce_op::sum);
            if (comm.node() != processes - 1 || comm.rank() == last)
                return; // the last replica leaves; its node's other replica reduces again
            comm.all_reduce(std::span<const float>(v), std::span<float>(v),
                            lockstep::reduce_op::sum);
        });
    });
    if (on_last_process(processes)) {
        INFO(what);
        CHECK(code == lockstep::errc::peer_failure);
        CHECK(lockstep_test::contains(what, "replica " + std::to_string(last - 1) +
                                                ": hierarchical_communicator.all_reduce"));
        CHECK(lockstep_test::contains(what, "(node " + std::to_string(processes - 1) +
                                                ", local rank 0)"));
        CHECK(lockstep_test::contains(what, "replica 1 left the group"));
    } else {
        CHECK(what.empty());
    }
}

TEST_CASE("a split hierarchical group's errors name the replica as the whole group does",
          "[comm][hierarchical][mpi]") {
    // Split by node (bn::group<2>'s split): the last process's second replica leaves before the
    // split's all_reduce, and its node's first replica fails there. Its error must name it as
    // the whole group does (replica and node), not by its split's numbers (replica 0, node 0).
    hierarchical_group g(MPI_COMM_WORLD, 2, failing_params());
    const int processes = g.processes();
    const int last = processes * 2 - 1;
    const auto [code, what] = error_of([&] {
        g.run([&](comm_t& comm) {
            comm_t node = comm.split(comm.node(), comm.rank());
            if (comm.rank() == last)
                return;
            std::vector<float> v(4, 1.0f);
            node.all_reduce(std::span<const float>(v), std::span<float>(v),
                            lockstep::reduce_op::sum);
        });
    });
    if (on_last_process(processes)) {
        INFO(what);
        CHECK(lockstep_test::contains(
            what, "replica " + std::to_string(last - 1) +
                      ": hierarchical_communicator.all_reduce in split(color=" +
                      std::to_string(processes - 1) + "): this replica (node " +
                      std::to_string(processes - 1) +
                      ", local rank 0; replica 0 of the split) called it with 4 float32 (sum); "
                      "its intra-node part (the communicator of node " +
                      std::to_string(processes - 1) + "), split, failed"));
        CHECK(lockstep_test::contains(what, "replica 1 left the group"));
    } else {
        CHECK(what.empty());
    }
}

// A run whose replicas fail a collective that MPI refuses (the communicators stay usable) must
// leave the group able to run again: each replica's MPI communicator returns to it on the way
// out of a failure too.
TEST_CASE("hierarchical_group runs again after a run whose replicas threw",
          "[comm][hierarchical][mpi]") {
    hierarchical_group g(MPI_COMM_WORLD, 2, failing_params());
    std::string first;
    try {
        g.run([&](comm_t& comm) { // the processes pass different counts: refused everywhere
            std::vector<float> v(comm.node() == 0 ? 4 : 5, 1.0f);
            comm.all_reduce(std::span<const float>(v), std::span<float>(v),
                            lockstep::reduce_op::sum);
        });
    } catch (const lockstep::error& e) {
        first = e.what();
    }
    CHECK_FALSE(first.empty());
    std::vector<int> sums(2, -1);
    g.run([&](comm_t& comm) {
        std::vector<int> v(3, comm.rank() + 1);
        comm.all_reduce(std::span<const int>(v), std::span<int>(v), lockstep::reduce_op::sum);
        sums[static_cast<std::size_t>(comm.local_rank())] = v[0];
    });
    const int n = g.processes() * g.threads();
    CHECK(sums == std::vector<int>(2, n * (n + 1) / 2));
}

// Process 0 passes 2 * sharded_from elements (the reduce-scatter path for 2 threads,
// whose inter-node all_reduces take sharded_from each), process 1 sharded_from (the small path,
// whose inter-node all_reduce takes as many): every replica must throw, naming its own rank and
// count, instead of returning sums of unrelated elements.
TEST_CASE("hierarchical_group: an all_reduce whose count differs between processes fails every "
          "replica, naming its rank and count",
          "[comm][hierarchical][mpi]") {
    hierarchical_group g(MPI_COMM_WORLD, threads_per_process, failing_params());
    REQUIRE(g.processes() == 2);
    std::vector<std::string> whats(threads_per_process);
    std::vector<int> ranks(threads_per_process, -1), returned(threads_per_process, 0);
    const std::size_t small = comm_t::sharded_from, large = 2 * comm_t::sharded_from;
    int my_node = -1;
    try {
        g.run([&](comm_t& comm) {
            const auto l = static_cast<std::size_t>(comm.local_rank());
            if (l == 0) // one writer: read after run() joined the threads
                my_node = comm.node();
            std::vector<float> x(comm.node() == 0 ? large : small, 1.0f);
            try {
                comm.all_reduce(std::span<const float>(x), std::span<float>(x),
                                lockstep::reduce_op::sum);
                returned[l] = 1;
            } catch (const lockstep::error& e) {
                whats[l] = e.what();
                ranks[l] = e.replica();
                throw;
            }
        });
    } catch (const lockstep::error&) {
        // each replica's error is recorded above
    }
    for (int l = 0; l < threads_per_process; ++l) {
        const auto i = static_cast<std::size_t>(l);
        CAPTURE(l, whats[i]);
        CHECK(returned[i] == 0);
        CHECK(ranks[i] == my_node * threads_per_process + l);
        CHECK_THAT(whats[i],
                   Catch::Contains("hierarchical_communicator.all_reduce: this replica") &&
                       Catch::Contains("called it with " +
                                       std::to_string(my_node == 0 ? large : small) +
                                       " float32 (sum)"));
    }
}

TEST_CASE("hierarchical_group point-to-point: every pair, in order, recv_any, wrong sizes",
          "[comm][hierarchical][mpi][p2p]") {
    hierarchical_group group(MPI_COMM_WORLD, threads_per_process);
    // Replica threads record what went wrong; Catch2 checks it after run().
    std::vector<std::vector<std::string>> problems(threads_per_process);
    std::vector<int> ran(threads_per_process, 0);
    group.run([&](comm_t& comm) {
        auto& bad = problems[static_cast<std::size_t>(comm.local_rank())];
        auto expect = [&](bool ok, const std::string& what) {
            if (!ok)
                bad.push_back("replica " + std::to_string(comm.rank()) + ": " + what);
        };
        const int n = comm.size(), me = comm.rank();
        // Every replica sends two messages to every replica (itself included: same thread,
        // same process, other process), then receives them by source in reverse order.
        for (int d = 0; d < n; ++d)
            for (int k = 0; k < 2; ++k) {
                const std::vector<int> msg{me, d, k};
                comm.send(std::span<const int>(msg), d, 7);
            }
        for (int s = n - 1; s >= 0; --s)
            for (int k = 0; k < 2; ++k) {
                std::vector<int> got(3, -1);
                comm.recv(std::span<int>(got), s, 7);
                expect(got == std::vector<int>{s, me, k},
                       "message " + std::to_string(k) + " from " + std::to_string(s) + " is {" +
                           std::to_string(got[0]) + ", " + std::to_string(got[1]) + ", " +
                           std::to_string(got[2]) + "}");
            }
        comm.barrier();
        // recv_any: every other replica sends its rank to the last replica (another process
        // and the same one), which takes them in arrival order.
        const int sink = n - 1;
        if (me != sink) {
            const std::vector<double> msg{double(me), 0.5};
            comm.send(std::span<const double>(msg), sink, 9);
        } else {
            std::vector<int> seen;
            for (int k = 0; k + 1 < n; ++k) {
                std::vector<double> got(2);
                const int from = comm.recv_any(std::span<double>(got), 9);
                expect(got[0] == double(from) && got[1] == 0.5,
                       "recv_any returned " + std::to_string(from) + " for a message from " +
                           std::to_string(got[0]));
                seen.push_back(from);
            }
            std::sort(seen.begin(), seen.end());
            std::vector<int> all(static_cast<std::size_t>(n - 1));
            for (int k = 0; k + 1 < n; ++k)
                all[static_cast<std::size_t>(k)] = k;
            expect(seen == all, "recv_any did not return every other replica once");
        }
        // A wrongly sized message is an error and is consumed; the next one arrives intact.
        if (me == n - 1) {
            const std::vector<int> five{1, 2, 3, 4, 5}, three{7, 8, 9};
            comm.send(std::span<const int>(five), 0, 10);
            comm.send(std::span<const int>(five), 0, 10);
            comm.send(std::span<const int>(three), 0, 10);
        } else if (me == 0) {
            std::vector<int> four(4), three(3);
            const auto [code, what] = error_of([&] { comm.recv(std::span<int>(four), n - 1, 10); });
            expect(code == lockstep::errc::count_mismatch, "recv of a wrongly sized message");
            // Named in group ranks (the mailbox's own error names MPI processes).
            expect(what.find("replica 0: recv: with replica " + std::to_string(n - 1)) !=
                       std::string::npos,
                   "the recv error names both replicas: " + what);
            expect(code_of([&] { comm.recv_any(std::span<int>(four), 10); }) ==
                       lockstep::errc::count_mismatch,
                   "recv_any of a wrongly sized message");
            comm.recv(std::span<int>(three), n - 1, 10);
            expect(three == std::vector<int>{7, 8, 9}, "the message after the wrong ones");
        }
        expect(code_of([&] { comm.send(std::span<const int>(), n, 0); }) ==
                   lockstep::errc::invalid_argument,
               "send to a replica outside the group");
        // A split group (one local rank per process) sends on its own ranks.
        comm_t pair = comm.split(comm.local_rank(), me);
        if (pair.rank() == 0) {
            const std::vector<int> msg{me};
            pair.send(std::span<const int>(msg), pair.size() - 1, 11);
        }
        if (pair.rank() == pair.size() - 1) {
            std::vector<int> got(1, -1);
            const int from = pair.recv_any(std::span<int>(got), 11);
            expect(from == 0 && got[0] == comm.local_rank(),
                   "split group: recv_any returned " + std::to_string(from) + ", message " +
                       std::to_string(got[0]));
        }
        comm.barrier();
        ran[static_cast<std::size_t>(comm.local_rank())] = 1;
    });
    for (const auto& b : problems)
        for (const auto& what : b)
            FAIL_CHECK(what);
    CHECK(ran == std::vector<int>(threads_per_process, 1));
}

namespace {

using namespace lockstep_test;

template <class T, class Opt, class Reduce>
void check_like_flat(typename Opt::params_type p) {
    using net = mlp<T, comm_t, storage::registry, lockstep::bn::global>;
    hierarchical_group group(MPI_COMM_WORLD, threads_per_process);
    std::vector<std::vector<std::vector<T>>> mine(threads_per_process);
    int replicas = 0, first_rank = 0;
    group.run([&](comm_t& comm) {
        lockstep::data_parallel<net, Opt, lockstep::sync::synchronous, Reduce, comm_t> dp(
            comm, [](auto& ctx) { return net(ctx); }, p, {.seed = 42});
        for (std::size_t b : batch_schedule()) {
            dp.step(b, [](net& n, const lockstep::shard_range& r, auto& ctx) {
                return n.train(r, ctx);
            });
            auto v = dp.parameters();
            mine[static_cast<std::size_t>(comm.local_rank())].emplace_back(v.begin(), v.end());
        }
        if (comm.local_rank() == 0) {
            replicas = comm.size();
            first_rank = comm.rank();
        }
    });
    // Every replica of every process holds the same bits: compare with global replica 0's.
    for (std::size_t s = 0; s < mine[0].size(); ++s) {
        std::vector<T> root = mine[0][s];
        MPI_Bcast(root.data(), static_cast<int>(root.size() * sizeof(T)), MPI_BYTE, 0,
                  MPI_COMM_WORLD);
        for (const auto& m : mine)
            REQUIRE(std::memcmp(root.data(), m[s].data(), root.size() * sizeof(T)) == 0);
    }
    const auto flat = train_run<T, Opt, lockstep::sync::synchronous, Reduce, storage::registry>(
        {.replicas = replicas}, p);
    const auto one = train_run<T, Opt, lockstep::sync::synchronous, lockstep::reduce::per_tensor,
                               storage::registry>({.replicas = 1}, p);
    CAPTURE(replicas, first_rank);
    for (std::size_t s = 0; s < mine[0].size(); ++s) {
        INFO("step " << s);
        // Only the summation order differs: rounding, within 1e-10 in double.
        CHECK(max_tensor_rel_error(mine[0][s], flat.params[0][s], flat.layout) <= 1e-10);
        CHECK(max_tensor_rel_error(mine[0][s], one.params[0][s], one.layout) <= 1e-10);
    }
}

} // namespace

TEST_CASE("data_parallel over processes x 2 threads trains like flat replicas and like one",
          "[comm][hierarchical][mpi][train]") {
    SECTION("sgd, bucketed") {
        check_like_flat<double, lockstep::optim::sgd<double>, lockstep::reduce::bucketed<>>(
            {.lr = 0.1, .momentum = 0.9});
    }
    SECTION("lamb, per-tensor") {
        check_like_flat<double, lockstep::optim::lamb<double>, lockstep::reduce::per_tensor>(
            {.lr = 1e-3, .weight_decay = 0.01});
    }
}

int main(int argc, char** argv) {
    // Only the requirement: mpi_environment asks MPI_Init_thread for at least that level.
    return lockstep::testing::run_mpi_session(argc, argv, {.required = MPI_THREAD_MULTIPLE});
}

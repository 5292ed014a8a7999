// thread_communicator::shrink: the survivors of a failed thread group agree once on who is left
// out, continue in a new group, and an excluded replica that is still alive cannot reach them.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using lockstep::collective_event;
using lockstep::errc;
using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;
using namespace std::chrono_literals;

using lockstep_test::contains;

namespace {

/// What a survivor saw: the error of its failed collective, the shrink's answer, its new rank
/// and size, and a sum over the new group.
struct survivor {
    errc failed_with = errc::internal;
    std::vector<int> lost;
    int rank = -1;
    int size = -1;
    int generation = -1;
    double sum = 0;
};

/// replica() + 1 summed over comm's group.
double sum_of_replicas(thread_communicator& comm) {
    std::array<double, 1> v{static_cast<double>(comm.replica() + 1)};
    comm.all_reduce(std::span<const double>(v), std::span<double>(v), reduce_op::sum);
    return v[0];
}

/// Runs `body`, which is expected to fail with a lockstep::error, shrinks, and records what the
/// survivor sees. (A collective that completed on some replica can still fail on another that
/// had not yet seen it complete when the group failed: everything before the shrink is inside.)
template <class Body>
survivor fail_then_shrink(thread_communicator& comm, Body&& body) {
    survivor s; // failed_with stays errc::internal if nothing failed
    try {
        body();
    } catch (const lockstep::error& e) {
        s.failed_with = e.code();
    }
    s.lost = comm.shrink();
    s.rank = comm.rank();
    s.size = comm.size();
    s.generation = comm.generation();
    s.sum = sum_of_replicas(comm);
    return s;
}

} // namespace

TEST_CASE("the survivors of a replica whose thread ended shrink and continue", "[shrink]") {
    thread_group group(4, {.timeout = 10s});
    std::vector<survivor> seen(4);
    std::mutex m;
    group.run([&](thread_communicator& comm) {
        const survivor s = fail_then_shrink(comm, [&] {
            (void)sum_of_replicas(comm);
            if (comm.replica() == 1) // not a lockstep::error: it leaves the function
                throw std::runtime_error("replica 1's device fell off the bus");
            (void)sum_of_replicas(comm);
        });
        std::lock_guard lock(m);
        seen[static_cast<std::size_t>(comm.replica())] = s;
    });
    // run() returns: the newest group finished without a failure.
    const int new_rank[4] = {0, -1, 1, 2};
    for (int r : {0, 2, 3}) {
        const survivor& s = seen[static_cast<std::size_t>(r)];
        CHECK(s.failed_with == errc::peer_failure);
        CHECK(s.lost == std::vector<int>{1});
        CHECK(s.rank == new_rank[r]); // renumbered in the old rank order
        CHECK(s.size == 3);
        CHECK(s.generation == 1);
        CHECK(s.sum == 1.0 + 3.0 + 4.0);
    }
    REQUIRE(group.lost().size() == 1);
    CHECK(group.lost()[0].replica == 1);
    CHECK(group.lost()[0].generation == 0);
    CHECK(contains(group.lost()[0].reason, "fell off the bus"));
}

TEST_CASE("a stalled replica is left out after the timeout and cannot rejoin", "[shrink]") {
    // The survivors must each reach the shrink within the timeout of the first one's arrival:
    // 3 s leaves room for a survivor descheduled on a loaded machine (TSan, ctest -j).
    thread_group group(3, {.timeout = 3000ms});
    std::vector<survivor> seen(3);
    std::string fenced_call;
    std::string fenced_shrink;
    std::atomic<bool> shrunk{false};
    std::vector<double> later(2);
    group.run([&](thread_communicator& comm) {
        if (comm.replica() == 2) {
            while (!shrunk.load()) // stalls in its own code past the others' timeout
                std::this_thread::sleep_for(10ms);
            try {
                (void)sum_of_replicas(comm);
            } catch (const lockstep::error& e) {
                fenced_call = e.what();
            }
            try {
                (void)comm.shrink();
            } catch (const lockstep::error& e) {
                fenced_shrink = e.what();
            }
            return; // its thread ends normally: run() does not count it as a failure
        }
        const survivor s = fail_then_shrink(comm, [&] { (void)sum_of_replicas(comm); });
        seen[static_cast<std::size_t>(comm.replica())] = s;
        comm.barrier();
        shrunk.store(true);
        later[static_cast<std::size_t>(comm.replica())] = sum_of_replicas(comm);
    });
    for (int r : {0, 1}) {
        const errc got = seen[static_cast<std::size_t>(r)].failed_with;
        CHECK((got == errc::timeout || got == errc::peer_failure));
        CHECK(seen[static_cast<std::size_t>(r)].lost == std::vector<int>{2});
        CHECK(seen[static_cast<std::size_t>(r)].size == 2);
        CHECK(seen[static_cast<std::size_t>(r)].sum == 3.0);
        CHECK(later[static_cast<std::size_t>(r)] == 3.0); // still a working group
    }
    CHECK(contains(fenced_call, "the group was shrunk: replicas 0, 1 continue as generation 1"));
    CHECK(contains(fenced_shrink, "it cannot rejoin"));
    REQUIRE(group.lost().size() == 1);
    CHECK(contains(group.lost()[0].reason, "did not join the shrink within 3000 ms"));
}

TEST_CASE("a split cannot shrink; a failure after a shrink fails the run", "[shrink]") {
    thread_group group(2, {.timeout = 5s});
    std::string split_error;
    std::atomic<int> sizes{0};
    REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
        thread_communicator alone = comm.split(comm.rank(), 0);
        try {
            (void)alone.shrink();
        } catch (const lockstep::error& e) {
            if (comm.rank() == 0)
                split_error = e.what();
        }
        (void)comm.shrink(); // a healthy group can shrink too: both stay
        sizes += comm.size();
        if (comm.rank() == 1)
            throw std::runtime_error("a failure in generation 1");
        comm.barrier();
    }),
                        Catch::Contains("a failure in generation 1"));
    CHECK(contains(split_error, "not a split"));
    CHECK(sizes.load() == 4);
    CHECK(group.lost().empty());
}

TEST_CASE("on_collective sees every collective twice and can fail a replica after arrival",
          "[shrink]") {
    std::mutex m;
    std::vector<collective_event> events;
    thread_group::params p{.timeout = 5s};
    p.on_collective = [&](const collective_event& e) {
        {
            std::lock_guard lock(m);
            events.push_back(e);
        }
        if (e.replica == 1 && e.seq == 1 && e.when == collective_event::moment::arrived)
            throw std::runtime_error("injected after arrival");
    };
    thread_group group(2, p);
    std::atomic<int> shrunk{0};
    std::atomic<bool> failed{false};
    std::atomic<bool> passed{false};
    group.run([&](thread_communicator& comm) {
        comm.barrier();
        // Replica 1 fails only once replica 0 has left the first barrier (an abandoned
        // collective also fails a peer still checking the one before), and replica 0 enters the
        // second one after the failure: its barrier throws.
        if (comm.replica() == 0) {
            passed.store(true);
            while (!failed.load())
                std::this_thread::sleep_for(1ms);
        } else {
            while (!passed.load())
                std::this_thread::sleep_for(1ms);
        }
        try {
            comm.barrier();
        } catch (const lockstep::error&) { // (a std::runtime_error too: caught first)
            (void)comm.shrink();
            shrunk += comm.size();
        } catch (const std::runtime_error&) {
            failed.store(true);
            return; // replica 1 ends its thread
        }
    });
    CHECK(shrunk.load() == 1);
    std::lock_guard lock(m);
    int entered = 0;
    int arrived = 0;
    for (const collective_event& e : events) {
        CHECK(e.collective == "barrier");
        CHECK(e.generation == 0);
        entered += e.when == collective_event::moment::entered ? 1 : 0;
        arrived += e.when == collective_event::moment::arrived ? 1 : 0;
    }
    CHECK(entered == 4);
    CHECK(arrived == 3); // replica 0's second barrier failed before it arrived
}

TEST_CASE("an abort between a replica's loss and the survivors' shrink fails the shrunk group",
          "[shrink]") {
    // Replica 1's thread ends with a failure; replica 0 aborts the run after its barrier saw the
    // loss and before it joins the shrink, so the survivors' decision (which waits for it) comes
    // after the abort: the group the shrink makes must start aborted, not train on.
    thread_group group(3, {.timeout = 10s});
    std::vector<int> abort_returned(3, -1);
    std::vector<int> shrunk_to(3, -1);
    std::vector<std::string> after_shrink(3);
    REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.replica());
        if (comm.replica() == 1)
            throw std::runtime_error("replica 1 is lost");
        try {
            comm.barrier();
        } catch (const lockstep::error&) {
        }
        if (comm.replica() == 0)
            abort_returned[r] = group.abort("the user stopped training") ? 1 : 0;
        (void)comm.shrink();
        shrunk_to[r] = comm.size();
        try {
            for (int i = 0; i < 200; ++i)
                comm.barrier();
            after_shrink[r] = "200 barriers after the abort";
        } catch (const lockstep::error& e) {
            after_shrink[r] = e.what();
            throw;
        }
    }),
                        Catch::Contains("thread_group.abort") &&
                            Catch::Contains("the user stopped training"));
    CHECK(abort_returned[0] == 0); // the failed group was not aborted by it: its successor is
    for (int r : {0, 2}) {
        CAPTURE(r);
        CHECK(shrunk_to[static_cast<std::size_t>(r)] == 2);
        CHECK(contains(after_shrink[static_cast<std::size_t>(r)],
                       "the run was aborted: the user stopped training"));
    }
    REQUIRE(group.lost().size() == 1);
    CHECK(group.lost()[0].replica == 1);
}

TEST_CASE("a replica whose thread ended with the failure's peer_failure is not shrunk over",
          "[shrink]") {
    // Replica 1 is lost. Replica 2 lets its barrier's errc::peer_failure end its thread (it is
    // not in a shrink: finish(), a checkpoint, code of its own); replicas 0 and 3 shrink. Replica
    // 2 was healthy, so the shrink is refused on both rather than dropping it with replica 1,
    // and run() throws replica 1's failure.
    thread_group group(4, {.timeout = 10s});
    std::vector<std::string> refused(4);
    std::vector<int> shrunk_to(4, -1);
    REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.replica());
        if (comm.replica() == 1)
            throw std::runtime_error("replica 1 is lost");
        if (comm.replica() == 2) {
            comm.barrier(); // throws errc::peer_failure: its thread ends with it
            return;
        }
        try {
            comm.barrier();
        } catch (const lockstep::error&) {
        }
        try {
            (void)comm.shrink();
            shrunk_to[r] = comm.size();
        } catch (const lockstep::error& e) {
            refused[r] = e.what();
            throw;
        }
    }),
                        Catch::Contains("replica 1 is lost"));
    for (int r : {0, 3}) {
        CAPTURE(r, refused[static_cast<std::size_t>(r)]);
        CHECK(shrunk_to[static_cast<std::size_t>(r)] == -1);
        CHECK(contains(refused[static_cast<std::size_t>(r)],
                       "thread_communicator.shrink: the group does not shrink: replica 1 failed: "
                       "replica 1 is lost; replica 2 (errc::peer_failure) ended with an error"));
    }
    CHECK(group.lost().empty());
}

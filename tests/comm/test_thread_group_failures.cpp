// Failure tests of thread_group: a replica that throws, never arrives, leaves, or disagrees
// with its peers must turn into a clear error on every replica, never a hang.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <csignal>
#include <ctime>
#include <sys/mman.h>
#include <unistd.h>

using lockstep::errc;
using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;
using namespace std::chrono_literals;

using lockstep_test::contains;

namespace {

/// What one replica caught (code and message), recorded from the replica threads.
struct outcome {
    bool threw = false;
    errc code = errc::internal;
    std::string what;
};

/// Runs body on each replica, records the lockstep::error it throws (if any) in out[rank] and
/// rethrows it.
template <class Body>
void run_recording(thread_group& group, std::vector<outcome>& out, Body body) {
    out.assign(static_cast<std::size_t>(group.size()), outcome{});
    group.run([&](thread_communicator& comm) {
        auto& o = out[static_cast<std::size_t>(comm.rank())];
        try {
            body(comm);
        } catch (const lockstep::error& e) {
            o = {true, e.code(), e.what()};
            throw;
        }
    });
}

/// A misuse of a collective: its name, the error every replica gets and part of its message.
struct misuse {
    const char* name;
    errc code;
    const char* text;
};

/// Runs call(comm) on each of 3 replicas: every replica throws which.code with which.text and
/// `op` ("all_to_all #0") in its message, and, refused before any data moves, the group stays
/// usable (an all_reduce after it sums every replica's rank).
template <class Call>
void check_refused(const misuse& which, const char* op, Call call) {
    thread_group group(3);
    std::vector<outcome> seen(3);
    std::vector<float> after(3, 0.0f);
    group.run([&](thread_communicator& comm) {
        const int me = comm.rank();
        try {
            call(comm);
        } catch (const lockstep::error& e) {
            seen[static_cast<std::size_t>(me)] = {true, e.code(), e.what()};
        }
        std::vector<float> w{static_cast<float>(me)};
        comm.all_reduce(std::span<const float>(w), std::span<float>(w), reduce_op::sum);
        after[static_cast<std::size_t>(me)] = w[0];
    });
    for (int r = 0; r < 3; ++r) {
        const auto& o = seen[static_cast<std::size_t>(r)];
        CAPTURE(o.what);
        CHECK(o.threw);
        CHECK(o.code == which.code);
        CHECK(contains(o.what, which.text));
        CHECK(contains(o.what, op));
        CHECK(after[static_cast<std::size_t>(r)] == 3.0f);
    }
}

} // namespace

TEST_CASE("a replica that throws releases its peers with peer_failure", "[comm][thread]") {
    thread_group group(4);
    std::vector<outcome> out;
    try {
        run_recording(group, out, [&](thread_communicator& comm) {
            std::vector<float> v(1000, 1.0f);
            comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
            if (comm.rank() == 2) {
                std::this_thread::sleep_for(50ms); // the others are blocked in all_reduce #1
                throw std::runtime_error("replica two broke");
            }
            comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
        });
        FAIL("run returned although replica 2 threw");
    } catch (const lockstep::error& e) {
        FAIL("run rethrew a derived lockstep::error instead of the root cause: " << e.what());
    } catch (const std::runtime_error& e) {
        CHECK(std::string(e.what()) == "replica two broke");
    }
    // The peers, blocked in all_reduce #2, were released with peer_failure (not the timeout).
    REQUIRE(out.size() == 4);
    for (int r : {0, 1, 3}) {
        const outcome& o = out[static_cast<std::size_t>(r)];
        CAPTURE(r, o.what);
        CHECK(o.threw);
        CHECK(o.code == errc::peer_failure);
        CHECK(contains(o.what, "replica 2"));
    }
    CHECK_FALSE(out[2].threw); // its own exception is not a lockstep::error
}

TEST_CASE("a collective every replica reached completes although a later one failed first",
          "[comm][thread]") {
    // Replica 0 arrives at all_reduce #0 (one phase) and then stalls in the hook; replicas 1
    // and 2 see the phase complete, and replica 1 fails on arrival at barrier #1. Replica 0's
    // all_reduce #0 is whole (every replica reached its final phase): it returns the sum, as it
    // did on the others, and barrier #1 reports the failure. Each of 5 trials.
    for (int trial = 0; trial < 5; ++trial) {
        thread_group::params p{.timeout = 10s};
        p.on_collective = [](const lockstep::collective_event& e) {
            if (e.when != lockstep::collective_event::moment::arrived)
                return;
            if (e.replica == 0 && e.seq == 0)
                std::this_thread::sleep_for(200ms);
            if (e.replica == 1 && e.seq == 1)
                throw std::runtime_error("replica 1 fails at the barrier");
        };
        thread_group group(3, p);
        std::vector<double> sums(3, -1);
        std::vector<std::string> errors(3);
        try {
            group.run([&](thread_communicator& comm) {
                const auto r = static_cast<std::size_t>(comm.rank());
                std::array<double, 4> v{};
                v.fill(static_cast<double>(comm.rank() + 1));
                try {
                    comm.all_reduce(std::span<const double>(v), std::span<double>(v),
                                    reduce_op::sum);
                    sums[r] = v[3];
                    comm.barrier();
                } catch (const std::exception& e) {
                    errors[r] = e.what();
                    throw;
                }
            });
        } catch (const std::runtime_error&) {
        }
        CAPTURE(trial, errors[0], errors[2]);
        for (std::size_t r = 0; r < 3; ++r)
            CHECK(sums[r] == 6.0); // 1 + 2 + 3
        CHECK(contains(errors[0], "barrier #1"));
        CHECK(contains(errors[0], "replica 1 fails at the barrier"));
        CHECK(errors[1] == "replica 1 fails at the barrier");
    }
}

TEST_CASE("peers of a failed replica see who failed and why", "[comm][thread]") {
    thread_group group(3);
    std::vector<outcome> out(3), later(3);
    REQUIRE_THROWS_WITH(group.run([&](thread_communicator& comm) {
        if (comm.rank() == 0) {
            std::this_thread::sleep_for(30ms);
            throw std::logic_error("bad shard");
        }
        try {
            comm.barrier();
        } catch (const lockstep::error& e) {
            out[static_cast<std::size_t>(comm.rank())] = {true, e.code(), e.what()};
        }
        // Later collectives fail at once too: the group is dead.
        try {
            std::vector<int> v(3, 1);
            comm.broadcast(std::span<int>(v), 1);
        } catch (const lockstep::error& e) {
            later[static_cast<std::size_t>(comm.rank())] = {true, e.code(), e.what()};
        }
    }),
                        "bad shard");
    for (int r = 1; r < 3; ++r) {
        const auto& o = out[static_cast<std::size_t>(r)];
        CHECK(o.threw);
        CHECK(o.code == errc::peer_failure);
        CHECK(contains(o.what, "barrier #0"));
        CHECK(contains(o.what, "replica 0 failed: bad shard"));
        // The next collective fails at once too: the group is dead.
        CHECK(later[static_cast<std::size_t>(r)].threw);
        CHECK(later[static_cast<std::size_t>(r)].code == errc::peer_failure);
    }
}

TEST_CASE("a timeout of milliseconds::max() waits for a straggler instead of timing out",
          "[comm][thread]") {
    // The deadline is saturated (1e9 s): now + milliseconds::max() must not overflow into the
    // past.
    thread_group group(3, {.timeout = std::chrono::milliseconds::max()});
    std::vector<outcome> out;
    std::vector<int> sums(3, -1);
    run_recording(group, out, [&](thread_communicator& comm) {
        if (comm.rank() == 1)
            std::this_thread::sleep_for(50ms);
        comm.barrier();
        if (comm.rank() == 2)
            std::this_thread::sleep_for(50ms);
        std::vector<int> v(2000, comm.rank() + 1); // 8 KB: the two-phase path
        comm.all_reduce(std::span<const int>(v), std::span<int>(v), reduce_op::sum);
        sums[static_cast<std::size_t>(comm.rank())] = v[1999];
    });
    for (int r = 0; r < 3; ++r) {
        CAPTURE(r, out[static_cast<std::size_t>(r)].what);
        CHECK_FALSE(out[static_cast<std::size_t>(r)].threw);
        CHECK(sums[static_cast<std::size_t>(r)] == 6);
    }
}

TEST_CASE("a replica that never arrives times out naming it", "[comm][thread]") {
    thread_group group(4, {.timeout = 200ms});
    std::vector<outcome> out;
    try {
        run_recording(group, out, [&](thread_communicator& comm) {
            std::vector<double> v(10, 1.0);
            comm.all_reduce(std::span<const double>(v), std::span<double>(v), reduce_op::sum);
            if (comm.rank() == 3)
                std::this_thread::sleep_for(700ms);
            comm.all_reduce(std::span<const double>(v), std::span<double>(v), reduce_op::sum);
        });
        FAIL("run returned although replica 3 never arrived in time");
    } catch (const lockstep::error& e) {
        const std::string what = e.what();
        CHECK(e.code() == errc::timeout);
        CHECK(contains(what, "all_reduce #1"));
        CHECK(contains(what, "replica(s) 3 (missing)"));
        CHECK(contains(what, "200 ms"));
    }
}

TEST_CASE("every replica of a timed-out collective gets an error", "[comm][thread]") {
    thread_group group(3, {.timeout = 150ms});
    std::vector<outcome> out(3);
    CHECK_THROWS(group.run([&](thread_communicator& comm) {
        try {
            if (comm.rank() == 1)
                std::this_thread::sleep_for(500ms);
            comm.barrier();
        } catch (const lockstep::error& e) {
            out[static_cast<std::size_t>(comm.rank())] = {true, e.code(), e.what()};
            throw;
        }
    }));
    for (int r = 0; r < 3; ++r) {
        const auto& o = out[static_cast<std::size_t>(r)];
        CAPTURE(r, o.what);
        CHECK(o.threw);
        if (r == 1)
            CHECK(o.code == errc::peer_failure); // arrived after the group failed
        else
            CHECK((o.code == errc::timeout || o.code == errc::peer_failure));
    }
}

TEST_CASE("mismatched counts fail on every replica with both counts", "[comm][thread]") {
    thread_group group(3);
    std::vector<outcome> out(3);
    std::vector<float> after(3, 0.0f);
    group.run([&](thread_communicator& comm) {
        const int me = comm.rank();
        std::vector<float> v(me == 2 ? 12 : 10, 1.0f);
        try {
            comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
        } catch (const lockstep::error& e) {
            out[static_cast<std::size_t>(me)] = {true, e.code(), e.what()};
        }
        // A mismatch is detected before any data moves: the group stays usable.
        std::vector<float> w{static_cast<float>(me)};
        comm.all_reduce(std::span<const float>(w), std::span<float>(w), reduce_op::sum);
        after[static_cast<std::size_t>(me)] = w[0];
    });
    for (int r = 0; r < 3; ++r) {
        const auto& o = out[static_cast<std::size_t>(r)];
        CAPTURE(o.what);
        CHECK(o.threw);
        CHECK(o.code == errc::count_mismatch);
        CHECK(contains(o.what, "all_reduce #0"));
        CHECK(contains(o.what, "replica 0 passed 10 floats"));
        CHECK(contains(o.what, "replica 2 passed 12 floats"));
        CHECK(contains(o.what, "replica " + std::to_string(r) + ":"));
        CHECK(after[static_cast<std::size_t>(r)] == 3.0f);
    }
}

TEST_CASE("mismatched calls fail on every replica", "[comm][thread]") {
    struct mismatch {
        const char* name;
        errc code;
        const char* text;
    };
    const auto which = GENERATE(values<mismatch>({
        {"operation", errc::shape_mismatch, "replica 1 called broadcast"},
        {"type", errc::shape_mismatch, "replica 1 passed 4 doubles"},
        {"reduction", errc::shape_mismatch, "replica 1 passed reduce_op::max"},
        {"root", errc::shape_mismatch, "replica 1 passed root 0"},
        {"receive size", errc::count_mismatch, "replica 1 passed a receive span of 3 floats"},
    }));
    CAPTURE(which.name);
    // The odd replica's call is on another line for some kinds: call sites off, so the check
    // under test (not the call-site check, test_call_identity's) is the one that fires.
    thread_group group(3, {.check_call_sites = false});
    const std::string kind = which.name;
    std::vector<outcome> seen(3);
    group.run([&](thread_communicator& comm) {
        const bool odd = comm.rank() == 1;
        std::vector<float> f(4, 1.0f);
        std::vector<double> d(4, 1.0);
        try {
            if (kind == "operation" && odd)
                comm.broadcast(std::span<float>(f), 0);
            else if (kind == "type" && odd)
                comm.all_reduce(std::span<const double>(d), std::span<double>(d), reduce_op::sum);
            else if (kind == "reduction")
                comm.all_reduce(std::span<const float>(f), std::span<float>(f),
                                odd ? reduce_op::max : reduce_op::sum);
            else if (kind == "root")
                comm.broadcast(std::span<float>(f), odd ? 0 : 2);
            else if (kind == "receive size")
                comm.all_reduce(std::span<const float>(f), std::span<float>(f).first(odd ? 3 : 4),
                                reduce_op::sum);
            else
                comm.all_reduce(std::span<const float>(f), std::span<float>(f), reduce_op::sum);
        } catch (const lockstep::error& e) {
            seen[static_cast<std::size_t>(comm.rank())] = {true, e.code(), e.what()};
        }
    });
    for (const auto& o : seen) {
        CAPTURE(o.what);
        CHECK(o.threw);
        CHECK(o.code == which.code);
        CHECK(contains(o.what, which.text));
        CHECK(contains(o.what, "#0"));
    }
}

TEST_CASE("all_to_all refuses uneven blocks, unequal counts and overlapping spans on every "
          "replica",
          "[comm][thread]") {
    const auto which = GENERATE(values<misuse>({
        {"uneven blocks", errc::count_mismatch, "not a whole number of blocks for 3 replicas"},
        {"unequal counts", errc::count_mismatch, "replica 1 passed 6 floats"},
        {"in place", errc::invalid_argument, "replica 2 passed overlapping send and receive"},
        {"receive size", errc::count_mismatch, "replica 0 passed a receive span of 6 floats"},
    }));
    CAPTURE(which.name);
    const std::string kind = which.name;
    check_refused(which, "all_to_all #0", [&](thread_communicator& comm) {
        const int me = comm.rank();
        std::size_t count = 3;
        if (kind == "uneven blocks")
            count = 4;
        if (kind == "unequal counts" && me == 1)
            count = 6;
        std::vector<float> send(count, 1.0f);
        std::vector<float> recv(kind == "receive size" && me == 0 ? 6 : count, 0.0f);
        // In place: replica 2 receives into its own send span.
        const std::span<float> out =
            kind == "in place" && me == 2 ? std::span<float>(send) : std::span<float>(recv);
        comm.all_to_all(std::span<const float>(send), out);
    });
}

TEST_CASE("all_gather, all_reduce and reduce refuse partially overlapping spans on every "
          "replica",
          "[comm][thread]") {
    // Replica 1's send is its recv shifted by one element: not the in-place form (all_gather:
    // exactly its slot of recv; all_reduce and reduce on the root: exactly recv).
    const std::string kind = GENERATE("all_gather", "all_reduce", "reduce");
    const std::size_t count = GENERATE(std::size_t(3), std::size_t(2000)); // stash, two-phase
    CAPTURE(kind, count);
    const misuse which{"partial overlap", errc::invalid_argument,
                       "replica 1 passed send and receive spans that overlap partially"};
    check_refused(which, (kind + " #0").c_str(), [&](thread_communicator& comm) {
        const int me = comm.rank();
        const std::size_t recv_count = kind == "all_gather" ? 3 * count : count;
        std::vector<float> buffer(recv_count + 1, static_cast<float>(me));
        std::vector<float> own(count, static_cast<float>(me));
        const std::span<float> recv(buffer.data(), recv_count);
        const std::span<const float> send = me == 1
                                                ? std::span<const float>(buffer.data() + 1, count)
                                                : std::span<const float>(own);
        if (kind == "all_gather")
            comm.all_gather(send, recv);
        else if (kind == "all_reduce")
            comm.all_reduce(send, recv, reduce_op::sum);
        else
            comm.reduce(send, recv, reduce_op::sum, 1);
    });
}

TEST_CASE("the in-place forms of all_gather, all_reduce and reduce are accepted",
          "[comm][thread]") {
    const std::size_t count = GENERATE(std::size_t(3), std::size_t(2000));
    CAPTURE(count);
    thread_group group(3);
    std::vector<int> right(3, 0);
    group.run([&](thread_communicator& comm) {
        const int me = comm.rank();
        const auto mine = static_cast<std::size_t>(me);
        std::vector<float> gathered(3 * count, -1.0f);
        std::fill_n(gathered.begin() + static_cast<std::ptrdiff_t>(mine * count), count,
                    static_cast<float>(me + 1));
        comm.all_gather(std::span<const float>(gathered.data() + mine * count, count),
                        std::span<float>(gathered));
        std::vector<float> summed(count, static_cast<float>(me + 1));
        comm.all_reduce(std::span<const float>(summed), std::span<float>(summed), reduce_op::sum);
        std::vector<float> reduced(count, static_cast<float>(10 * (me + 1)));
        // Off the root, recv is not touched: overlapping spans are harmless there.
        comm.reduce(std::span<const float>(reduced), std::span<float>(reduced), reduce_op::sum, 2);
        bool ok = summed[count - 1] == 6.0f &&
                  reduced[count - 1] == static_cast<float>(me == 2 ? 60 : 10 * (me + 1));
        for (std::size_t r = 0; r < 3; ++r)
            ok = ok && gathered[r * count] == static_cast<float>(r + 1) &&
                 gathered[r * count + count - 1] == static_cast<float>(r + 1);
        right[mine] = ok ? 1 : 0;
    });
    CHECK(right == std::vector<int>{1, 1, 1});
}

TEST_CASE("all_combine refuses disagreeing arrays, counts and spans on every replica",
          "[comm][thread]") {
    const auto which = GENERATE(values<misuse>({
        {"arrays", errc::shape_mismatch, "replica 1 passed 2"},
        {"no arrays", errc::invalid_argument, "every replica passed 0 input arrays"},
        {"null array", errc::invalid_argument, "replica 2 passed a null input array 1 span"},
        {"unequal counts", errc::count_mismatch, "replica 1 passed 6 floats"},
        {"receive size", errc::count_mismatch, "replica 0 passed a receive span of 6 floats"},
    }));
    CAPTURE(which.name);
    const std::string kind = which.name;
    check_refused(which, "all_combine #0", [&](thread_communicator& comm) {
        const int me = comm.rank();
        const std::size_t count = kind == "unequal counts" && me == 1 ? 6 : 3;
        std::vector<float> a(count, 1.0f), b(count, 2.0f);
        std::vector<const float*> ptrs{a.data()};
        if (kind == "arrays" && me == 1)
            ptrs.push_back(b.data());
        if (kind == "no arrays")
            ptrs.clear();
        if (kind == "null array")
            ptrs.push_back(me == 2 ? nullptr : b.data());
        std::vector<float> recv(kind == "receive size" && me == 0 ? 6 : count, 0.0f);
        comm.all_combine(std::span<const float* const>(ptrs), count, std::span<float>(recv),
                         [](const float* const*, std::size_t, std::size_t, std::size_t m,
                            float* out) { std::fill(out, out + m, 0.0f); });
    });
}

TEST_CASE("reduce_scatter refuses disagreeing or misfitting counts and overlapping spans on "
          "every replica",
          "[comm][thread]") {
    const auto which = GENERATE(values<misuse>({
        {"different counts", errc::count_mismatch,
         "replica 0 passed counts {2, 3, 1}, replica 1 passed counts {2, 2, 2}"},
        {"wrong number of counts", errc::count_mismatch, "counts {3, 3} for a group of 3"},
        {"wrong sum", errc::count_mismatch, "sum to 5 but every replica sends 6 floats"},
        {"receive size", errc::count_mismatch, "replica 2 passed a receive span of 1 float for 2"},
        {"overlap", errc::invalid_argument, "replica 1 passed a receive span that overlaps"},
        {"reduction", errc::shape_mismatch, "replica 1 passed reduce_op::max"},
        {"null counts", errc::invalid_argument, "replica 2 passed a null counts span of 3"},
    }));
    CAPTURE(which.name);
    const std::string kind = which.name;
    check_refused(which, "reduce_scatter #0", [&](thread_communicator& comm) {
        const int me = comm.rank();
        std::vector<float> send(6, 1.0f);
        std::vector<std::size_t> counts{2, 2, 2};
        if (kind == "different counts" && me == 0)
            counts = {2, 3, 1};
        if (kind == "wrong number of counts")
            counts = {3, 3};
        if (kind == "wrong sum")
            counts = {2, 2, 1};
        const std::size_t mine = me < static_cast<int>(counts.size()) ? counts[me] : 0;
        std::vector<float> recv(kind == "receive size" && me == 2 ? 1 : mine, 0.0f);
        // Overlap: replica 1 receives into send's first slice, not its own (the second).
        const std::span<float> out =
            kind == "overlap" && me == 1 ? std::span<float>(send).first(2) : std::span<float>(recv);
        const reduce_op op = kind == "reduction" && me == 1 ? reduce_op::max : reduce_op::sum;
        const std::span<const std::size_t> cs =
            kind == "null counts" && me == 2
                ? std::span<const std::size_t>(static_cast<const std::size_t*>(nullptr), 3)
                : std::span<const std::size_t>(counts);
        comm.reduce_scatter(std::span<const float>(send), out, cs, op);
    });
}

TEST_CASE("reduce_scatter then all_gather is all_reduce, bit for bit, in place and above the "
          "stash",
          "[comm][thread]") {
    const int n = GENERATE(2, 3, 4);
    const std::size_t per = 40961; // 160 KiB of floats per rank: the peers' spans are read
    thread_group group(n);
    std::vector<int> same(static_cast<std::size_t>(n), 0);
    group.run([&](thread_communicator& comm) {
        const std::size_t total = per * static_cast<std::size_t>(n);
        std::vector<float> v(total), ref(total);
        for (std::size_t i = 0; i < total; ++i)
            v[i] = ref[i] =
                std::sin(static_cast<float>(i) * 0.37f + static_cast<float>(comm.rank()));
        comm.all_reduce(std::span<const float>(ref), std::span<float>(ref), reduce_op::sum);
        const std::size_t at = static_cast<std::size_t>(comm.rank()) * per;
        comm.reduce_scatter(std::span<const float>(v), std::span<float>(v).subspan(at, per),
                            reduce_op::sum);
        comm.all_gather(std::span<const float>(v).subspan(at, per), std::span<float>(v));
        same[static_cast<std::size_t>(comm.rank())] =
            std::memcmp(v.data(), ref.data(), total * sizeof(float)) == 0 ? 1 : 0;
    });
    CHECK(same == std::vector<int>(static_cast<std::size_t>(n), 1));
}

TEST_CASE("a replica that leaves the group releases its waiting peers", "[comm][thread]") {
    thread_group group(3, {.timeout = 5s});
    const auto start = std::chrono::steady_clock::now();
    try {
        group.run([&](thread_communicator& comm) {
            if (comm.rank() == 2)
                return; // leaves without the barrier the others wait in
            comm.barrier();
        });
        FAIL("run returned although replica 2 left before the barrier");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::peer_failure);
        CHECK(contains(e.what(), "replica 2 left the group"));
        CHECK(contains(e.what(), "barrier #0"));
    }
    // Released by the departure, not by the 5 s timeout.
    CHECK(std::chrono::steady_clock::now() - start < 4s);

    // The same for a sub-group handle destroyed while the other member waits in it.
    try {
        group.run([&](thread_communicator& comm) {
            auto sub = comm.split(comm.rank() == 0 ? 0 : 1, 0);
            if (comm.rank() == 2) {
                auto gone = std::move(sub); // destroyed at the end of this scope
                return;
            }
            sub.barrier(); // replica 1 waits for replica 2 here
        });
        FAIL("run returned although replica 2 destroyed its sub-group handle");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::peer_failure);
        CHECK(contains(e.what(), "replica 2 left the group"));
        CHECK(contains(e.what(), "split(color=1)"));
    }
}

// A wrapper's report of a failure the communicator raised on its replica (hierarchical_group's
// communicators name the replica's rank in the whole job this way) is what run() rethrows; one
// of another code leaves the root cause in place.
TEST_CASE("run rethrows a replica's own report of the failure raised on it, same code only",
          "[comm][thread]") {
    // Replica 1 leaves at once (replica 0's barrier raises peer_failure) or after replica 0's
    // barrier timed out (errc::timeout); replica 0 reports the error under wrapped_as.
    const auto run_wrapped = [](bool late, errc wrapped_as) -> lockstep::error {
        thread_group group(2, {.timeout = late ? 150ms : 5s});
        try {
            group.run([&](thread_communicator& comm) {
                if (comm.rank() == 1) {
                    if (late)
                        std::this_thread::sleep_for(600ms);
                    return;
                }
                try {
                    comm.barrier();
                } catch (const lockstep::error& e) {
                    throw lockstep::error(wrapped_as, 7, "wrapper.barrier",
                                          std::string("replica 7 of the job: ") + e.what());
                }
            });
        } catch (const lockstep::error& e) {
            return e;
        }
        FAIL("run returned although replica 1 left before the barrier");
        return lockstep::error(errc::invalid_argument, -1, "", "");
    };
    const lockstep::error left = run_wrapped(false, errc::peer_failure);
    CHECK(left.code() == errc::peer_failure);
    CHECK(left.operation() == "wrapper.barrier");
    CHECK(contains(left.what(), "replica 7 of the job: "));
    CHECK(contains(left.what(), "replica 1 left the group"));
    const lockstep::error late = run_wrapped(true, errc::timeout);
    CHECK(late.code() == errc::timeout);
    CHECK(late.operation() == "wrapper.barrier");
    CHECK(contains(late.what(), "timed out after 150 ms waiting for replica(s) 1"));
    const lockstep::error other = run_wrapped(true, errc::invalid_argument);
    CHECK(other.code() == errc::timeout);
    CHECK(other.operation() == "barrier #0");
}

TEST_CASE("recv errors: timeout and wrong size", "[comm][thread]") {
    thread_group group(2, {.timeout = 150ms});
    try {
        group.run([&](thread_communicator& comm) {
            std::vector<int> v(4);
            if (comm.rank() == 0)
                comm.recv(std::span<int>(v), 1, 5); // never sent
            else
                std::this_thread::sleep_for(400ms); // alive, but sends nothing
        });
        FAIL("run returned although replica 0 never got its message");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::timeout);
        CHECK(contains(e.what(), "recv from rank 1 (tag 5)"));
        CHECK(contains(e.what(), "timed out after 150 ms"));
    }
    // A sender that leaves without sending releases the receiver at once.
    try {
        group.run([&](thread_communicator& comm) {
            std::vector<int> v(4);
            if (comm.rank() == 0)
                comm.recv_any(std::span<int>(v), 5);
        });
        FAIL("run returned although replica 0 never got its message");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::peer_failure);
        CHECK(contains(e.what(), "recv_any (tag 5)"));
        CHECK(contains(e.what(), "left the group without sending"));
    }
    thread_group ok_group(2);
    std::vector<outcome> out(2);
    ok_group.run([&](thread_communicator& comm) {
        if (comm.rank() == 1) {
            const std::vector<int> v(6, 1);
            comm.send(std::span<const int>(v), 0, 5);
        } else {
            std::vector<int> v(4);
            try {
                comm.recv(std::span<int>(v), 1, 5);
            } catch (const lockstep::error& e) {
                out[0] = {true, e.code(), e.what()};
            }
        }
    });
    CHECK(out[0].threw);
    CHECK(out[0].code == errc::count_mismatch);
    CHECK(contains(out[0].what, "rank 1 sent 6 ints, expected 4 ints"));
}

TEST_CASE("a replica that moved its handle records its failure before the handle departs",
          "[comm][thread]") {
    // As hierarchical_group does: the handle lives in an object of the replica's own, destroyed
    // while the exception leaves. Recorded from the handler first, the failure is what run()
    // rethrows and what the peers name, not the departure.
    for (int attempt = 0; attempt < 20; ++attempt) {
        CAPTURE(attempt);
        thread_group group(3, {.timeout = std::chrono::seconds(10)});
        std::vector<outcome> out;
        try {
            run_recording(group, out, [&](thread_communicator& comm) {
                std::optional<thread_communicator> mine;
                try {
                    mine.emplace(std::move(comm));
                    if (mine->rank() == 2) {
                        std::this_thread::sleep_for(5ms);
                        throw std::runtime_error("the real cause");
                    }
                    std::vector<int> v(3, mine->rank());
                    mine->all_reduce(std::span<const int>(v), std::span<int>(v), reduce_op::sum);
                } catch (...) {
                    if (mine)
                        mine->record_failure(std::current_exception());
                    throw;
                }
            });
            FAIL("run returned although replica 2 threw");
        } catch (const lockstep::error& e) { // before its base, std::runtime_error
            FAIL("run rethrew another replica's error: " << e.what());
        } catch (const std::runtime_error& e) {
            CHECK(std::string(e.what()) == "the real cause");
        }
        for (int r = 0; r < 2; ++r) {
            CAPTURE(r, out[static_cast<std::size_t>(r)].what);
            CHECK(contains(out[static_cast<std::size_t>(r)].what,
                           "replica 2 failed: the real cause"));
        }
    }
}

// A failing replica's split handle departs while its exception unwinds, before thread_group
// records the exception: the peer waiting in the split records the departure (peer_failure)
// first. run() must still rethrow the root cause, which replaces the echo when it is recorded.
TEST_CASE("run rethrows the root cause recorded after the peer_failure it caused",
          "[comm][thread]") {
    thread_group group(2, {.timeout = 10s});
    struct slow_unwind { // destroyed after the split: its departure has time to be seen
        ~slow_unwind() { std::this_thread::sleep_for(300ms); }
    };
    try {
        group.run([&](thread_communicator& comm) {
            if (comm.rank() == 0) {
                const slow_unwind later;
                auto sub = comm.split(0, 0);
                throw std::invalid_argument("the real cause");
            }
            auto sub = comm.split(0, 1);
            sub.barrier(); // replica 0 never arrives: its handle departs
        });
        FAIL("run returned although replica 0 threw");
    } catch (const std::invalid_argument& e) {
        CHECK(std::string(e.what()) == "the real cause");
    } catch (const lockstep::error& e) {
        FAIL("run rethrew the echo instead of the cause: " << e.what());
    }
}

TEST_CASE("run rethrows exceptions of any type unchanged", "[comm][thread]") {
    thread_group group(2, {.timeout = 5s});
    std::string peer_saw;
    try {
        group.run([&](thread_communicator& comm) {
            if (comm.rank() == 1)
                throw 42; // not a std::exception
            try {
                comm.barrier();
            } catch (const lockstep::error& e) {
                peer_saw = e.what();
                throw;
            }
        });
        FAIL("run returned although replica 1 threw");
    } catch (int v) {
        CHECK(v == 42);
    }
    CHECK(contains(peer_saw, "replica 1 failed: an exception not derived from std::exception"));
}

TEST_CASE("abort from a watchdog thread releases blocked replicas with peer_failure",
          "[comm][thread]") {
    thread_group group(3, {.timeout = std::chrono::seconds(60)});
    std::vector<outcome> out(3);
    std::vector<double> released_after(3, -1.0);
    std::atomic<bool> second_abort_changed{true};
    const auto start = std::chrono::steady_clock::now();
    std::thread watchdog([&] {
        std::this_thread::sleep_for(200ms);
        group.abort("watchdog: step took too long");
        second_abort_changed = group.abort("a second reason");
    });
    try {
        group.run([&](thread_communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            try {
                if (comm.rank() == 2) { // in its own code: it cannot be interrupted
                    while (!comm.run_failed())
                        std::this_thread::sleep_for(10ms);
                }
                std::vector<float> v(100, 1.0f);
                comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
            } catch (const lockstep::error& e) {
                released_after[r] =
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                out[r] = {true, e.code(), e.what()};
                throw;
            }
        });
        FAIL("run returned although the group was aborted");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::peer_failure);
        CHECK(e.operation() == "thread_group.abort");
        CHECK(contains(e.what(), "watchdog: step took too long"));
    }
    watchdog.join();
    CHECK_FALSE(second_abort_changed.load());
    for (int r = 0; r < 3; ++r) {
        const auto& o = out[static_cast<std::size_t>(r)];
        CAPTURE(r, o.what);
        CHECK(o.threw);
        CHECK(o.code == errc::peer_failure);
        CHECK(contains(o.what, "the run was aborted: watchdog: step took too long"));
        // Aborted at 200 ms; the bound is 1 s after the abort.
        CHECK(released_after[static_cast<std::size_t>(r)] < 1.2);
    }
}

namespace {

/// A deterministic seam that holds a replica inside a data phase: writes to [lo, hi) (made
/// read-only) fault, and the handler sleeps until `release` (at most 0.5 s), then makes the
/// range writable and returns, so the write retries and the data phase goes on.
namespace held_write {
std::atomic<char*> lo{nullptr};
std::atomic<char*> hi{nullptr};
std::atomic<bool> hit{false};
std::atomic<bool> release{false};
struct sigaction previous {};

void on_fault(int, siginfo_t* info, void*) {
    char* const at = static_cast<char*>(info->si_addr);
    if (at < lo.load() || at >= hi.load()) { // not ours: the fault repeats under the old handler
        sigaction(SIGSEGV, &previous, nullptr);
        return;
    }
    hit.store(true);
    for (int i = 0; i < 500 && !release.load(); ++i) {
        const timespec ms{0, 1000000};
        nanosleep(&ms, nullptr);
    }
    mprotect(lo.load(), static_cast<std::size_t>(hi.load() - lo.load()), PROT_READ | PROT_WRITE);
}
} // namespace held_write

} // namespace

TEST_CASE("a replica that fails at the final phase of a large collective waits until no peer "
          "writes its buffers",
          "[comm][thread]") {
    // Replica 1 is held in all_reduce's data phase (writing its own chunk, which it then writes
    // into replica 0's recv); replica 0 waits at the final phase when a watchdog aborts the run.
    // Once replica 0's all_reduce has thrown, its recv is its own again: replica 1 must not
    // write it any more.
    const std::size_t n = std::size_t(1) << 20; // 4 MiB of floats: the two-phase path
    const std::size_t bytes = n * sizeof(float);
    void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(mapped != MAP_FAILED);
    std::span<float> recv1(static_cast<float*>(mapped), n);
    std::fill(recv1.begin(), recv1.end(), 0.0f);
    std::vector<float> send0(n, 1.0f), send1(n, 2.0f), recv0(n, 0.0f);
    // The last quarter lies in replica 1's chunk (the second half): only replica 1 writes it.
    held_write::lo = reinterpret_cast<char*>(recv1.data() + 3 * n / 4);
    held_write::hi = reinterpret_cast<char*>(recv1.data() + n);
    held_write::hit = false;
    held_write::release = false;
    REQUIRE(reinterpret_cast<std::uintptr_t>(held_write::lo.load()) %
                static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE)) ==
            0);
    struct sigaction act {};
    act.sa_sigaction = held_write::on_fault;
    act.sa_flags = SA_SIGINFO;
    sigemptyset(&act.sa_mask);
    REQUIRE(sigaction(SIGSEGV, &act, &held_write::previous) == 0);
    REQUIRE(mprotect(held_write::lo.load(), bytes / 4, PROT_READ) == 0);

    thread_group group(2, {.timeout = std::chrono::seconds(60)});
    std::vector<outcome> out(2);
    std::vector<int> written_after_throw(2, -1);
    std::atomic<bool> replica1_left{false};
    std::thread watchdog([&] {
        for (int i = 0; i < 10000 && !held_write::hit.load(); ++i)
            std::this_thread::sleep_for(1ms);
        std::this_thread::sleep_for(100ms); // replica 0 has done its chunk and waits
        group.abort("watchdog: a replica is stuck in its data phase");
    });
    try {
        run_recording(group, out, [&](thread_communicator& comm) {
            const int me = comm.rank();
            std::span<float> recv = me == 0 ? std::span<float>(recv0) : recv1;
            try {
                comm.all_reduce(std::span<const float>(me == 0 ? send0 : send1), recv,
                                reduce_op::sum);
            } catch (const lockstep::error&) {
                if (me == 1) {
                    replica1_left = true;
                } else {
                    std::fill(recv.begin(), recv.end(), -7.0f); // its buffer is its own again
                    held_write::release = true;
                    for (int i = 0; i < 10000 && !replica1_left.load(); ++i)
                        std::this_thread::sleep_for(1ms);
                    written_after_throw[0] = static_cast<int>(std::count_if(
                        recv.begin(), recv.end(), [](float v) { return v != -7.0f; }));
                }
                throw;
            }
        });
        FAIL("run returned although the group was aborted");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::peer_failure);
    }
    watchdog.join();
    sigaction(SIGSEGV, &held_write::previous, nullptr);
    munmap(mapped, bytes);
    CHECK(held_write::hit.load()); // the seam held replica 1 in its data phase
    CHECK(replica1_left.load());
    for (int r = 0; r < 2; ++r) {
        CAPTURE(r, out[static_cast<std::size_t>(r)].what);
        CHECK(out[static_cast<std::size_t>(r)].code == errc::peer_failure);
    }
    CHECK(written_after_throw[0] == 0);
}

TEST_CASE("abort with no run in progress fails the next run before any replica starts",
          "[comm][thread]") {
    thread_group group(2);
    CHECK_FALSE(group.abort("stop before starting"));
    CHECK_FALSE(group.abort("ignored: already pending"));
    std::atomic<int> started{0};
    try {
        group.run([&](thread_communicator&) { ++started; });
        FAIL("run started although abort was pending");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == errc::peer_failure);
        CHECK(contains(e.what(), "stop before starting"));
    }
    CHECK(started.load() == 0);
    // The abort is consumed: the next run works.
    group.run([&](thread_communicator& comm) {
        std::vector<int> v(4, comm.rank() + 1);
        comm.all_reduce(std::span<const int>(v), std::span<int>(v), reduce_op::sum);
        if (v[0] == 3)
            ++started;
    });
    CHECK(started.load() == 2);
}

TEST_CASE("a replica's null or oversized span is an error on every replica, and the group "
          "stays usable",
          "[comm][thread]") {
    const std::size_t huge = std::size_t(1) << 63;
    for (const char* which :
         {"all_reduce", "broadcast", "all_gather", "reduce", "all_to_all", "all_gather 2^63"}) {
        thread_group group(3);
        std::vector<outcome> out(3);
        std::vector<int> after(3, 0);
        const std::string w = which;
        group.run([&](thread_communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            std::vector<float> send(6, float(r + 1)), recv(18, 0.0f);
            // Replica 0 passes a null send span (or a 2^63-element one); the others are fine.
            std::span<const float> s(send);
            if (r == 0)
                s = w == "all_gather 2^63"
                        ? std::span<const float>(send.data(), huge)
                        : std::span<const float>(static_cast<const float*>(nullptr), 6);
            try {
                if (w == "all_reduce")
                    comm.all_reduce(s, std::span<float>(recv).first(6), reduce_op::sum);
                else if (w == "broadcast")
                    comm.broadcast(r == 0 ? std::span<float>(static_cast<float*>(nullptr), 6)
                                          : std::span<float>(send),
                                   1);
                else if (w == "all_gather" || w == "all_gather 2^63")
                    comm.all_gather(s, std::span<float>(recv));
                else if (w == "reduce")
                    comm.reduce(s, std::span<float>(recv).first(6), reduce_op::sum, 1);
                else
                    comm.all_to_all(s, std::span<float>(recv).first(6));
            } catch (const lockstep::error& e) {
                out[r] = {true, e.code(), e.what()};
            }
            std::vector<int> v(2, static_cast<int>(r) + 1);
            comm.all_reduce(std::span<const int>(v), std::span<int>(v), reduce_op::sum);
            after[r] = v[1];
        });
        for (int r = 0; r < 3; ++r) {
            const auto& o = out[static_cast<std::size_t>(r)];
            CAPTURE(which, r, o.what);
            CHECK(o.threw);
            CHECK(o.code == errc::invalid_argument);
            CHECK(contains(o.what, "replica 0 passed a"));
            CHECK(contains(o.what, w == "all_gather 2^63" ? "more than memory can hold" : "null"));
            CHECK(after[static_cast<std::size_t>(r)] == 6); // a good collective still works
        }
    }
}

TEST_CASE("LOCKSTEP_TIMEOUT sets the default timeout; garbage is refused", "[comm][thread]") {
    REQUIRE(::setenv("LOCKSTEP_TIMEOUT", "0.25", 1) == 0);
    CHECK(lockstep::thread_group_params{}.timeout == 250ms);
    CHECK(thread_group(2, {.timeout = 5s}).parameters().timeout == 5s); // explicit wins
    for (const char* bad : {"abc", "", "0", "-3", "inf", "nan", "2s", "1e300"}) {
        REQUIRE(::setenv("LOCKSTEP_TIMEOUT", bad, 1) == 0);
        CAPTURE(bad);
        try {
            lockstep::thread_group_params p;
            FAIL("accepted LOCKSTEP_TIMEOUT='" << bad << "' as " << p.timeout.count() << " ms");
        } catch (const lockstep::error& e) {
            CHECK(e.code() == errc::invalid_argument);
            CHECK(contains(e.what(), "LOCKSTEP_TIMEOUT"));
        }
    }
    REQUIRE(::unsetenv("LOCKSTEP_TIMEOUT") == 0);
    CHECK(lockstep::thread_group_params{}.timeout == 120s);
}

TEST_CASE("send and recv refuse a null span before copying anything", "[comm][thread]") {
    thread_group group(2);
    std::vector<outcome> out(2);
    float received = -1.0f;
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const int peer = 1 - comm.rank();
        std::span<float> null(static_cast<float*>(nullptr), 5);
        try {
            if (r == 0)
                comm.send(std::span<const float>(null), peer, 3);
            else
                comm.recv(null, peer, 3);
        } catch (const lockstep::error& e) {
            out[r] = {true, e.code(), e.what()};
        }
        // Still usable: a good message goes through.
        std::vector<float> v(5, float(r));
        if (r == 0)
            comm.send(std::span<const float>(v), peer, 4);
        else
            comm.recv(std::span<float>(v), peer, 4);
        if (r == 1)
            received = v[4];
    });
    CHECK(received == 0.0f);
    for (const auto& o : out) {
        CAPTURE(o.what);
        CHECK(o.threw);
        CHECK(o.code == errc::invalid_argument);
        CHECK(contains(o.what, "data is a null pointer with 5 elements"));
    }
}

TEST_CASE("a handle kept past run() is refused at once naming the replica", "[comm][thread]") {
    // Without the check a kept handle waits the whole timeout for peers that are gone (or, alone
    // in its group, succeeds); the timeout is far above what the refusals may take.
    const auto timeout = 3s;
    const auto stale = [](errc code, const std::string& what, int replica) {
        CAPTURE(what);
        CHECK(code == errc::invalid_argument);
        CHECK(contains(what, "replica " + std::to_string(replica) + ":"));
        CHECK(contains(what, "valid only inside thread_group::run's function"));
    };
    const auto caught = [](auto&& call) -> outcome {
        try {
            call();
        } catch (const lockstep::error& e) {
            return {true, e.code(), e.what()};
        }
        return {};
    };
    for (const int n : {1, 2}) {
        CAPTURE(n);
        thread_group group(n, {.timeout = timeout});
        std::vector<std::optional<thread_communicator>> kept(static_cast<std::size_t>(n));
        std::vector<std::optional<thread_communicator>> kept_split(static_cast<std::size_t>(n));
        group.run([&](thread_communicator& comm) {
            const auto me = static_cast<std::size_t>(comm.rank());
            kept_split[me].emplace(comm.split(0, comm.rank()));
            kept[me].emplace(std::move(comm));
        });
        const auto began = std::chrono::steady_clock::now();
        std::vector<float> v(4, 1.0f);
        for (int r = 0; r < n; ++r) {
            auto& c = *kept[static_cast<std::size_t>(r)];
            auto& s = *kept_split[static_cast<std::size_t>(r)];
            for (auto* h : {&c, &s}) {
                auto o = caught([&] {
                    h->all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
                });
                stale(o.code, o.what, r);
                o = caught([&] { h->barrier(); });
                stale(o.code, o.what, r);
                o = caught([&] { (void)h->split(0, 0); });
                stale(o.code, o.what, r);
                o = caught([&] { h->send(std::span<const float>(v), 0, 1); });
                stale(o.code, o.what, r);
                o = caught([&] { h->recv(std::span<float>(v), 0, 1); });
                stale(o.code, o.what, r);
                o = caught([&] { (void)h->recv_any(std::span<float>(v), 1); });
                stale(o.code, o.what, r);
            }
            const auto o = caught([&] { (void)c.shrink(); });
            stale(o.code, o.what, r);
        }
        CHECK(std::chrono::steady_clock::now() - began < timeout / 3);
        CHECK(v[0] == 1.0f); // nothing was reduced into it
        // The group itself runs again with fresh handles.
        std::vector<float> sums(static_cast<std::size_t>(n), 0.0f);
        group.run([&](thread_communicator& comm) {
            std::vector<float> w{1.0f};
            comm.all_reduce(std::span<const float>(w), std::span<float>(w), reduce_op::sum);
            sums[static_cast<std::size_t>(comm.rank())] = w[0];
        });
        for (const float s : sums)
            CHECK(s == static_cast<float>(n));
    }
}

TEST_CASE("a recv that does not fit consumes the message and says so as MPI's recv does",
          "[comm][thread]") {
    thread_group group(2);
    std::vector<outcome> refused(2);
    std::vector<float> got(2, 0.0f);
    group.run([&](thread_communicator& comm) {
        if (comm.rank() == 1) {
            const std::vector<float> four(4, 1.0f), two(2, 2.0f);
            const std::vector<int> ints(2, 3);
            comm.send(std::span<const float>(four), 0, 3);
            comm.send(std::span<const int>(ints), 0, 3);
            comm.send(std::span<const float>(two), 0, 3);
        } else {
            std::vector<float> three(3), two(2);
            try {
                comm.recv(std::span<float>(three), 1, 3);
            } catch (const lockstep::error& e) {
                refused[0] = {true, e.code(), e.what()};
            }
            try {
                comm.recv(std::span<float>(two), 1, 3); // the ints: another element type
            } catch (const lockstep::error& e) {
                refused[1] = {true, e.code(), e.what()};
            }
            // Both refused messages are gone: the next recv gets the third.
            comm.recv(std::span<float>(two), 1, 3);
            got = two;
        }
        comm.barrier();
    });
    CAPTURE(refused[0].what, refused[1].what);
    CHECK(refused[0].code == errc::count_mismatch);
    CHECK(contains(refused[0].what, "rank 1 sent 4 floats, expected 3 floats"));
    CHECK(contains(refused[0].what, "the message was discarded"));
    CHECK(refused[1].code == errc::shape_mismatch);
    CHECK(contains(refused[1].what, "rank 1 sent 2 ints, expected 2 floats"));
    CHECK(contains(refused[1].what, "the message was discarded"));
    CHECK(got == std::vector<float>{2.0f, 2.0f});
}

TEST_CASE("a reduce_op value outside its enumerators is refused on every replica",
          "[comm][thread]") {
    const auto bad = static_cast<reduce_op>(7);
    const std::string kind = GENERATE(as<std::string>{}, "all_reduce", "reduce", "reduce_scatter");
    const std::size_t count = GENERATE(std::size_t{3}, std::size_t{3000}); // stash and direct
    CAPTURE(kind, count);
    const misuse which{"reduce_op", errc::invalid_argument, "passed reduce_op value 7"};
    check_refused(which, (kind + " #0").c_str(), [&](thread_communicator& comm) {
        std::vector<float> v(count, 1.0f), out(count, 0.0f);
        if (kind == "all_reduce")
            comm.all_reduce(std::span<const float>(v), std::span<float>(out), bad);
        else if (kind == "reduce")
            comm.reduce(std::span<const float>(v), std::span<float>(out), bad, 0);
        else
            comm.reduce_scatter(std::span<const float>(v), std::span<float>(out).first(count / 3),
                                bad);
    });
}

TEST_CASE("count and type mismatches name the collective's tag", "[comm][thread]") {
    const std::string kind = GENERATE(as<std::string>{}, "count", "type", "site");
    CAPTURE(kind);
    thread_group group(2, {.check_call_sites = kind == "site"});
    std::vector<outcome> seen(2);
    group.run([&](thread_communicator& comm) {
        const int me = comm.rank();
        std::vector<double> d(me == 0 ? 9 : 11, 1.0), dall(2 * d.size());
        std::vector<float> f(9, 1.0f), fall(2 * f.size());
        try {
            if (kind == "type" && me == 1)
                comm.all_gather(std::span<const float>(f), std::span<float>(fall),
                                "batch_norm.forward_train");
            else if (kind == "type")
                comm.all_gather(std::span<const double>(d).first(9),
                                std::span<double>(dall).first(18), "batch_norm.forward_train");
            else if (kind == "count")
                comm.all_gather(std::span<const double>(d), std::span<double>(dall),
                                "batch_norm.forward_train");
            else
                comm.all_gather(std::span<const double>(d), std::span<double>(dall));
        } catch (const lockstep::error& e) {
            seen[static_cast<std::size_t>(me)] = {true, e.code(), e.what()};
        }
    });
    for (const auto& o : seen) {
        CAPTURE(o.what);
        CHECK(o.threw);
        if (kind == "count") {
            CHECK(o.code == errc::count_mismatch);
            CHECK(contains(o.what, "all_gather #0 ('batch_norm.forward_train'): replicas disagree "
                                   "on the element count: replica 0 passed 9 doubles"));
        } else if (kind == "type") {
            CHECK(o.code == errc::shape_mismatch);
            CHECK(contains(o.what, "all_gather #0 ('batch_norm.forward_train'): replicas disagree "
                                   "on the element type"));
        } else {
            CHECK(o.code == errc::count_mismatch);
            CHECK(contains(o.what, "all_gather #0 (at test_thread_group_failures.cpp:"));
            CHECK(contains(o.what, "): replicas disagree on the element count"));
        }
    }
}

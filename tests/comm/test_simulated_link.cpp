// Tests of simulated_link over thread_group: the wrapped communicator's results and checks, the
// modelled wire time, the slow replica, failures and timeouts. SPDX-License-Identifier: Apache-2.0
#include "collective_suite.hpp"
#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/comm/simulated_link.hpp"
#include "lockstep/comm/thread_group.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using lockstep::errc;
using lockstep::link_op;
using lockstep::reduce_op;
using lockstep::simulated_link;
using lockstep::thread_communicator;
using lockstep::thread_group;
using lockstep::testing::input_value;
using namespace std::chrono_literals;

using sim_link = simulated_link<thread_communicator>;
static_assert(lockstep::point_to_point_communicator<sim_link>,
              "simulated_link over a point-to-point communicator is one");
static_assert(std::is_same_v<sim_link::system_type, lockstep::host_system>);
static_assert(!lockstep::communicator_traits<sim_link>::collectives_use_compute_cores);

namespace {

using steady = std::chrono::steady_clock;

double ms_since(steady::time_point t0) {
    return std::chrono::duration<double, std::milli>(steady::now() - t0).count();
}
double ms(std::chrono::nanoseconds d) {
    return std::chrono::duration<double, std::milli>(d).count();
}

/// What one replica caught (code and message), recorded from the replica threads.
struct outcome {
    bool threw = false;
    errc code = errc::internal;
    std::string what;
};

/// Runs body(link) on each replica of group, records the lockstep::error it throws and rethrows
/// it; returns what every replica caught.
template <class Body>
std::vector<outcome> run_recording(thread_group& group, lockstep::simulated_link_params p,
                                   Body body, bool* run_threw = nullptr) {
    std::vector<outcome> out(static_cast<std::size_t>(group.size()));
    try {
        group.run([&](thread_communicator& comm) {
            auto& o = out[static_cast<std::size_t>(comm.rank())];
            try {
                sim_link l(comm, p);
                body(l);
            } catch (const lockstep::error& e) {
                o = {true, e.code(), e.what()};
                throw;
            }
        });
    } catch (const lockstep::error&) {
        if (run_threw)
            *run_threw = true;
    }
    return out;
}

// Fast enough that the suite's ~thousand collectives are not slowed down noticeably.
constexpr lockstep::simulated_link_params fast_link{.latency = 0us, .bandwidth = 1e12};

} // namespace

namespace {

/// The collective suite over the link on n replica threads: every replica runs it whole and
/// passes.
void check_suite(int n) {
    CAPTURE(n);
    thread_group group(n);
    std::vector<lockstep::testing::suite_report> reports(static_cast<std::size_t>(n));
    group.run([&](thread_communicator& comm) {
        sim_link l(comm, fast_link);
        // Rank-order sums: the link returns the thread group's bits.
        reports[static_cast<std::size_t>(comm.rank())] = lockstep::testing::run_collective_suite(l);
    });
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.failed == 0);
        CHECK(r.checks > 200);
    }
}

} // namespace

// One case per replica count, each with its own tag: tests/comm/CMakeLists.txt runs them as
// separate CTest tests (PARTS), so a parallel ctest overlaps these long runs (ThreadSanitizer).
TEST_CASE("simulated_link passes the collective suite on 2 replicas",
          "[comm][thread][simulated_link][suite2]") {
    check_suite(2);
}
TEST_CASE("simulated_link passes the collective suite on 3 replicas",
          "[comm][thread][simulated_link][suite3]") {
    check_suite(3);
}
TEST_CASE("simulated_link passes the collective suite on 4 replicas",
          "[comm][thread][simulated_link][suite4]") {
    check_suite(4);
}

TEST_CASE("simulated_link results are the wrapped communicator's bits",
          "[comm][thread][simulated_link]") {
    const int n = 3;
    const std::size_t count = 100003;
    thread_group group(n);
    std::vector<int> same(n, 0);
    group.run([&](thread_communicator& comm) {
        std::vector<float> a(count), b(count);
        for (std::size_t i = 0; i < count; ++i)
            a[i] = b[i] = input_value<float>(comm.rank(), i);
        comm.all_reduce(std::span<const float>(a), std::span<float>(a), reduce_op::sum);
        sim_link l(
            comm,
            {.latency = 100us, .bandwidth = 1e10, .jitter = 0.5, .slow_rank = 2, .slow_factor = 2});
        l.all_reduce(std::span<const float>(b), std::span<float>(b), reduce_op::sum);
        same[static_cast<std::size_t>(comm.rank())] =
            std::memcmp(a.data(), b.data(), count * sizeof(float)) == 0;
    });
    CHECK(same == std::vector<int>(n, 1));
}

TEST_CASE("the wire model", "[comm][simulated_link]") {
    const lockstep::simulated_link_params p{.latency = 10us, .bandwidth = 1e9};
    using lockstep::link_wire_time;
    CHECK(link_wire_time(p, link_op::all_reduce, 1'000'000, 1) == 0ns);
    // 2 (n-1)/n x 1 MB at 1 GB/s = 1 ms for n = 2, 1.5 ms for n = 4.
    CHECK(link_wire_time(p, link_op::all_reduce, 1'000'000, 2) == 10us + 1ms);
    CHECK(link_wire_time(p, link_op::all_reduce, 1'000'000, 4) == 10us + 1500us);
    CHECK(link_wire_time(p, link_op::all_gather, 4'000'000, 4) == 10us + 3ms);
    CHECK(link_wire_time(p, link_op::broadcast, 1'000'000, 4) == 10us + 1ms);
    CHECK(link_wire_time(p, link_op::reduce, 1'000'000, 4) == 10us + 1ms);
    CHECK(link_wire_time(p, link_op::point_to_point, 1'000'000, 2) == 10us + 1ms);
    CHECK(link_wire_time(p, link_op::barrier, 1'000'000, 3) == 10us);
}

TEST_CASE("a collective takes its wire time, and not much more", "[comm][thread][simulated_link]") {
    const int n = GENERATE(2, 4);
    CAPTURE(n);
    // 1 MB at 100 MB/s: wire times of 10-30 ms, far above the copies the thread group makes.
    const lockstep::simulated_link_params p{.latency = 2ms, .bandwidth = 1e8};
    const std::size_t count = 250'000; // 1 MB
    thread_group group(n);
    struct timing {
        double reduce_ms = 0, gather_ms = 0, bcast_ms = 0, barrier_ms = 0, send_ms = 0;
        double modelled_ms = 0, idled_ms = 0;
    };
    std::vector<timing> t(static_cast<std::size_t>(n));
    group.run([&](thread_communicator& comm) {
        sim_link l(comm, p);
        auto& mine = t[static_cast<std::size_t>(comm.rank())];
        std::vector<float> v(count, 1.0f), all(count * static_cast<std::size_t>(n));
        comm.barrier();
        auto t0 = steady::now();
        l.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
        mine.reduce_ms = ms_since(t0);
        comm.barrier();
        t0 = steady::now();
        l.all_gather(std::span<const float>(v), std::span<float>(all));
        mine.gather_ms = ms_since(t0);
        comm.barrier();
        t0 = steady::now();
        l.broadcast(std::span<float>(v), 1);
        mine.bcast_ms = ms_since(t0);
        comm.barrier();
        t0 = steady::now();
        l.barrier();
        mine.barrier_ms = ms_since(t0);
        t0 = steady::now();
        l.send(std::span<const float>(v), (comm.rank() + 1) % n, 5);
        mine.send_ms = ms_since(t0);
        l.recv(std::span<float>(v), (comm.rank() + n - 1) % n, 5);
        mine.modelled_ms = ms(l.modelled());
        mine.idled_ms = ms(l.idled());
    });
    const double bytes = count * 4.0, f = (n - 1.0) / n, lat = 2.0;
    const double want_reduce = lat + 2 * f * bytes / 1e5, want_gather = lat + f * n * bytes / 1e5,
                 want_bcast = lat + bytes / 1e5, want_send = lat + bytes / 1e5;
    // Generous upper bounds: a loaded machine may wake a sleeping thread late.
    const double slack = 100;
    for (const timing& x : t) {
        CHECK(x.reduce_ms >= want_reduce);
        CHECK(x.reduce_ms <= want_reduce + slack);
        CHECK(x.gather_ms >= want_gather);
        CHECK(x.gather_ms <= want_gather + slack);
        CHECK(x.bcast_ms >= want_bcast);
        CHECK(x.bcast_ms <= want_bcast + slack);
        CHECK(x.barrier_ms >= lat);
        CHECK(x.barrier_ms <= lat + slack);
        CHECK(x.send_ms >= want_send);
        CHECK(x.send_ms <= want_send + slack);
        CHECK(x.modelled_ms ==
              Approx(want_reduce + want_gather + want_bcast + lat + want_send).epsilon(1e-6));
        CHECK(x.idled_ms <= x.modelled_ms + 5 * slack);
    }
}

TEST_CASE("jitter is deterministic, per replica, and never below the model",
          "[comm][thread][simulated_link]") {
    const lockstep::simulated_link_params p{
        .latency = 0us, .bandwidth = 1e9, .jitter = 0.5, .seed = 42};
    const auto base = lockstep::link_wire_time(p, link_op::all_reduce, 1'000'000, 2);
    std::vector<std::vector<std::int64_t>> runs[2];
    for (auto& run : runs) {
        run.assign(2, {});
        thread_group(2).run([&](thread_communicator& comm) {
            sim_link l(comm, p);
            for (std::uint64_t c = 0; c < 16; ++c)
                run[static_cast<std::size_t>(comm.rank())].push_back(
                    l.wire_time(link_op::all_reduce, 1'000'000, c).count());
        });
    }
    CHECK(runs[0] == runs[1]);
    CHECK(runs[0][0] != runs[0][1]);
    for (const auto& rank : runs[0])
        for (const std::int64_t w : rank) {
            CHECK(w >= base.count());
            CHECK(w < base.count() * 3 / 2 + 1);
        }
}

TEST_CASE("the slow replica delays its peers", "[comm][thread][simulated_link]") {
    const int n = 3, calls = 3;
    // 10 ms per all_reduce, 40 ms on rank 1.
    const lockstep::simulated_link_params p{
        .latency = 10ms, .bandwidth = 1e12, .slow_rank = 1, .slow_factor = 4};
    thread_group group(n);
    std::vector<double> first(n), total(n);
    std::vector<int> slow(n);
    group.run([&](thread_communicator& comm) {
        sim_link l(comm, p);
        slow[static_cast<std::size_t>(comm.rank())] = l.slow() ? 1 : 0;
        std::vector<double> v(10, 1.0);
        comm.barrier();
        const auto t0 = steady::now();
        for (int k = 0; k < calls; ++k) {
            l.all_reduce(std::span<const double>(v), std::span<double>(v), reduce_op::sum);
            if (k == 0)
                first[static_cast<std::size_t>(comm.rank())] = ms_since(t0);
        }
        l.barrier(); // latency only, after the slow replica's last idle
        total[static_cast<std::size_t>(comm.rank())] = ms_since(t0);
    });
    // Catch2 assertions only here, on the main thread (Catch2 is not thread-safe).
    CHECK(slow == std::vector<int>{0, 1, 0});
    CHECK(first[1] >= 40);
    for (int r : {0, 2}) {
        CHECK(first[static_cast<std::size_t>(r)] >= 10);
        CHECK(first[static_cast<std::size_t>(r)] < 40 + 100);
        // Each call starts when the slow replica arrives: calls x 40 ms, then the barrier.
        CHECK(total[static_cast<std::size_t>(r)] >= calls * 40 + 10);
        CHECK(total[static_cast<std::size_t>(r)] <= calls * 40 + 10 + 300);
    }
}

TEST_CASE("a split is a link owning the wrapped split", "[comm][thread][simulated_link]") {
    thread_group group(4);
    std::vector<double> took(4);
    std::vector<int> sums(4), slow(4);
    group.run([&](thread_communicator& comm) {
        sim_link l(comm, {.latency = 20ms, .bandwidth = 1e12, .slow_rank = 3, .slow_factor = 2});
        sim_link sub = l.split(comm.rank() % 2, -comm.rank()); // {2, 0} and {3, 1}
        int x = comm.rank();
        const auto t0 = steady::now();
        sub.all_reduce(std::span<const int>(&x, 1), std::span<int>(&x, 1), reduce_op::sum);
        took[static_cast<std::size_t>(comm.rank())] = ms_since(t0);
        sums[static_cast<std::size_t>(comm.rank())] = x;
        slow[static_cast<std::size_t>(comm.rank())] = sub.slow();
    });
    CHECK(sums == std::vector<int>{2, 4, 2, 4});
    CHECK(slow == std::vector<int>{0, 0, 0, 1});
    for (int r = 0; r < 4; ++r)
        CHECK(took[static_cast<std::size_t>(r)] >= (r == 3 ? 40 : 20));
}

TEST_CASE("simulated_link keeps the wrapped checks: mismatches", "[comm][thread][simulated_link]") {
    thread_group group(2);
    bool run_threw = false;
    const auto out = run_recording(
        group, {.latency = 1ms, .bandwidth = 1e9},
        [](sim_link& l) {
            std::vector<float> v(static_cast<std::size_t>(10 + l.rank()), 1.0f);
            l.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
        },
        &run_threw);
    CHECK(run_threw);
    for (const outcome& o : out) {
        CHECK(o.threw);
        CHECK(o.code == errc::count_mismatch);
    }
}

TEST_CASE("simulated_link keeps the wrapped checks: swapped calls of one shape",
          "[comm][thread][simulated_link]") {
    // Replica 0 reduces the gradient, then the loss; replica 1 the other way round. Same
    // collective and shape: only the call sites (check_call_sites) or the names tell them apart,
    // so the link must forward its caller's collective_tag, not issue every call from one line.
    for (const bool named : {false, true}) {
        CAPTURE(named);
        thread_group group(2, {.timeout = 10s, .check_call_sites = !named});
        bool run_threw = false;
        const auto out = run_recording(
            group, {.latency = 1ms, .bandwidth = 1e9},
            [named](sim_link& l) {
                std::vector<float> grad(4, 1.0f), loss(4, 2.0f);
                const auto grads = [&] {
                    if (named)
                        l.all_reduce(std::span<const float>(grad), std::span<float>(grad),
                                     reduce_op::sum, "grad");
                    else
                        l.all_reduce(std::span<const float>(grad), std::span<float>(grad),
                                     reduce_op::sum);
                };
                const auto losses = [&] {
                    if (named)
                        l.all_reduce(std::span<const float>(loss), std::span<float>(loss),
                                     reduce_op::sum, "loss");
                    else
                        l.all_reduce(std::span<const float>(loss), std::span<float>(loss),
                                     reduce_op::sum);
                };
                if (l.rank() == 0) {
                    grads();
                    losses();
                } else {
                    losses();
                    grads();
                }
            },
            &run_threw);
        CHECK(run_threw);
        for (const outcome& o : out) {
            CAPTURE(o.what);
            CHECK(o.threw);
            CHECK(o.code == errc::shape_mismatch);
            CHECK(o.what.find("called different collectives, tags or call sites") !=
                  std::string::npos);
            // The caller's call sites or names, not the link's own line.
            CHECK(o.what.find(named ? "loss" : "test_simulated_link.cpp:") != std::string::npos);
        }
    }
}

TEST_CASE("a failing replica becomes an error on every replica of the link",
          "[comm][thread][simulated_link]") {
    thread_group group(3);
    bool run_threw = false;
    const auto out = run_recording(
        group, {.latency = 1ms, .bandwidth = 1e9, .slow_rank = 0, .slow_factor = 3},
        [](sim_link& l) {
            std::vector<float> v(1000, 1.0f);
            l.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
            if (l.rank() == 2)
                lockstep::fail(errc::invalid_argument, 2, "test", "replica 2 gives up");
            l.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
        },
        &run_threw);
    CHECK(run_threw);
    CHECK(out[2].code == errc::invalid_argument);
    for (int r : {0, 1}) {
        CHECK(out[static_cast<std::size_t>(r)].threw);
        CHECK(out[static_cast<std::size_t>(r)].code == errc::peer_failure);
    }
}

TEST_CASE("a straggler beyond the group's timeout ends in errc::timeout",
          "[comm][thread][simulated_link]") {
    // Rank 1 idles 600 ms after the first all_reduce; its peers wait for it in the second one
    // longer than the group's 200 ms timeout.
    thread_group group(2, {.timeout = 200ms});
    const auto t0 = steady::now();
    try {
        group.run([&](thread_communicator& comm) {
            sim_link l(comm,
                       {.latency = 20ms, .bandwidth = 1e12, .slow_rank = 1, .slow_factor = 30});
            std::vector<float> v(100, 1.0f);
            for (int k = 0; k < 2; ++k)
                l.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
        });
        FAIL("the run did not fail");
    } catch (const lockstep::error& e) {
        INFO(e.what());
        CHECK(e.code() == errc::timeout);
    }
    CHECK(ms_since(t0) < 5000);
}

TEST_CASE("simulated_link rejects invalid parameters", "[comm][thread][simulated_link]") {
    thread_group group(2);
    std::vector<int> rejected(2, 0);
    group.run([&](thread_communicator& comm) {
        int k = 0;
        for (const lockstep::simulated_link_params p :
             {lockstep::simulated_link_params{.bandwidth = 0},
              lockstep::simulated_link_params{.jitter = -0.1},
              lockstep::simulated_link_params{.slow_rank = 2, .slow_factor = 2},
              lockstep::simulated_link_params{.slow_rank = 0, .slow_factor = 0.5}}) {
            try {
                sim_link l(comm, p);
            } catch (const lockstep::error& e) {
                k += e.code() == errc::invalid_argument;
            }
        }
        rejected[static_cast<std::size_t>(comm.rank())] = k;
    });
    CHECK(rejected == std::vector<int>{4, 4});
}

TEST_CASE("a communication stream over the link runs its collectives on the split link",
          "[comm][thread][simulated_link]") {
    // comm_stream splits the link (an owning link over the thread group's split); its thread
    // reduces while the replica's own thread keeps using the parent link.
    const int n = 3;
    const std::size_t count = 5000;
    thread_group group(n);
    std::vector<int> ok(n, 0);
    std::vector<double> item_ms(n, 0);
    group.run([&](thread_communicator& comm) {
        sim_link l(comm, {.latency = 30ms, .bandwidth = 1e12});
        lockstep::comm_stream<sim_link> stream(l);
        std::vector<std::vector<float>> pieces(4, std::vector<float>(count));
        for (std::size_t k = 0; k < pieces.size(); ++k)
            for (std::size_t i = 0; i < count; ++i)
                pieces[k][i] = input_value<float>(comm.rank(), i + k * count);
        const auto t0 = steady::now();
        for (auto& piece : pieces)
            stream.submit([&piece](sim_link& c) {
                c.all_reduce(std::span<const float>(piece), std::span<float>(piece),
                             reduce_op::sum);
            });
        int x = 1; // the compute side's own collective, on the parent link, meanwhile
        l.all_reduce(std::span<const int>(&x, 1), std::span<int>(&x, 1), reduce_op::sum);
        stream.join();
        item_ms[static_cast<std::size_t>(comm.rank())] = ms_since(t0);
        bool good = x == n;
        for (std::size_t k = 0; k < pieces.size(); ++k)
            for (std::size_t i = 0; i < count; ++i)
                good = good && pieces[k][i] == lockstep::testing::reference_reduce<float>(
                                                   n, i + k * count, reduce_op::sum);
        ok[static_cast<std::size_t>(comm.rank())] = good;
    });
    CHECK(ok == std::vector<int>(n, 1));
    for (const double t : item_ms)
        CHECK(t >= 4 * 30); // four collectives in order on the stream, 30 ms each at least
}

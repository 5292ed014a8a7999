// Tests of thread_group / thread_communicator: the collective suite on 1..4 replica threads,
// plus what only shared memory can show. SPDX-License-Identifier: Apache-2.0
#include "collective_suite.hpp"
#include "lockstep/comm/detail/adaptive_spin.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"
#include "lockstep/comm/thread_group.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <span>
#include <vector>

using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;
using lockstep::testing::input_value;

namespace {

/// The collective suite on n replica threads: every replica runs it whole and passes.
void check_suite(int n) {
    CAPTURE(n);
    thread_group group(n);
    std::vector<lockstep::testing::suite_report> reports(static_cast<std::size_t>(n));
    group.run([&](thread_communicator& comm) {
        reports[static_cast<std::size_t>(comm.rank())] =
            lockstep::testing::run_collective_suite(comm);
    });
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.rank >= 0);
        CHECK(r.failed == 0);
        // Every replica ran the whole suite (a report with few checks means it stopped early).
        CHECK(r.checks > 200);
    }
}

} // namespace

// One case per replica count, each with its own tag: tests/comm/CMakeLists.txt runs them as
// separate CTest tests (PARTS), so a parallel ctest overlaps these long runs (ThreadSanitizer).
TEST_CASE("thread_group passes the collective suite on 1 replica", "[comm][thread][suite1]") {
    check_suite(1);
}
TEST_CASE("thread_group passes the collective suite on 2 replicas", "[comm][thread][suite2]") {
    check_suite(2);
}
TEST_CASE("thread_group passes the collective suite on 3 replicas", "[comm][thread][suite3]") {
    check_suite(3);
}
TEST_CASE("thread_group passes the collective suite on 4 replicas", "[comm][thread][suite4]") {
    check_suite(4);
}

TEST_CASE("thread_communicator basics", "[comm][thread]") {
    CHECK_THROWS_AS(thread_group(0), lockstep::error);
    thread_group group(3);
    CHECK(group.size() == 3);
    std::vector<int> ranks(3, -1), sizes(3), threads(3);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        ranks[r] = comm.replica();
        sizes[r] = comm.size();
        threads[r] = comm.system().threads();
    });
    for (int r = 0; r < 3; ++r) {
        CHECK(ranks[static_cast<std::size_t>(r)] == r);
        CHECK(sizes[static_cast<std::size_t>(r)] == 3);
        CHECK(threads[static_cast<std::size_t>(r)] == lockstep::host_system::default_threads(3));
    }
}

TEST_CASE("barrier waits for every replica", "[comm][thread]") {
    const int n = GENERATE(2, 3, 4);
    thread_group group(n);
    std::atomic<int> arrived{0};
    std::vector<int> seen(static_cast<std::size_t>(n) * 50, -1);
    group.run([&](thread_communicator& comm) {
        for (int round = 0; round < 50; ++round) {
            arrived.fetch_add(1);
            comm.barrier();
            // Nobody can have started the next round before everybody left this barrier's
            // entry, so the count is exactly (round + 1) * n here.
            seen[static_cast<std::size_t>(round) * static_cast<std::size_t>(n) +
                 static_cast<std::size_t>(comm.rank())] = arrived.load();
            comm.barrier();
        }
    });
    for (int round = 0; round < 50; ++round)
        for (int r = 0; r < n; ++r)
            CHECK(seen[static_cast<std::size_t>(round * n + r)] == (round + 1) * n);
}

TEST_CASE("in-place reduce at the root and in-place all_gather", "[comm][thread]") {
    const int n = 3;
    const std::size_t count = 4099;
    thread_group group(n);
    std::vector<int> ok(n, 0);
    group.run([&](thread_communicator& comm) {
        const int me = comm.rank();
        bool good = true;
        for (int root = 0; root < n; ++root) {
            std::vector<double> v(count);
            for (std::size_t i = 0; i < count; ++i)
                v[i] = input_value<double>(me, i);
            comm.reduce(std::span<const double>(v), std::span<double>(v), reduce_op::sum, root);
            for (std::size_t i = 0; i < count; ++i) {
                const double want =
                    me == root ? lockstep::testing::reference_reduce<double>(n, i, reduce_op::sum)
                               : input_value<double>(me, i); // non-root data untouched
                good = good && v[i] == want;
            }
        }
        std::vector<int> all(count * n, -1);
        for (std::size_t i = 0; i < count; ++i)
            all[me * count + i] = me * 7 + static_cast<int>(i);
        comm.all_gather(std::span<const int>(all.data() + me * count, count), std::span<int>(all));
        for (int r = 0; r < n; ++r)
            for (std::size_t i = 0; i < count; ++i)
                good = good && all[r * count + i] == r * 7 + static_cast<int>(i);
        ok[static_cast<std::size_t>(me)] = good ? 1 : 0;
    });
    CHECK(ok == std::vector<int>(n, 1));
}

TEST_CASE("all_reduce bits do not change between runs", "[comm][thread]") {
    const std::size_t count = (std::size_t{1} << 18) + 5;
    std::vector<float> first, second;
    for (auto* out : {&first, &second}) {
        thread_group group(4);
        group.run([&](thread_communicator& comm) {
            std::vector<float> v(count);
            for (std::size_t i = 0; i < count; ++i)
                v[i] = input_value<float>(comm.rank(), i);
            comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
            if (comm.rank() == 2)
                *out = v;
        });
    }
    REQUIRE(first.size() == count);
    CHECK(first == second);
    // The result differs from a plain pairwise order somewhere, so the check above is about
    // a fixed order and not about luckily exact sums.
    std::size_t order_sensitive = 0;
    for (std::size_t i = 0; i < first.size(); ++i) {
        const float pairwise = (input_value<float>(0, i) + input_value<float>(1, i)) +
                               (input_value<float>(2, i) + input_value<float>(3, i));
        order_sensitive += pairwise != first[i];
    }
    CHECK(order_sensitive > 0);
}

TEST_CASE("messages are matched by source and tag", "[comm][thread]") {
    thread_group group(3);
    std::vector<int> ok(3, 0);
    group.run([&](thread_communicator& comm) {
        const int me = comm.rank();
        bool good = true;
        if (me == 0) {
            for (int k = 0; k < 4; ++k) {
                const std::vector<int> v{k, 100 + k};
                comm.send(std::span<const int>(v), 1, k % 2); // tags 0, 1, 0, 1
            }
            const std::vector<double> d{2.5};
            comm.send(std::span<const double>(d), 1, 7);
        } else if (me == 1) {
            std::vector<double> d(1);
            comm.recv(std::span<double>(d), 0, 7); // the last message first: other tags wait
            good = good && d[0] == 2.5;
            std::vector<int> v(2);
            for (const int k : {1, 3, 0, 2}) { // tag 1 in order, then tag 0 in order
                comm.recv(std::span<int>(v), 0, k % 2);
                good = good && v[0] == k && v[1] == 100 + k;
            }
        }
        comm.barrier();
        // Nested split: the sub-group of the sub-group talks only among itself.
        auto sub = comm.split(0, me);
        auto subsub = sub.split(me == 2 ? 1 : 0, 0);
        std::vector<int> x{me};
        subsub.all_reduce(std::span<const int>(x), std::span<int>(x), reduce_op::sum);
        good = good && x[0] == (me == 2 ? 2 : 1);
        ok[static_cast<std::size_t>(me)] = good ? 1 : 0;
    });
    CHECK(ok == std::vector<int>(3, 1));
}

TEST_CASE("many small collectives with more replicas than cores", "[comm][thread]") {
    const int n = 4;
    thread_group group(n);
    std::vector<long> sums(n, 0);
    group.run([&](thread_communicator& comm) {
        long total = 0;
        for (int k = 0; k < 2000; ++k) {
            std::int64_t v[2] = {comm.rank() + k, -comm.rank()};
            comm.all_reduce(std::span<const std::int64_t>(v), std::span<std::int64_t>(v),
                            k % 2 ? reduce_op::max : reduce_op::sum);
            total += static_cast<long>(v[0] + v[1]);
            if (k % 100 == 0)
                comm.barrier();
        }
        sums[static_cast<std::size_t>(comm.rank())] = total;
    });
    long want = 0;
    for (int k = 0; k < 2000; ++k)
        want += k % 2 ? (n - 1 + k) + 0 : (n * k + n * (n - 1) / 2) - n * (n - 1) / 2;
    CHECK(sums == std::vector<long>(n, want));
}

TEST_CASE("reductions over more replicas than the fused loops cover", "[comm][thread]") {
    // 1..4 sources run fused element loops; more fold through a local block (6 replicas). The
    // all_to_all checks run here with 6 replicas too.
    const int n = 6;
    thread_group group(n);
    std::vector<lockstep::testing::suite_report> reports(n);
    group.run([&](thread_communicator& comm) {
        auto& rep = reports[static_cast<std::size_t>(comm.rank())];
        rep.rank = comm.rank();
        rep.size = comm.size();
        const lockstep::testing::suite_options opt;
        lockstep::testing::check_all_reduce<float>(comm, rep, {1, 1009, 100003}, opt);
        lockstep::testing::check_all_reduce<std::int64_t>(comm, rep, {100003}, opt);
        lockstep::testing::check_reduce<double>(comm, rep, {1009, 20011}, opt);
        lockstep::testing::check_all_to_all<float>(comm, rep, {0, 1, 1009});
        lockstep::testing::check_all_to_all<std::int64_t>(comm, rep, {1, 1009});
    });
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.failed == 0);
        CHECK(r.checks > 20);
    }
}

namespace {

/// Element i of input array c of replica r in the all_combine tests: distinct per replica,
/// array and element.
float combine_input(int r, std::size_t c, std::size_t i) {
    return static_cast<float>((static_cast<int>(i % 1013) - 500) * (r + 1)) * 0.25f +
           static_cast<float>(c) * 3.0f;
}

/// The combine of the tests: out[m] = the sum over arrays j of (j + 1) * sources[j][first + m],
/// in double, so the arrays' order shows in the result.
struct weighted_sum {
    void operator()(const float* const* sources, std::size_t n, std::size_t first, std::size_t m,
                    float* out) const {
        for (std::size_t k = 0; k < m; ++k) {
            double s = 0;
            for (std::size_t j = 0; j < n; ++j)
                s += static_cast<double>(j + 1) * sources[j][first + k];
            out[k] = static_cast<float>(s);
        }
    }
};

} // namespace

TEST_CASE("all_combine stores the combine of every replica's arrays, in replica order, to every "
          "replica",
          "[comm][thread]") {
    const int n = GENERATE(1, 2, 3, 5);
    const std::size_t arrays = GENERATE(std::size_t{1}, std::size_t{3});
    const bool in_place = GENERATE(false, true);
    CAPTURE(n, arrays, in_place);
    for (const std::size_t count : {std::size_t{0}, std::size_t{7}, std::size_t{70001}}) {
        CAPTURE(count);
        thread_group group(n);
        std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
        group.run([&](thread_communicator& comm) {
            const int r = comm.rank();
            std::vector<std::vector<float>> in(arrays, std::vector<float>(count));
            for (std::size_t c = 0; c < arrays; ++c)
                for (std::size_t i = 0; i < count; ++i)
                    in[c][i] = combine_input(r, c, i);
            std::vector<float> recv(count, -1.0f);
            std::vector<const float*> ptrs;
            for (std::size_t c = 0; c < arrays; ++c)
                ptrs.push_back(in[c].data());
            std::span<float> target(recv);
            if (in_place) { // the last array is the receive span
                target = std::span<float>(in[arrays - 1]);
                ptrs[arrays - 1] = target.data();
            }
            comm.all_combine(std::span<const float* const>(ptrs), count, target, weighted_sum{});
            out[static_cast<std::size_t>(r)].assign(target.begin(), target.end());
        });
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i) {
            double want = 0;
            for (int r = 0; r < n; ++r)
                for (std::size_t c = 0; c < arrays; ++c)
                    want += static_cast<double>(static_cast<std::size_t>(r) * arrays + c + 1) *
                            combine_input(r, c, i);
            for (int r = 0; r < n; ++r)
                wrong += out[static_cast<std::size_t>(r)][i] != static_cast<float>(want) ? 1 : 0;
        }
        CHECK(wrong == 0);
    }
}

TEST_CASE("wait_estimate spins about twice the waits it has seen, within its bounds",
          "[comm][thread]") {
    using namespace std::chrono_literals;
    using ns = std::chrono::nanoseconds;
    lockstep::detail::wait_estimate w;
    CHECK(w.typical() == 0ns);
    CHECK(w.spin(4us, 200us) == 4us); // nothing seen: the floor
    // Steady waits of 40 us: the moving average (weight 1/8) approaches 40 us from below.
    for (int i = 0; i < 100; ++i)
        w.record(40us, 200us);
    CHECK(w.typical() > 39us);
    CHECK(w.typical() <= 40us);
    CHECK(w.spin(4us, 200us) > 78us);
    CHECK(w.spin(4us, 200us) <= 80us);
    CHECK(w.spin(4us, 50us) == 50us);     // the cap
    CHECK(w.spin(100us, 200us) == 100us); // the floor
    CHECK(w.spin(100us, 50us) == 100us);  // a cap below the floor: the floor
    // One wait of 30 us moves it an eighth of the way.
    const ns before = w.typical();
    w.record(30us, 200us);
    CHECK(w.typical() == before + (30us - before) / 8);
    // Waits longer than `longest` halve it: a replica kept waiting long falls back to the floor.
    const ns t = w.typical();
    w.record(5ms, 200us);
    CHECK(w.typical() == t / 2);
    for (int i = 0; i < 40; ++i)
        w.record(5ms, 200us);
    CHECK(w.spin(4us, 200us) == 4us);
}

TEST_CASE("integer sums wrap modulo 2^bits as MPI's do", "[comm][thread]") {
    // Signed overflow would be undefined behaviour: in a constant expression it does not compile.
    STATIC_REQUIRE(lockstep::detail::shm::sum_fn{}(INT32_MAX - 1, INT32_MAX - 1) == -4);
    STATIC_REQUIRE(lockstep::detail::shm::sum_fn{}(INT64_MIN, std::int64_t{-1}) == INT64_MAX);
    STATIC_REQUIRE(lockstep::detail::shm::sum_fn{}(std::int8_t{127}, std::int8_t{1}) == -128);
    // Through the collectives, in the stash (small) and from the peers' buffers (large), on 3
    // replicas (the reference wraps in the unsigned type, as the collectives must).
    const std::size_t count = GENERATE(std::size_t{6}, std::size_t{3000});
    CAPTURE(count);
    thread_group group(3);
    std::vector<std::vector<std::int32_t>> sum32(3), reduced32(3), scattered32(3);
    std::vector<std::vector<std::int64_t>> sum64(3);
    const auto value32 = [](int r, std::size_t i) {
        return static_cast<std::int32_t>(INT32_MAX - static_cast<std::int32_t>(i % 5) - r);
    };
    const auto value64 = [](int r, std::size_t i) {
        return static_cast<std::int64_t>(INT64_MIN + static_cast<std::int64_t>(i % 7) + r);
    };
    group.run([&](thread_communicator& comm) {
        const int r = comm.rank();
        const auto me = static_cast<std::size_t>(r);
        std::vector<std::int32_t> a(count);
        std::vector<std::int64_t> b(count);
        for (std::size_t i = 0; i < count; ++i) {
            a[i] = value32(r, i);
            b[i] = value64(r, i);
        }
        sum32[me].resize(count);
        comm.all_reduce(std::span<const std::int32_t>(a), std::span<std::int32_t>(sum32[me]),
                        reduce_op::sum);
        reduced32[me].resize(r == 0 ? count : 0);
        comm.reduce(std::span<const std::int32_t>(a), std::span<std::int32_t>(reduced32[me]),
                    reduce_op::sum, 0);
        scattered32[me].resize(count / 3);
        comm.reduce_scatter(std::span<const std::int32_t>(a),
                            std::span<std::int32_t>(scattered32[me]), reduce_op::sum);
        comm.all_reduce(std::span<const std::int64_t>(b), std::span<std::int64_t>(b),
                        reduce_op::sum);
        sum64[me] = b;
    });
    std::vector<std::int32_t> want32(count);
    std::vector<std::int64_t> want64(count);
    for (std::size_t i = 0; i < count; ++i) {
        std::uint32_t w32 = 0;
        std::uint64_t w64 = 0;
        for (int r = 0; r < 3; ++r) {
            w32 += static_cast<std::uint32_t>(value32(r, i));
            w64 += static_cast<std::uint64_t>(value64(r, i));
        }
        want32[i] = static_cast<std::int32_t>(w32);
        want64[i] = static_cast<std::int64_t>(w64);
    }
    const std::size_t slice = count / 3;
    for (std::size_t r = 0; r < 3; ++r) {
        CAPTURE(r);
        CHECK(sum32[r] == want32);
        CHECK(sum64[r] == want64);
        CHECK(scattered32[r] == std::vector<std::int32_t>(want32.begin() + r * slice,
                                                          want32.begin() + (r + 1) * slice));
    }
    CHECK(reduced32[0] == want32);
}

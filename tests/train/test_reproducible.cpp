// reduce::reproducible<8> with bn::ghost<8>: the digits-like MLP (ghost BN, dropout keyed by the
// global sample index) trained for 50 uneven steps on 1, 2, 3, 4, 5 and 8 thread replicas holds
// bitwise identical parameters, optimizer state, BN running statistics and losses, for SGD,
// AdamW and LAMB in float and double (thread replicas sum every chunk in one all_combine pass,
// under reduce::reproducible<8> and <8, 0> alike); the three exchanges of the anchored
// accumulator (gathered, by blocks with all_to_all, combined) give the same bits.
// SPDX-License-Identifier: Apache-2.0
#include "optimizer_cases.hpp"
#include "repro_runner.hpp"

#include "train_runner.hpp"

#include "support/bn_probe.hpp"
#include "support/counting_communicator.hpp"

#include <catch2/catch.hpp>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

using namespace lockstep_test;

namespace {

template <class T, template <class> class Case>
void check_replica_counts() {
    using opt = typename Case<T>::type;
    const auto batches = repro_schedule();
    const auto one = repro_threads<T, opt>(1, Case<T>::params(), batches);
    const repro_record<T>& ref = one[0];
    // It trained: the weights moved and the running statistics left their initial values.
    REQUIRE(rel_error(ref.trace.back(), ref.trace.front()) > 1e-3);
    REQUIRE(ref.running[0] != T(0));
    REQUIRE(ref.optimizer_steps == static_cast<std::int64_t>(batches.size()));
    for (int replicas : {2, 3, 4, 5, 8}) {
        const auto run = repro_threads<T, opt>(replicas, Case<T>::params(), batches);
        for (std::size_t r = 0; r < run.size(); ++r) {
            INFO("replicas " << replicas << ", replica " << r);
            CHECK(repro_difference(run[r], ref) == "");
        }
    }
    for (int replicas : {1, 2, 3, 8}) {
        const auto run = repro_threads<T, opt, repro_blocks>(replicas, Case<T>::params(), batches);
        for (std::size_t r = 0; r < run.size(); ++r) {
            INFO("blocks, replicas " << replicas << ", replica " << r);
            CHECK(repro_difference(run[r], ref) == "");
        }
    }
}

/// The collectives one step of the test network issues on 2 thread replicas under Reduce.
template <class Reduce>
std::size_t step_collectives(std::size_t global) {
    using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
    std::size_t out = 0;
    thread_group group(2);
    group.run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, Reduce, thread_communicator> dp(
            comm, [&](auto& ctx) { return net(ctx, mlp_shape{}); }, {.lr = 0.1f}, {.seed = 42});
        const std::size_t before = dp.collectives();
        (void)dp.step(global, [](net& n, const shard_range& range, auto& ctx) {
            return n.train(range, ctx);
        });
        if (comm.rank() == 0)
            out = dp.collectives() - before;
    });
    return out;
}

} // namespace

TEMPLATE_TEST_CASE("reduce::reproducible: bitwise the same weights, state and BN statistics for "
                   "1, 2, 3, 4, 5 and 8 replicas",
                   "[train][reproducible][thread]", float, double) {
    SECTION("sgd") {
        check_replica_counts<TestType, sgd_case>();
    }
    SECTION("adamw") {
        check_replica_counts<TestType, adamw_case>();
    }
    SECTION("lamb") {
        check_replica_counts<TestType, lamb_case>();
    }
}

TEMPLATE_TEST_CASE("reduce::reproducible: chunks kept as the backward marks tensors ready give "
                   "the bits of chunks kept after it",
                   "[train][reproducible][thread]", float, double) {
    // Every chunk but a replica's last is kept tensor by tensor from mark_ready (the tensors not
    // marked after the step function), which leaves the zeros the next chunk starts on; without
    // marks, the whole chunk after the step function. 1 replica (up to 8 chunks a step) and 3,
    // gathered and by blocks.
    using T = TestType;
    const auto batches = repro_schedule(14);
    for (const int replicas : {1, 3}) {
        CAPTURE(replicas);
        const auto marked =
            repro_threads<T, optim::adamw<T>>(replicas, adamw_case<T>::params(), batches, {}, true);
        const auto after = repro_threads<T, optim::adamw<T>>(replicas, adamw_case<T>::params(),
                                                             batches, {}, false);
        const auto blocks = repro_threads<T, optim::adamw<T>, repro_blocks>(
            replicas, adamw_case<T>::params(), batches, {}, true);
        CHECK(repro_difference(marked[0], after[0]) == "");
        CHECK(repro_difference(marked[0], blocks[0]) == "");
    }
}

TEMPLATE_TEST_CASE("reduce::reproducible without BN trains like synchronous per_tensor",
                   "[train][reproducible][thread]", float, double) {
    // With the BN layer as the identity, the sum of chunk gradients is the gradient of the global
    // batch: the same trajectory as the ordinary synchronous trainer, within rounding.
    using T = TestType;
    const auto batches = repro_schedule(20);
    const mlp_shape shape{.batch_norm = false};
    const auto repro =
        repro_threads<T, optim::adamw<T>>(3, adamw_case<T>::params(), batches, shape);
    const auto plain = repro_threads<T, optim::adamw<T>, reduce::per_tensor, bn::local>(
        1, adamw_case<T>::params(), batches, shape);
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-10;
    for (std::size_t s = 0; s < batches.size(); ++s) {
        INFO("step " << s);
        CHECK(rel_error(repro[0].trace[s], plain[0].trace[s]) <= tol);
        CHECK(repro[0].losses[s] == Approx(plain[0].losses[s]).epsilon(tol));
    }
}

TEST_CASE("reduce::reproducible on thread replicas takes 2 collectives a step at every size",
          "[train][reproducible][thread]") {
    // 37 samples in chunks of 8: 5 chunks, 3 on the busiest of 2 replicas. The thread group
    // sums every chunk in one all_combine (plus the loss terms' all_gather), whatever
    // GatherValues says; communicators without all_combine gather or take one all_to_all per
    // chunk index (test_reproducible_mpi).
    CHECK(step_collectives<repro_reduce>(37) == 2);
    CHECK(step_collectives<repro_blocks>(37) == 2);
    CHECK(repro_reduce::name() == "reduce::reproducible<8>");
    CHECK(repro_blocks::name() == "reduce::reproducible<8, 0>");
}

TEMPLATE_TEST_CASE("reduce::reproducible: a non-finite gradient skips the step on every replica",
                   "[train][reproducible][thread]", repro_reduce, repro_blocks) {
    using net = mlp<double, thread_communicator, storage::registry, repro_bn>;
    thread_group group(3);
    std::vector<std::vector<double>> before(3), after(3);
    std::vector<int> skipped(3);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        data_parallel<net, optim::sgd<double>, sync::synchronous, TestType, thread_communicator> dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, {.seed = 1});
        const auto fn = [](net& n, const shard_range& range, auto& ctx) {
            return n.train(range, ctx);
        };
        dp.step(37, fn);
        auto p = dp.parameters();
        before[r].assign(p.begin(), p.end());
        dp.network().poison = comm.rank() == 1;
        skipped[r] = dp.step(37, fn).skipped ? 1 : 0;
        p = dp.parameters();
        after[r].assign(p.begin(), p.end());
    });
    for (std::size_t r = 0; r < 3; ++r) {
        CHECK(skipped[r] == 1);
        CHECK(after[r] == before[r]);
    }
}

namespace {

/// What step 2 of reduce::reproducible on float throws on each of 3 replicas (37 samples in
/// chunks of 8: replica 1 computes two chunks) when replica 1's backward of its chunk
/// `poisoned` (0: the kept one, 1: the last one, which stays in the gradient) makes a gradient
/// element NaN; "" where nothing was thrown. Step 1 is clean and must not throw.
template <class Reduce, bool Wrapped>
std::vector<std::string> poisoned_chunk_messages(int poisoned) {
    std::vector<std::string> what(3);
    const auto body = [&](auto& comm) {
        using C = std::remove_reference_t<decltype(comm)>;
        using net = mlp<float, C, storage::registry, repro_bn>;
        data_parallel<net, optim::sgd<float>, sync::synchronous, Reduce, C> dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1f},
            {.skip_non_finite = false, .seed = 1});
        int call = 0;
        bool poison = false;
        const auto fn = [&](net& n, const shard_range& range, auto& ctx) {
            n.poison = poison && comm.rank() == 1 && call == poisoned;
            ++call;
            return n.train(range, ctx);
        };
        const auto r = static_cast<std::size_t>(comm.rank());
        try {
            dp.step(37, fn);
            call = 0;
            poison = true;
            dp.step(37, fn);
        } catch (const error& e) {
            what[r] = e.what();
        }
    };
    thread_group group(3);
    group.run([&](thread_communicator& inner) {
        if constexpr (Wrapped) {
            testing::counting_communicator<thread_communicator> comm(inner);
            body(comm);
        } else {
            body(inner);
        }
    });
    return what;
}

} // namespace

// On the host in float the step counts this replica's non-finite chunk values only where the
// flags of its keep and last-chunk passes saw one; a NaN in either kind of chunk must still be
// named as replica 1's. The thread group sums through all_combine; the counting wrapper has no
// all_combine, so the same policies take the gathered exchange (repro_reduce) and the blocks
// exchange (repro_blocks).
TEMPLATE_TEST_CASE("reduce::reproducible names the replica of a NaN in a kept or a last chunk",
                   "[train][reproducible][thread]", repro_reduce, repro_blocks) {
    for (int poisoned : {0, 1}) {
        for (const auto& what : {poisoned_chunk_messages<TestType, false>(poisoned),
                                 poisoned_chunk_messages<TestType, true>(poisoned)}) {
            for (std::size_t r = 0; r < 3; ++r) {
                INFO("chunk " << poisoned << " of replica 1 poisoned; replica " << r << ": "
                              << what[r]);
                CHECK_THAT(what[r],
                           Catch::Contains("1 non-finite gradient element(s) on replica 1"));
                CHECK_THAT(what[r], !Catch::Contains("on replica 0") &&
                                        !Catch::Contains("on replica 2") &&
                                        !Catch::Contains("overflowed"));
            }
        }
    }
}

// The global loss is NaN where one replica's chunk loss is: the status names that replica only
// (replica 0 adds the global loss to the status sum, and was named for it).
TEMPLATE_TEST_CASE("reduce::reproducible names only the replica whose chunk loss is NaN",
                   "[train][reproducible][thread]", repro_reduce, repro_blocks) {
    for (const int nan_on : {1, 2}) {
        std::vector<std::string> what(3);
        thread_group(3).run([&](thread_communicator& comm) {
            using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
            data_parallel<net, optim::sgd<float>, sync::synchronous, TestType> dp(
                comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1f},
                {.skip_non_finite = false, .seed = 1});
            const auto fn = [&](net& n, const shard_range& range, auto& ctx) {
                const double loss = n.train(range, ctx);
                return comm.rank() == nan_on ? std::numeric_limits<double>::quiet_NaN() : loss;
            };
            try {
                dp.step(37, fn);
            } catch (const error& e) {
                what[static_cast<std::size_t>(comm.rank())] = e.what();
            }
        });
        for (std::size_t r = 0; r < 3; ++r) {
            INFO("NaN loss on replica " << nan_on << "; replica " << r << ": " << what[r]);
            CHECK_THAT(what[r], Catch::Contains(lockstep::detail::concat(
                                    "the loss is not finite on replica ", nan_on, ";")));
            for (int other = 0; other < 3; ++other)
                if (other != nan_on)
                    CHECK_THAT(what[r], !Catch::Contains(
                                            lockstep::detail::concat("on replica ", other, ";")));
        }
    }
}

// A global sum beyond float's range skips the step on every replica and is named as the sum's
// overflow, and a NaN in one chunk names the replica that computed it, whichever exchange runs:
// on the thread group the sums report both (combined), through the counting wrapper (no
// all_combine) the gathered and the blocks exchange count them in the gradient.
TEMPLATE_TEST_CASE("reduce::reproducible names an overflowing sum and the replica of a NaN on "
                   "every exchange",
                   "[train][reproducible][thread]", repro_reduce, repro_blocks) {
    for (const int replicas : {1, 2, 3}) {
        for (const bool wrapped : {false, true}) {
            CAPTURE(replicas, wrapped);
            std::vector<std::string> overflow(static_cast<std::size_t>(replicas));
            std::vector<std::string> nan(static_cast<std::size_t>(replicas));
            std::vector<std::string> clean(static_cast<std::size_t>(replicas));
            const auto body = [&](auto& comm) {
                const auto r = static_cast<std::size_t>(comm.rank());
                overflow[r] = extreme_step_message<TestType>(comm, true, 99);
                nan[r] = extreme_step_message<TestType>(comm, false, 2);
                clean[r] = extreme_step_message<TestType>(comm, false, 99);
            };
            thread_group group(replicas);
            group.run([&](thread_communicator& inner) {
                if (wrapped) {
                    testing::counting_communicator<thread_communicator> comm(inner);
                    body(comm);
                } else {
                    body(inner);
                }
            });
            // Chunk 2 of 4 lies on replica 1 of 2 and 3, on replica 0 of 1.
            const int holder = replicas == 1 ? 0 : 1;
            for (std::size_t r = 0; r < static_cast<std::size_t>(replicas); ++r) {
                CAPTURE(r);
                CHECK_THAT(overflow[r],
                           Catch::Contains("the reduced gradient has 1 non-finite element(s) "
                                           "(the sum over replicas overflowed), the first in "
                                           "'w' (element 0)"));
                CHECK_THAT(nan[r], Catch::Contains(lockstep::detail::concat(
                                       "1 non-finite gradient element(s) on replica ", holder,
                                       ", the first in 'w' (element 2)")));
                CHECK_THAT(nan[r], !Catch::Contains("overflowed"));
                CHECK(clean[r].empty());
            }
        }
    }
}

TEST_CASE("reduce::reproducible refuses micro-batches", "[train][reproducible][thread]") {
    using net = mlp<float, thread_communicator, storage::registry, repro_bn>;
    thread_group group(1);
    CHECK_THROWS_WITH(group.run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce, thread_communicator>
            dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, {.micro_batches = 2});
    }),
                      Catch::Contains("reduce::reproducible cuts every global batch into chunks"));
}

TEST_CASE("reduce::reproducible refuses more chunks than it sums, naming the fix",
          "[train][reproducible][thread]") {
    // 2^19 chunks of one sample plus one replica: one term more than the anchored sum takes
    // (refused before any chunk is computed).
    using net = mlp<float, thread_communicator, storage::registry, bn::ghost<1>>;
    thread_group group(1);
    CHECK_THROWS_WITH(
        group.run([&](thread_communicator& comm) {
            data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::reproducible<1>,
                          thread_communicator>
                dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1});
            dp.step(std::size_t{1} << 19,
                    [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
        }),
        Catch::Contains("global batch 524288 in chunks of 1 samples is 524288 chunks on 1 "
                        "replicas; reduce::reproducible sums at most 524288 chunks plus "
                        "replicas: use a larger ChunkSamples (reduce::reproducible<C>) or a "
                        "smaller global batch"));
}

namespace {

/// Value of element i of global chunk c in the exchange test: exponents over 2^-40..2^40, both
/// signs; at element 5 values whose sums overflow on replicas 0 and 1 but cancel globally, at
/// element 7 a sum that is subnormal; with `poison`, a NaN in chunk 1 at elements 11 and 4000, an
/// infinity in chunk 0 at element 4000 and in the last chunk (`chunks` of them) at element 9000.
float exchange_value(std::size_t c, std::size_t i, bool poison = false, std::size_t chunks = 0) {
    if (poison && ((c == 1 && (i == 11 || i == 4000)) || (c == 0 && i == 4000)))
        return c == 1 ? std::numeric_limits<float>::quiet_NaN()
                      : -std::numeric_limits<float>::infinity();
    if (poison && c + 1 == chunks && i == 9000)
        return std::numeric_limits<float>::infinity();
    if (i == 7) // a subnormal sum: 1.5 x 2^-126 - 2^-126
        return c == 0 ? 0x1.8p-126f : c == 1 ? -0x1p-126f : 0.0f;
    if (i == 5)
        return c < 2   ? std::numeric_limits<float>::max()
               : c < 4 ? -std::numeric_limits<float>::max()
                       : 0.0f;
    std::uint64_t h = (c + 1) * 0x9e3779b97f4a7c15ULL ^ (i + 1) * 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 31;
    h *= 0x94d049bb133111ebULL;
    h ^= h >> 29;
    const float mant = static_cast<float>(h & 0xffffff) / 16777216.0f + 0.5f;
    const int e = static_cast<int>((h >> 24) % 81) - 40;
    return std::ldexp((h >> 40) & 1 ? -mant : mant, e);
}

struct exchange_result {
    std::vector<float> sums; ///< g after finalize
    double global_loss = 0;
    bool keeps = true; ///< take() left zeros of every kept chunk and the last one as it was
    /// This replica's own check: its non-finite elements and 1 + the first's index, taken from
    /// own_report().
    double own_count = 0;
    double own_first = 0;
    bool reports = false;
    bool sums_finite = false; ///< sums_finite() after finalize
};

/// Sets the CPU's flush of subnormal floats to zero (x86: MXCSR's DAZ and FTZ, what
/// -ffast-math's start-up code sets) for the calling thread while it lives (x86-64 only; a
/// no-op elsewhere).
class flush_subnormals {
public:
    flush_subnormals() {
#if defined(__x86_64__)
        saved_ = _mm_getcsr();
        _mm_setcsr(saved_ | 0x8040u);
#endif
    }
    ~flush_subnormals() {
#if defined(__x86_64__)
        _mm_setcsr(saved_);
#endif
    }
    flush_subnormals(const flush_subnormals&) = delete;
    flush_subnormals& operator=(const flush_subnormals&) = delete;

private:
    unsigned saved_ = 0;
};

/// The anchored accumulator's step protocol on `replicas` thread replicas holding `chunks`
/// chunks of n elements between them (balanced, contiguous), in one exchange mode; chunk c's
/// element i is value(c, i) (exchange_value with `poison`, when null); with `flush`, every
/// replica runs it with subnormal floats flushed to zero (flush_subnormals).
template <class Communicator>
std::vector<exchange_result> run_exchange(int replicas, std::size_t chunks, std::size_t n,
                                          std::size_t gather_values, bool poison = false,
                                          float (*value)(std::size_t, std::size_t) = nullptr,
                                          bool flush = false) {
    std::vector<exchange_result> out(static_cast<std::size_t>(replicas));
    thread_group group(replicas);
    group.run([&](thread_communicator& inner) {
        std::optional<flush_subnormals> flushing;
        if (flush)
            flushing.emplace();
        Communicator comm(inner);
        const int r = comm.rank();
        lockstep::detail::anchored_accumulator<
            float, host_system,
            lockstep::detail::anchored_exchange_for<std::remove_cvref_t<Communicator>>>
            acc(n, replicas, r, comm.system(), gather_values);
        const reduce::chunk_run mine = reduce::chunks_of(chunks, 1, r, replicas);
        const reduce::chunk_run busiest = reduce::chunks_of(chunks, 1, 0, replicas);
        std::vector<float> g(n, 0.0f);
        exchange_result& res = out[static_cast<std::size_t>(r)];
        acc.begin(std::max<std::size_t>(mine.count, 1), std::max<std::size_t>(busiest.count, 1));
        if (mine.count == 0) {
            acc.add(std::span<const float>(g));
            acc.add_loss(0.0, nullptr);
        }
        for (std::size_t c = mine.first; c < mine.first + mine.count; ++c) {
            for (std::size_t i = 0; i < n; ++i)
                g[i] = value != nullptr ? value(c, i) : exchange_value(c, i, poison, chunks);
            // Taken in three parts, out of order, as a backward marks tensors ready: a kept
            // chunk leaves zeros in g, the last one stays.
            const std::vector<float> before = g;
            const std::size_t a = n / 3, b = n - n / 5;
            acc.take(std::span<float>(g), b, n - b);
            acc.take(std::span<float>(g), 0, a);
            acc.take(std::span<float>(g), a, b - a);
            res.keeps = res.keeps &&
                        (c + 1 < mine.first + mine.count
                             ? std::all_of(g.begin(), g.end(), [](float x) { return x == 0.0f; })
                             : std::memcmp(g.data(), before.data(), n * sizeof(float)) == 0);
            acc.add(std::span<const float>(g));
            acc.add_loss(0.125 * static_cast<double>(c + 1), nullptr);
        }
        acc.exchange(comm, std::span<const float>(g));
        acc.check_local(std::span<float>(g));
        res.reports = acc.reports_own();
        acc.finalize(comm, std::span<float>(g));
        res.global_loss = *acc.global_loss();
        res.sums = g;
        res.sums_finite = acc.sums_finite();
        if (res.reports) {
            res.own_count = acc.own_report()->own.count;
            res.own_first = acc.own_report()->own.first;
        }
    });
    return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

} // namespace

TEST_CASE("reduce::reproducible's gathered exchange takes one all_gather for the chunks and the "
          "loss terms",
          "[train][reproducible][thread]") {
    // Counted on the communicator itself: 2 replicas, 3 chunks of 1001 values (the busiest
    // replica has 2, the other 1 and a region of zeros; 2 x 1001 chunk values is even, 1001 on
    // one call would need padding), then the loss sum of every chunk.
    const std::size_t n = 1001;
    std::vector<double> losses(2);
    std::vector<int> gathers(2), collectives(2);
    std::vector<std::size_t> claimed(2); // what the accumulator says it issued
    thread_group group(2);
    group.run([&](thread_communicator& inner) {
        testing::counting_communicator<thread_communicator> comm(inner);
        const int r = comm.rank();
        lockstep::detail::anchored_accumulator<float, host_system> acc(n, 2, r, comm.system(),
                                                                       std::size_t{1} << 30);
        const std::size_t calls = r == 0 ? 2 : 1;
        std::vector<float> g(n, 0.0f);
        acc.begin(calls, 2);
        for (std::size_t c = 0; c < calls; ++c) {
            for (std::size_t i = 0; i < n; ++i)
                g[i] = static_cast<float>(i % 7) +
                       0.5f * static_cast<float>(c + 2 * static_cast<std::size_t>(r));
            acc.take(std::span<float>(g), 0, n);
            acc.add(std::span<const float>(g));
            acc.add_loss(0.25 * static_cast<double>(c + 1 + 2 * static_cast<std::size_t>(r)),
                         nullptr);
        }
        acc.exchange(comm, std::span<const float>(g));
        acc.check_local(std::span<float>(g));
        acc.finalize(comm, std::span<float>(g));
        losses[static_cast<std::size_t>(r)] = *acc.global_loss();
        gathers[static_cast<std::size_t>(r)] = comm.counts().all_gather;
        collectives[static_cast<std::size_t>(r)] = comm.counts().collectives();
        claimed[static_cast<std::size_t>(r)] = acc.collectives();
    });
    // Loss terms 0.25 + 0.5 (replica 0) and 0.75 (replica 1), summed exactly.
    CHECK(losses[0] == 1.5);
    CHECK(losses[1] == 1.5);
    CHECK(gathers == std::vector<int>{1, 1});
    CHECK(collectives == std::vector<int>{1, 1});
    CHECK(claimed == std::vector<std::size_t>{1, 1});
}

TEST_CASE("reduce::reproducible's exchanges (gathered, by blocks, combined in one pass) give the "
          "anchored sum of every chunk, bit for bit, and the same own checks",
          "[train][reproducible][thread]") {
    const std::size_t n = 10007;
    const int replicas = GENERATE(1, 2, 3);
    const std::size_t chunks = GENERATE(std::size_t{2}, std::size_t{3}, std::size_t{5});
    const bool poison = GENERATE(false, true);
    CAPTURE(replicas, chunks, poison);
    // The reference: every chunk of each element summed by anchored_sum_fn in one place.
    std::vector<float> all(chunks * n), want(n);
    for (std::size_t c = 0; c < chunks; ++c)
        for (std::size_t i = 0; i < n; ++i)
            all[c * n + i] = exchange_value(c, i, poison, chunks);
    const kernels::anchored_terms<float> terms{all.data(), 1, chunks, 0, n};
    for (std::size_t i = 0; i < n; ++i)
        kernels::anchored_sum_fn<float>{terms, want.data()}(i);
    // Element 5: 2 chunks overflow, 3 leave the largest float, 5 cancel to 0.
    const float at5 = chunks == 2   ? std::numeric_limits<float>::infinity()
                      : chunks == 3 ? std::numeric_limits<float>::max()
                                    : 0.0f;
    REQUIRE(want[5] == at5);
    REQUIRE(want[7] == 0x1p-127f);
    const bool finite =
        std::all_of(want.begin(), want.end(), [](float x) { return std::isfinite(x); });
    REQUIRE(finite == (!poison && chunks != 2));
    // The thread group without all_combine (counting_communicator forwards none) exchanges by
    // blocks, or gathered.
    using blocks_comm = testing::counting_communicator<thread_communicator>;
    const auto gathered =
        run_exchange<blocks_comm>(replicas, chunks, n, std::size_t{1} << 30, poison);
    const auto blocks = run_exchange<blocks_comm>(replicas, chunks, n, 0, poison);
    const auto combined = run_exchange<thread_communicator&>(replicas, chunks, n, 0, poison);
    for (std::size_t r = 0; r < static_cast<std::size_t>(replicas); ++r) {
        CAPTURE(r);
        CHECK(gathered[r].keeps);
        CHECK(blocks[r].keeps);
        CHECK(combined[r].keeps);
        CHECK(same_bits(gathered[r].sums, want));
        CHECK(same_bits(blocks[r].sums, want));
        CHECK(same_bits(combined[r].sums, want));
        // Each replica's own check: its elements with a non-finite value, counted directly.
        const reduce::chunk_run mine = reduce::chunks_of(chunks, 1, static_cast<int>(r), replicas);
        double count = 0, first = 0;
        for (std::size_t i = 0; i < n; ++i) {
            bool bad = false;
            for (std::size_t c = mine.first; c < mine.first + mine.count; ++c)
                bad = bad || !std::isfinite(all[c * n + i]);
            if (bad) {
                count += 1;
                first = first == 0 ? static_cast<double>(i + 1) : first;
            }
        }
        if (poison && mine.count > 0 && mine.first + mine.count == chunks) // the last's infinity
            REQUIRE(count >= 1);
        // The sums on the host report, whatever the exchange.
        CHECK(combined[r].reports);
        CHECK(gathered[r].reports);
        CHECK(blocks[r].reports);
        for (const auto* run : {&gathered, &blocks, &combined}) {
            CHECK((*run)[r].own_count == count);
            CHECK((*run)[r].own_first == first);
            // Loss terms 0.125 (c + 1) of chunks c = 0 .. chunks - 1: multiples of 1/8, exact.
            CHECK((*run)[r].global_loss ==
                  0.0625 * static_cast<double>(chunks) * static_cast<double>(chunks + 1));
        }
        // The sums say when every one of them is finite.
        CHECK(combined[r].sums_finite == finite);
        CHECK(gathered[r].sums_finite == finite);
        CHECK(blocks[r].sums_finite == finite);
    }
}

#if defined(__x86_64__) // the flush mode set here is x86's MXCSR
TEST_CASE("reduce::reproducible's exchanges keep subnormal terms where the CPU flushes them",
          "[train][reproducible][thread]") {
    // Every term subnormal; 8 elements on 3 replicas exchanged by blocks leave elements 6 and 7
    // to the tail, which travels in the replicas' rows of doubles as floats moved by their bytes,
    // not converted (a conversion reads a subnormal float as 0 under denormals-are-zero). Every
    // exchange, run with subnormals flushed on every replica, gives the sums of the reference
    // formed without flushing.
    constexpr std::size_t n = 8;
    constexpr std::size_t chunks = 3;
    // Formed here, without flushing (the replicas' arithmetic would flush them); read there.
    static std::vector<float> all(chunks * n);
    for (std::size_t c = 0; c < chunks; ++c)
        for (std::size_t i = 0; i < n; ++i)
            all[c * n + i] = std::ldexp(
                static_cast<float>((c + 1) * (i + 1)) * (i % 2 == 0 ? 1.0f : -0.75f), -140);
    const auto value = [](std::size_t c, std::size_t i) { return all[c * n + i]; };
    std::vector<float> want(n);
    REQUIRE(std::fpclassify(all[n - 1]) == FP_SUBNORMAL);
    for (std::size_t i = 0; i < n; ++i)
        kernels::anchored_sum_fn<float>{{all.data(), 1, chunks, 0, n}, want.data()}(i);
    REQUIRE(want[n - 1] == std::ldexp(-0.75f * 8.0f * 6.0f, -140)); // exact: -36 x 2^-140
    using blocks_comm = testing::counting_communicator<thread_communicator>;
    for (const int replicas : {1, 2, 3}) {
        CAPTURE(replicas);
        const auto blocks = run_exchange<blocks_comm>(replicas, chunks, n, 0, false, value, true);
        const auto gathered = run_exchange<blocks_comm>(replicas, chunks, n, std::size_t{1} << 30,
                                                        false, value, true);
        const auto combined =
            run_exchange<thread_communicator&>(replicas, chunks, n, 0, false, value, true);
        for (std::size_t r = 0; r < static_cast<std::size_t>(replicas); ++r) {
            CAPTURE(r);
            CHECK(same_bits(blocks[r].sums, want));
            CHECK(same_bits(gathered[r].sums, want));
            CHECK(same_bits(combined[r].sums, want));
            CHECK(blocks[r].sums_finite);
            CHECK(blocks[r].own_count == 0);
        }
    }
}
#endif

namespace {

/// One parameter of 3 elements whose chunk gradients (chunks of 8 samples, 4 chunks a step) are
/// +max, +max, -max, -max at element 0 (a replica holding chunks 0 and 1 has an own sum beyond
/// float's range; the global sum is 0), 0.25 (c + 1) at element 1, and 2^-20 c at element 2;
/// the chunk losses are max, max, -max, -max + 2^971 with double's max (their sum: 2^971, exact).
template <class Context>
struct cancelling_net {
    typename Context::handle w;
    explicit cancelling_net(Context& ctx) : w(ctx.registry().add("w", {3})) {}
    double train(const shard_range& r, Context& ctx) {
        const std::size_t c = r.begin / 8;
        const std::span<float> g = w.grad();
        g[0] += c < 2 ? std::numeric_limits<float>::max() : -std::numeric_limits<float>::max();
        g[1] += 0.25f * static_cast<float>(c + 1);
        g[2] += std::ldexp(static_cast<float>(c), -20);
        ctx.mark_ready(w);
        const double max = std::numeric_limits<double>::max();
        return c < 2 ? max : c == 2 ? -max : -max + 0x1p971;
    }
};

struct cancelling_result {
    std::vector<float> weights;
    bool skipped = true;
    double loss = 0;
};

std::vector<cancelling_result> run_cancelling(int replicas) {
    using net = cancelling_net<replica_context<float, thread_communicator>>;
    std::vector<cancelling_result> out(static_cast<std::size_t>(replicas));
    thread_group group(replicas);
    group.run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, repro_reduce, thread_communicator>
            dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.5f});
        cancelling_result& res = out[static_cast<std::size_t>(comm.rank())];
        const step_result r = dp.step(
            32, [](net& n, const shard_range& range, auto& ctx) { return n.train(range, ctx); });
        res.skipped = r.skipped;
        res.loss = r.loss;
        const auto p = dp.parameters();
        res.weights.assign(p.begin(), p.end());
    });
    return out;
}

} // namespace

TEST_CASE("reduce::reproducible: own sums beyond the range that cancel globally skip nothing, on "
          "any replica count",
          "[train][reproducible][thread]") {
    // The skip decision must not depend on how chunks are grouped: only a non-finite chunk value
    // or loss, or a non-finite global sum, skips. On one replica the 4 chunks' sum at element 0
    // is 0 and their loss 2^971; on 2 replicas each replica's own 2 chunks leave the range of float
    // (gradient) and double (loss).
    const auto one = run_cancelling(1);
    REQUIRE(!one[0].skipped);
    CHECK(one[0].loss == 0x1p971);
    // The reference: w = 0 - 0.5 x the exact sums (0, 2.5, 6 x 2^-20), each exact in float.
    CHECK(one[0].weights == std::vector<float>{0.0f, -1.25f, -3.0f * 0x1p-20f});
    for (int replicas : {2, 4}) {
        const auto run = run_cancelling(replicas);
        for (std::size_t r = 0; r < run.size(); ++r) {
            INFO("replicas " << replicas << ", replica " << r);
            CHECK(!run[r].skipped);
            CHECK(same_bits(run[r].weights, one[0].weights));
            CHECK(run[r].loss == 0x1p971);
        }
    }
}

namespace {

/// Channel k of sample g: its own scale and offset per channel.
double ghost_feature(std::uint64_t g, std::size_t k) {
    return rng_stream{0x6057, 2}.normal(g, k) * double(k + 1) + double(k);
}

using ghost_probe = bn_probe<bn::ghost<4>, ghost_feature>;

/// The running statistics after `steps` steps of `global` samples on `replicas` replicas.
std::vector<double> ghost_running(int replicas, std::size_t steps, std::size_t global) {
    std::vector<double> out;
    thread_group(replicas).run([&](thread_communicator& comm) {
        data_parallel<ghost_probe, optim::sgd<double>, sync::synchronous, reduce::reproducible<4>,
                      thread_communicator>
            dp(comm, [](auto& ctx) { return ghost_probe(ctx); }, {.lr = 0.01});
        for (std::size_t s = 0; s < steps; ++s)
            (void)dp.step(global, [](ghost_probe& n, const shard_range& r, auto& ctx) {
                return n.train(r, ctx);
            });
        if (comm.rank() == 0) {
            const auto m = dp.network().bn->running_mean();
            const auto v = dp.network().bn->running_var();
            out.assign(m.begin(), m.end());
            out.insert(out.end(), v.begin(), v.end());
        }
    });
    return out;
}

} // namespace

TEST_CASE("bn::ghost's running statistics follow every chunk in global order, as torch's "
          "sequential update",
          "[train][reproducible][thread]") {
    // Steps of 10 samples in chunks of 4, 4 and 2: each chunk updates running_mean and
    // running_var (unbiased: m2 / (n - 1)) with momentum 0.1, in global chunk order. The
    // reference is naive double loops over the same features; the layer's statistics are
    // computed in double too, so they agree to rounding (1e-12 relative, stated not tuned:
    // a few ulps of double over 3 steps of 10 samples).
    constexpr std::size_t steps = 3, global = 10, chunk = 4, C = ghost_probe::channels;
    std::vector<double> mean(C, 0.0), var(C, 1.0);
    for (std::size_t s = 0; s < steps; ++s)
        for (std::size_t first = 0; first < global; first += chunk) {
            const std::size_t n = std::min(chunk, global - first);
            for (std::size_t k = 0; k < C; ++k) {
                double sum = 0, sq = 0;
                for (std::size_t i = 0; i < n; ++i)
                    sum += ghost_feature(s * global + first + i, k);
                const double mu = sum / double(n);
                for (std::size_t i = 0; i < n; ++i) {
                    const double d = ghost_feature(s * global + first + i, k) - mu;
                    sq += d * d;
                }
                mean[k] = 0.9 * mean[k] + 0.1 * mu;
                var[k] = 0.9 * var[k] + 0.1 * sq / double(n - 1);
            }
        }
    const std::vector<double> one = ghost_running(1, steps, global);
    REQUIRE(one.size() == 2 * C);
    for (std::size_t k = 0; k < C; ++k) {
        INFO("channel " << k);
        CHECK(one[k] == Approx(mean[k]).epsilon(1e-12));
        CHECK(one[C + k] == Approx(var[k]).epsilon(1e-12));
    }
    // Every replica count gives the same bits.
    for (const int replicas : {2, 3}) {
        INFO(replicas << " replicas");
        CHECK(ghost_running(replicas, steps, global) == one);
    }
}

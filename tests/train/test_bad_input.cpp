// Bad input to the training layer's bookkeeping: registry shapes whose product overflows, shard()
// with no replicas, micro-batch and sample-offset arithmetic at huge batch sizes, optimizer
// hyperparameters the trainer's optimizer refuses.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/shard.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "mlp_fixture.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

using namespace lockstep;

using lockstep_test::contains;

TEST_CASE("the registry refuses shapes whose element count overflows", "[train]") {
    parameter_registry<float> reg(host_system{1}, 2);
    const std::size_t big = std::size_t(1) << 63;
    try {
        reg.add("w", {big + 1, 2}); // wraps to 2 elements without the check
        FAIL("accepted shape {2^63 + 1, 2} as " << reg.parameter_count() << " elements");
    } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        CHECK(e.replica() == 2);
        CHECK(contains(e.what(), "parameter_registry.add"));
        CHECK(contains(e.what(), "'w' of shape {9223372036854775809, 2}"));
    }
    // Fits in size_t as elements but not as bytes of float.
    CHECK_THROWS_AS(reg.add_state("s", {std::size_t(1) << 62}), error);
    // The registry is unchanged and still usable.
    auto h = reg.add("b", {3, 2});
    reg.finalize();
    CHECK(reg.parameter_count() == 6);
    CHECK(h.size() == 6);
}

TEST_CASE("shard names the problem with zero replicas or a rank outside the group", "[train]") {
    try {
        (void)shard(10, 0, 0);
        FAIL("shard(10, 0, 0) returned");
    } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        CHECK(contains(e.what(), "size = 0: a batch is split over at least one replica"));
    }
    try {
        (void)shard(10, 3, 2);
        FAIL("shard(10, 3, 2) returned");
    } catch (const error& e) {
        CHECK(contains(e.what(), "rank 3 is not a replica of 2"));
    }
}

TEST_CASE("micro-batch positions and sample offsets do not wrap at huge batch sizes", "[train]") {
    const std::size_t global = std::size_t(1) << 62;
    // global * m overflows size_t for m >= 4: positions must still tile [0, global).
    std::size_t next = 0;
    for (std::size_t m = 0; m < 8; ++m) {
        const shard_range r = micro_batch(global, m, 8);
        CHECK(r.begin == next);
        CHECK(r.size() == global / 8);
        next = r.end;
    }
    CHECK(next == global);
    CHECK(micro_batch(10, 2, 3).begin == 6);
    CHECK(micro_batch(10, 2, 3).end == 10);
    CHECK_THROWS_AS(micro_batch(10, 3, 3), error);
    CHECK(next_sample_offset(5, 7, 0) == 12);
    try {
        (void)next_sample_offset(UINT64_MAX - global + 1, global, 1);
        FAIL("the sample index wrapped");
    } catch (const error& e) {
        CHECK(e.replica() == 1);
        CHECK(contains(e.what(), "overflows the 64-bit sample index"));
    }
}

TEST_CASE("data_parallel.step with a 2^62-sample global batch splits it without wrapping and "
          "refuses a step that would wrap the sample index",
          "[train][thread]") {
    using net = lockstep_test::mlp<float, thread_communicator, lockstep_test::storage::registry>;
    const std::size_t global = std::size_t(1) << 62;
    std::vector<std::vector<shard_range>> ranges(2);
    std::vector<std::string> errors(2);
    thread_group(2).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        data_parallel<net, optim::sgd<float>> dp(comm, [](auto& ctx) { return net(ctx); },
                                                 {.lr = 0.1}, {.micro_batches = 4});
        const auto record = [&](net&, const shard_range& s, auto&) {
            ranges[r].push_back(s);
            return 0.0; // touches no data: only the bookkeeping is under test
        };
        try {
            for (int step = 0; step < 3; ++step) // sample index 3 * 2^62 afterwards
                dp.step(global, record);
            dp.step(global, record); // 3 * 2^62 + 2^62 wraps 64 bits
        } catch (const error& e) {
            errors[r] = e.what();
        }
    });
    for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(r, errors[r]);
        CHECK(contains(errors[r], "overflows the 64-bit sample index"));
        REQUIRE(ranges[r].size() == 12); // 3 steps of 4 micro-batches; nothing of the 4th
        // Each micro-batch m covers [m 2^60, (m + 1) 2^60); the replica gets its half.
        for (std::size_t m = 0; m < 4; ++m) {
            const shard_range& s = ranges[r][m];
            const std::size_t quarter = global / 4;
            CHECK(s.begin == m * quarter + r * (quarter / 2));
            CHECK(s.size() == quarter / 2);
            CHECK(s.global_size == global);
        }
        CHECK(ranges[r][4].sample_offset == global);
    }
}

namespace {
using mark_ctx = replica_context<float, thread_communicator>;
/// Two parameters and two state tensors; fn marks one of the state tensors ready.
struct with_state {
    mark_ctx::handle p0, p1, s0, s1;
    explicit with_state(mark_ctx& ctx) {
        auto& reg = ctx.registry();
        p0 = reg.add("p0", {4});
        p1 = reg.add("p1", {4});
        s0 = reg.add_state("s0", {1});
        s1 = reg.add_state("running.s1", {1});
    }
};
} // namespace

TEST_CASE("mark_ready refuses a state tensor's handle, naming the tensor and the replica",
          "[train][thread]") {
    // A state handle's index counts state tensors: taken as a parameter index it would launch
    // another tensor's bucket (here p1's, before its gradient is written).
    std::vector<std::string> errors(2);
    std::vector<int> codes(2, -1);
    std::vector<std::vector<float>> before(2), after(2);
    thread_group(2).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        data_parallel<with_state, optim::sgd<float>, sync::synchronous, reduce::per_tensor> dp(
            comm, [](auto& ctx) { return with_state(ctx); }, {.lr = 1.0});
        auto p = dp.parameters();
        before[r].assign(p.begin(), p.end());
        try {
            dp.step(2, [&](with_state& n, const shard_range& s, mark_ctx& ctx) {
                ctx.mark_ready(n.s1);
                for (int k = 0; k < 4; ++k) {
                    n.p0.grad()[k] += float(s.begin + 1);
                    n.p1.grad()[k] += float(s.begin + 1);
                }
                ctx.mark_ready(n.p1);
                ctx.mark_ready(n.p0);
                return 0.0;
            });
        } catch (const error& e) {
            errors[r] = e.what();
            codes[r] = static_cast<int>(e.code());
        }
        p = dp.parameters();
        after[r].assign(p.begin(), p.end());
    });
    for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(r, errors[r]);
        CHECK(codes[r] == static_cast<int>(errc::invalid_argument));
        CHECK(contains(errors[r], "replica " + std::to_string(r) + ": replica_context.mark_ready"));
        CHECK(contains(errors[r], "'running.s1' is a state tensor"));
        CHECK(after[r] == before[r]); // nothing applied
    }
}

TEMPLATE_TEST_CASE("an optimizer refusing the trainer's hyperparameters names the replica on "
                   "every replica",
                   "[train][thread]", reduce::per_tensor, reduce::sharded<>) {
    // The optimizer's constructor knows no replica; the trainer that builds it does (sharded:
    // each replica builds its shard's optimizer, another construction path).
    constexpr int replicas = 3;
    std::vector<std::string> errors(replicas);
    std::vector<int> named(replicas, -2), codes(replicas, -1);
    thread_group(replicas).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        try {
            data_parallel<with_state, optim::adam<float>, sync::synchronous, TestType> dp(
                comm, [](auto& ctx) { return with_state(ctx); }, {.beta1 = 1.0});
        } catch (const error& e) {
            errors[r] = e.what();
            named[r] = e.replica();
            codes[r] = static_cast<int>(e.code());
        }
    });
    for (int r = 0; r < replicas; ++r) {
        CAPTURE(r, errors[std::size_t(r)]);
        CHECK(named[std::size_t(r)] == r);
        CHECK(codes[std::size_t(r)] == static_cast<int>(errc::invalid_argument));
        CHECK(contains(errors[std::size_t(r)], "replica " + std::to_string(r) + ": adam: "));
        CHECK(contains(errors[std::size_t(r)], "need beta1 < 1"));
        CHECK(contains(errors[std::size_t(r)], "beta1 = 1,"));
    }
}

TEST_CASE("mark_ready refuses a default-constructed handle and another registry's, on that "
          "replica; its peers get peer_failure",
          "[train][thread]") {
    // Either handle has index 0: taken as this registry's it would mark p0 ready before its
    // gradient is written, on that replica alone.
    for (const bool foreign : {false, true}) {
        INFO((foreign ? "another registry's handle" : "a default-constructed handle"));
        std::vector<std::string> errors(3);
        std::vector<int> codes(3, -1);
        std::vector<std::vector<float>> before(3), after(3);
        try {
            thread_group(3, {.timeout = std::chrono::seconds(30)})
                .run([&](thread_communicator& comm) {
                    const auto r = static_cast<std::size_t>(comm.rank());
                    parameter_registry<float> other; // e.g. a teacher model's
                    const auto teacher = other.add("teacher.w", {4});
                    other.finalize();
                    using dp_type = data_parallel<with_state, optim::sgd<float>, sync::synchronous,
                                                  reduce::per_tensor>;
                    // A peer may meet replica 1's failure while it still completes the
                    // constructor's last collective: its error is recorded wherever it comes.
                    std::optional<dp_type> dp;
                    try {
                        dp.emplace(
                            comm, [](auto& ctx) { return with_state(ctx); },
                            optim::sgd_params{.lr = 1.0});
                        auto p = dp->parameters();
                        before[r].assign(p.begin(), p.end());
                        dp->step(3, [&](with_state& n, const shard_range& s, mark_ctx& ctx) {
                            if (ctx.rank() == 1)
                                ctx.mark_ready(foreign ? teacher : mark_ctx::handle{});
                            for (int k = 0; k < 4; ++k) {
                                n.p0.grad()[k] += float(s.begin + 1);
                                n.p1.grad()[k] += float(s.begin + 2);
                            }
                            ctx.mark_ready(n.p1);
                            ctx.mark_ready(n.p0);
                            return 0.0;
                        });
                    } catch (const error& e) {
                        errors[r] = e.what();
                        codes[r] = static_cast<int>(e.code());
                        if (dp) {
                            const auto p = dp->parameters();
                            after[r].assign(p.begin(), p.end());
                        }
                        throw;
                    }
                    const auto p = dp->parameters();
                    after[r].assign(p.begin(), p.end());
                });
        } catch (const error&) {
        }
        for (std::size_t r = 0; r < 3; ++r) {
            CAPTURE(r, errors[r]);
            CHECK(after[r] == before[r]); // nothing applied
            if (r != 1) {
                CHECK(codes[r] == static_cast<int>(errc::peer_failure));
                continue;
            }
            CHECK(codes[r] == static_cast<int>(errc::invalid_argument));
            CHECK(contains(errors[r], "replica 1: replica_context.mark_ready"));
            CHECK(contains(errors[r],
                           foreign ? "'teacher.w' is a tensor of another parameter_registry"
                                   : "the handle is default-constructed and names no tensor"));
            CHECK(contains(errors[r], "ctx.registry().add"));
        }
    }
}

TEST_CASE("a default-constructed handle's accessors and another registry's handle are refused",
          "[train]") {
    const tensor_handle<float> none;
    CHECK_FALSE(none.valid());
    for (const char* op : {"tensor_handle.value", "tensor_handle.grad", "tensor_handle.info"}) {
        INFO(op);
        try {
            const std::string what = op;
            if (what == "tensor_handle.value")
                (void)none.value();
            else if (what == "tensor_handle.grad")
                (void)none.grad();
            else
                (void)none.name();
            FAIL("a default-constructed handle resolved to a tensor");
        } catch (const error& e) {
            CHECK(e.code() == errc::invalid_argument);
            CHECK(e.operation() == op);
            CHECK(contains(e.what(), "the handle is default-constructed and names no tensor"));
        }
    }
    parameter_registry<float> a(host_system{1}, 0), b(host_system{1}, 0);
    const auto wa = a.add("a.w", {2});
    (void)b.add("b.w", {3});
    CHECK(wa.belongs_to(a));
    CHECK_FALSE(wa.belongs_to(b));
    try {
        (void)b.value(wa); // index 0 of b is b.w: silently the wrong tensor without the check
        FAIL("b resolved a's handle");
    } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        CHECK(contains(e.what(), "the handle names a tensor of another parameter_registry"));
    }
}

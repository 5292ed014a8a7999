// The host's side of capturing a synchronous step into a CUDA graph (data_parallel::step while the
// stream is being captured, data_parallel::count_replay per launch): what is counted (the
// trainer's counters and the batch-norm layers' num_batches_tracked), what is refused (a capture
// without a plain step of its global batch before it, launches after a plain step of a new
// global batch) and what is left usable. The host has no graphs: a system whose capture state
// the test switches (its work still runs at once) checks the trainer's bookkeeping; the replay
// itself is tests/cuda/test_graph_capture.cu. SPDX-License-Identifier: Apache-2.0
#include "train_runner.hpp"

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using namespace lockstep;

namespace {

/// The calling replica thread's switch: true while its "stream" is being captured.
thread_local bool capture_switch = false;

/// The host system, except that detail::capturing() answers capture_switch.
struct switch_system : host_system {
    switch_system() = default;
    explicit switch_system(const host_system& h) : host_system(h) {}
    friend bool is_capturing(const switch_system&) { return capture_switch; }
};
static_assert(execution_system<switch_system>);

} // namespace

/// Reads on switch_system are host reads (the system's memory is host memory).
template <class T>
class lockstep::staged_read<T, switch_system> : public staged_read<T, host_system> {
public:
    staged_read(std::size_t n, const switch_system& sys) : staged_read<T, host_system>(n, sys) {}
};

namespace {

/// thread_communicator on switch_system.
class switch_communicator {
public:
    using system_type = switch_system;
    explicit switch_communicator(thread_communicator& inner) : inner_(&inner) {}
    switch_system system() const { return switch_system(inner_->system()); }
    int rank() const { return inner_->rank(); }
    int size() const { return inner_->size(); }
    template <class T>
    void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
        inner_->all_reduce(send, recv, op);
    }
    template <class T>
    void broadcast(std::span<T> data, int root) {
        inner_->broadcast(data, root);
    }
    template <class T>
    void all_gather(std::span<const T> send, std::span<T> recv) {
        inner_->all_gather(send, recv);
    }
    template <class T>
    void all_to_all(std::span<const T> send, std::span<T> recv) {
        inner_->all_to_all(send, recv);
    }
    template <class T>
    void reduce(std::span<const T> send, std::span<T> recv, reduce_op op, int root) {
        inner_->reduce(send, recv, op, root);
    }
    template <class T>
    void reduce_scatter(std::span<const T> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op) {
        inner_->reduce_scatter(send, recv, counts, op);
    }
    template <class T>
    void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
        inner_->reduce_scatter(send, recv, op);
    }
    void barrier() { inner_->barrier(); }
    switch_communicator split(int, int) {
        throw std::logic_error("switch_communicator::split is not used by these tests");
    }

private:
    thread_communicator* inner_;
};
static_assert(communicator<switch_communicator>);

/// y = w . x, squared error against the shared feature data, on the registry.
struct linear {
    using context_type = replica_context<double, switch_communicator>;
    context_type::handle w;
    explicit linear(context_type& ctx) {
        w = ctx.registry().add("w", {3});
        for (std::size_t i = 0; i < 3; ++i)
            w.value()[i] = 0.1 * static_cast<double>(i + 1);
    }
};

double train(linear& n, const shard_range& r, linear::context_type&) {
    double loss = 0;
    for (std::size_t i = r.begin; i < r.end; ++i) {
        const std::uint64_t s = r.sample_index(i);
        double y = 0;
        for (std::size_t k = 0; k < 3; ++k)
            y += n.w.value()[k] * lockstep_test::feature(s, k);
        const double e = y - lockstep_test::feature(s, 3);
        loss += 0.5 * e * e * r.scale;
        for (std::size_t k = 0; k < 3; ++k)
            n.w.grad()[k] += e * r.scale * lockstep_test::feature(s, k);
    }
    return loss;
}

using sgd = optim::sgd<double, switch_system>;
using trainer =
    data_parallel<linear, sgd, sync::synchronous, reduce::per_tensor, switch_communicator>;
using local_trainer =
    data_parallel<linear, sgd, sync::local_sgd<2>, reduce::per_tensor, switch_communicator>;

auto make = [](linear::context_type& ctx) { return linear(ctx); };
auto fn = [](linear& n, const shard_range& r, linear::context_type& ctx) {
    return train(n, r, ctx);
};

/// What one replica saw; checked on the main thread (Catch2 is not thread-safe).
struct observed {
    std::vector<std::int64_t> steps;
    std::vector<std::uint64_t> samples;
    std::vector<step_result> results;
    std::vector<std::string> errors;
    std::vector<int> codes;
    void error(const lockstep::error& e) {
        errors.emplace_back(e.what());
        codes.push_back(static_cast<int>(e.code()));
    }
    void position(const trainer& t) {
        steps.push_back(t.steps());
        samples.push_back(t.samples());
    }
};

} // namespace

TEST_CASE("a step recorded under capture is not counted; count_replay counts each launch",
          "[train][thread][capture]") {
    std::vector<observed> seen(2);
    thread_group(2).run([&](thread_communicator& inner) {
        switch_communicator comm(inner);
        observed& o = seen[static_cast<std::size_t>(comm.rank())];
        trainer dp(comm, make, {.lr = 0.1});
        o.results.push_back(dp.step(10, fn)); // a plain step first (the recommended warm-up)
        o.position(dp);
        capture_switch = true;
        o.results.push_back(dp.step(10, fn)); // recorded: read_result = true does not wait
        o.position(dp);
        try {
            (void)dp.read_result();
        } catch (const error& e) {
            o.error(e);
        }
        try {
            (void)dp.count_replay();
        } catch (const error& e) {
            o.error(e);
        }
        capture_switch = false;
        for (int k = 0; k < 3; ++k) {
            o.results.push_back(dp.count_replay());
            o.position(dp);
        }
        o.results.push_back(dp.read_result());
        o.results.push_back(dp.step(10, fn)); // plain steps go on after launches
        o.position(dp);
    });
    for (const observed& o : seen) {
        CHECK(o.steps == std::vector<std::int64_t>{1, 1, 2, 3, 4, 5});
        CHECK(o.samples == std::vector<std::uint64_t>{10, 10, 20, 30, 40, 50});
        REQUIRE(o.results.size() == 7);
        CHECK(o.results[0].ready);
        CHECK(!o.results[1].ready);
        CHECK(o.results[1].step == 1);
        // Launches are steps 1, 2, 3, read as each one's result (read_result = true).
        for (int k = 0; k < 3; ++k) {
            CHECK(o.results[2 + k].step == 1 + k);
            CHECK(o.results[2 + k].ready);
            CHECK(o.results[2 + k].lr == 0.1);
        }
        CHECK(o.results[5].step == 3);
        CHECK(o.results[5].ready);
        CHECK(o.results[6].step == 4);
        REQUIRE(o.errors.size() == 2);
        CHECK(o.codes[0] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.errors[0], Catch::Contains("data_parallel.read_result") &&
                                    Catch::Contains("being captured into a CUDA graph"));
        CHECK(o.codes[1] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.errors[1], Catch::Contains("data_parallel.count_replay") &&
                                    Catch::Contains("being captured into a CUDA graph"));
    }
}

TEST_CASE("count_replay refuses without a capture and when the schedule moved the rate, "
          "counting nothing",
          "[train][thread][capture]") {
    std::vector<observed> seen(2);
    thread_group(2).run([&](thread_communicator& inner) {
        switch_communicator comm(inner);
        observed& o = seen[static_cast<std::size_t>(comm.rank())];
        train_params tp;
        tp.lr = [](std::int64_t s) { return s < 3 ? 0.1 : 0.05; };
        trainer dp(comm, make, {.lr = 0.1}, tp);
        try {
            (void)dp.count_replay();
        } catch (const error& e) {
            o.error(e);
        }
        o.position(dp);
        (void)dp.step(10, fn);
        capture_switch = true;
        (void)dp.step(10, fn); // captured at step 1, rate 0.1
        capture_switch = false;
        (void)dp.count_replay(); // step 1
        (void)dp.count_replay(); // step 2
        o.position(dp);
        try {
            (void)dp.count_replay(); // step 3: the schedule gives 0.05
        } catch (const error& e) {
            o.error(e);
        }
        o.position(dp);
    });
    for (const observed& o : seen) {
        CHECK(o.steps == std::vector<std::int64_t>{0, 3, 3});
        CHECK(o.samples == std::vector<std::uint64_t>{0, 30, 30});
        REQUIRE(o.errors.size() == 2);
        CHECK(o.codes[0] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.errors[0], Catch::Contains("no step was captured"));
        CHECK(o.codes[1] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.errors[1], Catch::Contains("step 3: train_params::lr gives 0.05") &&
                                    Catch::Contains("the graph applies 0.1") &&
                                    Catch::Contains("captured at: capture the step again"));
    }
}

TEST_CASE("a capture with verify_every is refused before any work: count_replay's launches "
          "would never be checked",
          "[train][thread][capture]") {
    std::vector<observed> seen(2);
    thread_group(2).run([&](thread_communicator& inner) {
        switch_communicator comm(inner);
        observed& o = seen[static_cast<std::size_t>(comm.rank())];
        trainer dp(comm, make, {.lr = 0.1}, {.verify_every = 1});
        (void)dp.step(10, fn); // the plain step a capture needs: it checks the replicas
        o.position(dp);
        capture_switch = true;
        try {
            (void)dp.step(10, fn);
        } catch (const error& e) {
            o.error(e);
        }
        capture_switch = false;
        o.position(dp);
        // The communicator is still usable: the replicas train on, checked.
        (void)dp.step(10, fn);
        o.position(dp);
    });
    for (const observed& o : seen) {
        CHECK(o.steps == std::vector<std::int64_t>{1, 1, 2});
        CHECK(o.samples == std::vector<std::uint64_t>{10, 10, 20});
        REQUIRE(o.errors.size() == 1);
        CHECK(o.codes[0] == static_cast<int>(errc::unsupported));
        CHECK_THAT(o.errors[0], Catch::Contains("verify_every = 1"));
        CHECK_THAT(o.errors[0], Catch::Contains("count_replay"));
    }
}

TEST_CASE("a local SGD step under capture is refused before any work", "[train][thread][capture]") {
    std::vector<observed> seen(2);
    thread_group(2).run([&](thread_communicator& inner) {
        switch_communicator comm(inner);
        observed& o = seen[static_cast<std::size_t>(comm.rank())];
        local_trainer dp(comm, make, {.lr = 0.1});
        capture_switch = true;
        try {
            (void)dp.step(10, fn);
        } catch (const error& e) {
            o.error(e);
        }
        capture_switch = false;
        o.steps.push_back(dp.steps());
        // The communicator is still usable: the replicas train on.
        (void)dp.step(10, fn);
        o.steps.push_back(dp.steps());
    });
    for (const observed& o : seen) {
        CHECK(o.steps == std::vector<std::int64_t>{0, 1});
        REQUIRE(o.errors.size() == 1);
        CHECK(o.codes[0] == static_cast<int>(errc::unsupported));
        CHECK_THAT(o.errors[0], Catch::Contains("sync::local_sgd step cannot be captured"));
    }
}

namespace {

/// The train tests' network (fc -> batch norm -> ReLU -> dropout -> fc) on switch_system.
template <class BN>
using bn_net =
    lockstep_test::mlp<double, switch_communicator, lockstep_test::storage::registry, BN>;

/// A BN policy and the reduce policy it trains with.
template <class BN, class Reduce>
struct bn_case {
    using bn_policy = BN;
    using reduce_policy = Reduce;
};

/// What a run's batch-norm layer counted: after the warm-up, after the capture (when there is
/// one), then after every step or counted launch.
struct bn_counts {
    std::vector<std::int64_t> tracked;
    std::vector<std::int64_t> steps;
    std::vector<std::string> errors;
};

/// On 2 replicas with 2 micro-batches per step (the layer counts several forwards per step): a
/// plain warm-up step of `batch` samples, then `launches` plain steps, or one step captured and
/// `launches` launches counted by count_replay.
template <class Case>
std::vector<bn_counts> bn_run(bool capture, std::size_t batch, int launches) {
    using net = bn_net<typename Case::bn_policy>;
    using trainer_t = data_parallel<net, sgd, sync::synchronous, typename Case::reduce_policy,
                                    switch_communicator>;
    std::vector<bn_counts> out(2);
    thread_group(2).run([&](thread_communicator& inner) {
        switch_communicator comm(inner);
        bn_counts& o = out[static_cast<std::size_t>(comm.rank())];
        trainer_t dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05},
            {.micro_batches =
                 std::is_same_v<typename Case::reduce_policy, reduce::per_tensor> ? 2 : 1});
        const auto step_fn = [](net& n, const shard_range& r, auto& ctx) {
            return n.train(r, ctx);
        };
        const auto record = [&] {
            o.tracked.push_back(dp.network().batch_norm().num_batches_tracked());
            o.steps.push_back(dp.steps());
        };
        (void)dp.step(batch, step_fn);
        record();
        if (capture) {
            capture_switch = true;
            try {
                (void)dp.step(batch, step_fn);
            } catch (const error& e) {
                o.errors.emplace_back(e.what());
            }
            capture_switch = false;
            record();
        }
        for (int k = 0; k < launches; ++k) {
            if (capture)
                (void)dp.count_replay();
            else
                (void)dp.step(batch, step_fn);
            record();
        }
    });
    return out;
}

} // namespace

TEMPLATE_TEST_CASE("each counted launch of a captured step advances batch norm's "
                   "num_batches_tracked as a plain step does; the capture itself does not",
                   "[train][thread][capture][bn]", (bn_case<bn::global, reduce::per_tensor>),
                   (bn_case<bn::local, reduce::per_tensor>),
                   (bn_case<bn::ghost<4>, reduce::reproducible<4>>)) {
    // 2 micro-batches per step (per_tensor): 2 forwards a step; ghost: 10 samples = 3 chunks.
    constexpr std::size_t batch = 10;
    constexpr int launches = 10;
    const auto plain = bn_run<TestType>(false, batch, launches);
    const auto graph = bn_run<TestType>(true, batch, launches);
    for (std::size_t r = 0; r < 2; ++r) {
        INFO("replica " << r);
        CHECK(graph[r].errors.empty());
        REQUIRE(plain[r].tracked.size() == static_cast<std::size_t>(launches) + 1);
        REQUIRE(graph[r].tracked.size() == static_cast<std::size_t>(launches) + 2);
        const std::int64_t per_step = plain[r].tracked[0];
        CHECK(per_step == (std::is_same_v<typename TestType::bn_policy, bn::ghost<4>> ? 3 : 2));
        // The capture counts nothing: the warm-up's count.
        CHECK(graph[r].tracked[1] == per_step);
        CHECK(graph[r].steps[1] == 1);
        // Launch k counts as plain step k.
        for (int k = 0; k <= launches; ++k) {
            INFO("step " << k);
            const auto g = static_cast<std::size_t>(k == 0 ? 0 : k + 1);
            CHECK(graph[r].tracked[g] == plain[r].tracked[static_cast<std::size_t>(k)]);
            CHECK(graph[r].steps[g] == plain[r].steps[static_cast<std::size_t>(k)]);
            CHECK(plain[r].tracked[static_cast<std::size_t>(k)] == per_step * (k + 1));
        }
    }
}

TEST_CASE("a capture without a plain step of its global batch before it is refused before any "
          "work, naming the fix",
          "[train][thread][capture][bn]") {
    using net = bn_net<bn::global>;
    using trainer_t =
        data_parallel<net, sgd, sync::synchronous, reduce::per_tensor, switch_communicator>;
    std::vector<observed> seen(2);
    std::vector<std::vector<std::int64_t>> tracked(2);
    thread_group(2).run([&](thread_communicator& inner) {
        switch_communicator comm(inner);
        const auto me = static_cast<std::size_t>(comm.rank());
        observed& o = seen[me];
        trainer_t dp(comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.05});
        const auto step_fn = [](net& n, const shard_range& r, auto& ctx) {
            return n.train(r, ctx);
        };
        const auto attempt = [&](std::size_t batch) {
            capture_switch = true;
            try {
                (void)dp.step(batch, step_fn);
            } catch (const error& e) {
                o.error(e);
            }
            capture_switch = false;
            o.steps.push_back(dp.steps());
            tracked[me].push_back(dp.network().batch_norm().num_batches_tracked());
        };
        attempt(10);                // refused: no plain step yet
        (void)dp.step(10, step_fn); // the communicator is usable: the replicas train on
        attempt(12);                // refused: no plain step of 12 samples
        attempt(10);                // recorded
        (void)dp.count_replay();
        o.steps.push_back(dp.steps());
        tracked[me].push_back(dp.network().batch_norm().num_batches_tracked());
    });
    for (std::size_t r = 0; r < 2; ++r) {
        const observed& o = seen[r];
        INFO("replica " << r);
        CHECK(o.steps == std::vector<std::int64_t>{0, 1, 1, 2});
        CHECK(tracked[r] == std::vector<std::int64_t>{0, 1, 1, 2});
        REQUIRE(o.errors.size() == 2);
        CHECK(o.codes[0] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.errors[0],
                   Catch::Contains("replica " + std::to_string(r) + ": data_parallel.step") &&
                       Catch::Contains("being captured into a CUDA graph") &&
                       Catch::Contains("no plain step ran on this trainer before the capture") &&
                       Catch::Contains("run one plain step of global batch 10 before capturing"));
        CHECK(o.codes[1] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.errors[1],
                   Catch::Contains("no plain step of global batch 12 ran on this trainer") &&
                       Catch::Contains("the last plain step's global batch was 10") &&
                       Catch::Contains("run one plain step of global batch 12 before capturing"));
    }
}

TEST_CASE("count_replay refuses launches after a plain step of a new global batch, which may "
          "have reallocated what the graph uses",
          "[train][thread][capture]") {
    std::vector<observed> seen(2);
    thread_group(2).run([&](thread_communicator& inner) {
        switch_communicator comm(inner);
        observed& o = seen[static_cast<std::size_t>(comm.rank())];
        trainer dp(comm, make, {.lr = 0.1});
        (void)dp.step(10, fn);
        capture_switch = true;
        (void)dp.step(10, fn);
        capture_switch = false;
        (void)dp.count_replay();
        (void)dp.step(10, fn); // a global batch run before the capture: launches go on
        (void)dp.count_replay();
        o.position(dp);
        (void)dp.step(12, fn); // the first step of 12 samples
        try {
            (void)dp.count_replay();
        } catch (const error& e) {
            o.error(e);
        }
        o.position(dp);
        capture_switch = true;
        (void)dp.step(12, fn); // a new capture is counted again
        capture_switch = false;
        (void)dp.count_replay();
        o.position(dp);
    });
    for (const observed& o : seen) {
        CHECK(o.steps == std::vector<std::int64_t>{4, 5, 6});
        CHECK(o.samples == std::vector<std::uint64_t>{40, 52, 64});
        REQUIRE(o.errors.size() == 1);
        CHECK(o.codes[0] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(o.errors[0], Catch::Contains("data_parallel.count_replay") &&
                                    Catch::Contains("a plain step of global batch 12") &&
                                    Catch::Contains("capture the step again"));
    }
}

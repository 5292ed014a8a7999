// The synchronous trainer between reduction and update (gradient clipping by global norm, frozen
// tensors, the gradient hook) against a double-precision naive loop over the global batch; the
// agreement checks (optimizer, lr, global_batch, micro_batches) and the non-finite handling
// (NaN loss, BN running statistics of a skipped step, the message naming tensor and replica),
// also for local SGD.
// SPDX-License-Identifier: Apache-2.0
#include "checkpoint_support.hpp"
#include "support/replica_errors.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using namespace lockstep_test;

namespace {

/// y = w . x + b, squared error against 0.5 x5, on the shared feature data; w differs per
/// replica before the trainer's broadcast. `nan_loss` returns NaN (gradients stay finite).
struct linear {
    std::vector<double> w = std::vector<double>(5), dw = std::vector<double>(5);
    std::vector<double> b = std::vector<double>(1), db = std::vector<double>(1);
    bool nan_loss = false;
    explicit linear(int rank) {
        for (std::size_t i = 0; i < 5; ++i)
            w[i] = 0.1 * double(i + rank);
    }
    template <class F>
    void for_each_parameter(F&& f) {
        f("w", std::span<double>(w), std::span<double>(dw));
        f("b", std::span<double>(b), std::span<double>(db));
    }
    double train(const shard_range& r) {
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const auto g = r.sample_index(i);
            double y = b[0], target = 0.5 * feature(g, 5);
            for (std::size_t k = 0; k < 5; ++k)
                y += w[k] * feature(g, k);
            loss += (y - target) * (y - target) * r.scale;
            for (std::size_t k = 0; k < 5; ++k)
                dw[k] += 2 * (y - target) * r.scale * feature(g, k);
            db[0] += 2 * (y - target) * r.scale;
        }
        return nan_loss ? std::numeric_limits<double>::quiet_NaN() : loss;
    }
};

using sgd = optim::sgd<double>;
using trainer = data_parallel<linear, sgd, sync::synchronous, reduce::per_tensor>;
auto train_fn = [](linear& n, const shard_range& r, auto&) { return n.train(r); };

/// The gradient of the mean loss over samples [offset, offset + B) at w (6 values: w, b).
std::vector<double> reference_gradient(const std::vector<double>& w, std::uint64_t offset,
                                       std::size_t B) {
    std::vector<double> g(6, 0.0);
    for (std::size_t i = 0; i < B; ++i) {
        const std::uint64_t s = offset + i;
        double y = w[5];
        for (std::size_t k = 0; k < 5; ++k)
            y += w[k] * feature(s, k);
        const double e = y - 0.5 * feature(s, 5);
        for (std::size_t k = 0; k < 5; ++k)
            g[k] += 2 * e * feature(s, k) / double(B);
        g[5] += 2 * e / double(B);
    }
    return g;
}

/// Replica 0's initial weights (what the trainer broadcasts).
std::vector<double> initial_weights() {
    std::vector<double> w(6, 0.0);
    for (std::size_t k = 0; k < 5; ++k)
        w[k] = 0.1 * double(k);
    return w;
}

/// SGD with momentum mu (PyTorch's: the buffer starts as the first gradient), clipping by
/// global norm (max_norm > 0), `frozen_b` (b neither updated nor in the norm), and a gradient
/// transform applied before the norm: the naive double reference of every test here.
struct reference_run {
    double lr = 0.05, mu = 0.9, max_norm = 0;
    bool frozen_b = false;
    double hook_scale = 1.0;
    std::vector<double> run(const std::vector<std::size_t>& batches,
                            std::vector<std::vector<double>>* grads = nullptr) const {
        std::vector<double> w = initial_weights(), m(6, 0.0);
        std::uint64_t offset = 0;
        for (std::size_t s = 0; s < batches.size(); ++s) {
            std::vector<double> g = reference_gradient(w, offset, batches[s]);
            if (frozen_b)
                g[5] = 0;
            if (grads)
                grads->push_back(g);
            for (double& x : g)
                x *= hook_scale;
            if (max_norm > 0) {
                double n2 = 0;
                for (double x : g)
                    n2 += x * x;
                const double c = std::min(1.0, max_norm / (std::sqrt(n2) + 1e-6));
                for (double& x : g)
                    x *= c;
            }
            for (std::size_t k = 0; k < 6; ++k) {
                if (frozen_b && k == 5)
                    continue;
                m[k] = s == 0 ? g[k] : mu * m[k] + g[k];
                w[k] -= lr * m[k];
            }
            offset += batches[s];
        }
        return w;
    }
};

double max_abs_diff(std::span<const double> a, const std::vector<double>& b) {
    double d = 0;
    for (std::size_t i = 0; i < b.size(); ++i)
        d = std::max(d, std::abs(a[i] - b[i]));
    return d;
}

const std::vector<std::size_t> batches = {12, 7, 24, 5, 13, 9};

} // namespace

// Tolerance: the trainer sums the per-replica partial gradients in a different order than the
// naive loop; in double over <= 24 samples and 6 steps the difference stays below 1e-12.
constexpr double tol = 1e-12;

TEST_CASE("clipping by global norm equals the naive reference, on every replica alike",
          "[train][thread][hooks]") {
    for (double max_norm : {0.0, 0.05, 1e6}) {
        INFO("max_grad_norm " << max_norm);
        reference_run ref{.max_norm = max_norm};
        const std::vector<double> expect = ref.run(batches);
        std::vector<std::vector<double>> out(3);
        thread_group(3).run([&](thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); },
                       {.lr = 0.05, .momentum = 0.9}, {.max_grad_norm = max_norm});
            for (std::size_t B : batches)
                dp.step(B, train_fn);
            const auto p = dp.parameters();
            out[comm.rank()].assign(p.begin(), p.end());
        });
        for (int r = 0; r < 3; ++r) {
            CHECK(out[r] == out[0]);
            CHECK(max_abs_diff(out[r], expect) <= tol);
        }
    }
    // The clipped run differs from the unclipped one (the test can fail).
    CHECK(max_abs_diff(reference_run{.max_norm = 0.05}.run(batches), reference_run{}.run(batches)) >
          1e-3);
}

TEST_CASE("frozen tensors get no update and no optimizer state change", "[train][thread][hooks]") {
    const std::vector<double> expect =
        reference_run{.max_norm = 0.05, .frozen_b = true}.run(batches);
    std::vector<std::vector<double>> out(2), momentum(2);
    std::vector<std::vector<double>> adam_b(2), adam_m(2), adam_v(2);
    thread_group(2).run([&](thread_communicator& comm) {
        train_params tp{.max_grad_norm = 0.05,
                        .frozen = [](const tensor_info& t) { return t.name == "b"; }};
        trainer dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05, .momentum = 0.9}, tp);
        for (std::size_t B : batches)
            dp.step(B, train_fn);
        const auto p = dp.parameters();
        out[comm.rank()].assign(p.begin(), p.end());
        const auto st = dp.optimizer().state();
        momentum[comm.rank()].assign(st.slots[0].data.begin(), st.slots[0].data.end());

        // Adam: the frozen tensor's moments stay zero and its value stays replica 0's.
        data_parallel<linear, optim::adam<double>, sync::synchronous, reduce::bucketed<>> da(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.01}, tp);
        for (std::size_t B : batches)
            da.step(B, train_fn);
        const auto ast = da.optimizer().state();
        adam_b[comm.rank()] = {da.parameters()[5]};
        adam_m[comm.rank()].assign(ast.slots[0].data.begin(), ast.slots[0].data.end());
        adam_v[comm.rank()].assign(ast.slots[1].data.begin(), ast.slots[1].data.end());
    });
    for (int r = 0; r < 2; ++r) {
        CHECK(max_abs_diff(out[r], expect) <= tol);
        CHECK(out[r][5] == 0.0);      // b: replica 0's initial value, never updated
        CHECK(momentum[r][5] == 0.0); // its momentum never written
        CHECK(momentum[r][0] != 0.0);
        CHECK(adam_b[r][0] == 0.0);
        CHECK(adam_m[r][5] == 0.0);
        CHECK(adam_v[r][5] == 0.0);
        CHECK(adam_m[r][0] != 0.0);
    }
}

TEST_CASE("the gradient hook sees the reduced gradient with the layout and may change it",
          "[train][thread][hooks]") {
    std::vector<std::vector<double>> ref_grads;
    const std::vector<double> expect =
        reference_run{.max_norm = 0.05, .hook_scale = 0.5}.run(batches, &ref_grads);
    std::vector<std::vector<std::vector<double>>> seen(3);
    std::vector<std::vector<std::string>> names(3);
    std::vector<std::vector<double>> out(3);
    thread_group(3).run([&](thread_communicator& comm) {
        trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); },
                   {.lr = 0.05, .momentum = 0.9}, {.max_grad_norm = 0.05});
        const int me = comm.rank();
        dp.set_gradient_hook([&, me](std::span<double> g, std::span<const tensor_info> layout) {
            seen[me].emplace_back(g.begin(), g.end());
            if (names[me].empty())
                for (const tensor_info& t : layout)
                    names[me].push_back(t.name);
            for (double& x : g)
                x *= 0.5;
        });
        for (std::size_t B : batches)
            dp.step(B, train_fn);
        const auto p = dp.parameters();
        out[me].assign(p.begin(), p.end());
    });
    for (int r = 0; r < 3; ++r) {
        REQUIRE(seen[r].size() == batches.size());
        CHECK(seen[r] == seen[0]); // identical on every replica
        CHECK(names[r] == std::vector<std::string>{"w", "b"});
        for (std::size_t s = 0; s < batches.size(); ++s)
            CHECK(max_abs_diff(seen[r][s], ref_grads[s]) <= tol);
        CHECK(max_abs_diff(out[r], expect) <= tol);
    }
}

namespace {

/// 4 steps of 10 samples by a Trainer on 3 thread replicas, before(rank, dp, step) ahead of
/// each; checks on the main thread that every replica skipped step 2 alone, that step 2 left
/// the parameters as they were and step 3 moved them, and that the replicas agree throughout.
template <class Trainer, class Before>
void check_only_step_2_skipped(Before before) {
    std::vector<std::vector<bool>> skipped(3);
    std::vector<std::vector<std::vector<double>>> params(3);
    thread_group(3).run([&](thread_communicator& comm) {
        Trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
        for (int s = 0; s < 4; ++s) {
            before(comm.rank(), dp, s);
            skipped[comm.rank()].push_back(dp.step(10, train_fn).skipped);
            const auto p = dp.parameters();
            params[comm.rank()].emplace_back(p.begin(), p.end());
        }
    });
    for (int r = 0; r < 3; ++r) {
        CHECK(skipped[r] == std::vector<bool>{false, false, true, false});
        CHECK(params[r][2] == params[r][1]);
        CHECK(params[r][3] != params[r][2]);
        CHECK(params[r] == params[0]);
    }
}
} // namespace

TEST_CASE("replicas that disagree on settings fail on every replica naming both values",
          "[train][thread][agreement]") {
    SECTION("another optimizer type on one replica") {
        const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
            auto make = [](auto& ctx) { return linear(ctx.rank()); };
            if (rank == 2)
                data_parallel<linear, optim::adam<double>, sync::synchronous, reduce::per_tensor>
                    dp(comm, make, {.lr = 0.05});
            else
                trainer dp(comm, make, {.lr = 0.05});
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("optimizer: lockstep::optim::sgd<double"));
            CHECK_THAT(msg, Catch::Contains("on replica 0, lockstep::optim::detail::adam_impl<"));
            CHECK_THAT(msg, Catch::Contains("on replica 2;"));
        }
    }
    SECTION("another learning rate or momentum on one replica") {
        const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); },
                       {.lr = rank == 1 ? 0.2 : 0.1, .momentum = rank == 2 ? 0.5 : 0.9});
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("lr: 0.1 on replica 0, 0.2 on replica 1;"));
            CHECK_THAT(msg, Catch::Contains("momentum: 0.9 on replica 0, 0.5 on replica 2;"));
        }
    }
    SECTION("asynchronous: another staleness bound or bn_momentum on one replica") {
        using async_t = data_parallel<linear, sgd, sync::asynchronous, reduce::per_tensor>;
        using stale_t = data_parallel<linear, sgd, sync::bounded_staleness<1>, reduce::per_tensor>;
        const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
            auto make = [](auto& ctx) { return linear(ctx.rank()); };
            if (rank == 1)
                stale_t dp(comm, make, {.lr = 0.1});
            else
                async_t dp(comm, make, {.lr = 0.1}, {}, {.bn_momentum = rank == 2 ? 0.2 : 0.1});
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("sync: sync::asynchronous on replica 0, "
                                            "sync::bounded_staleness<1> on replica 1;"));
            CHECK_THAT(msg, Catch::Contains(
                                "async_params.bn_momentum: 0.1 on replica 0, 0.2 on replica 2;"));
        }
    }
    SECTION("different micro_batches") {
        const auto e = errors_of(2, [](int rank, thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                       {.micro_batches = rank == 0 ? 2 : 1});
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("micro_batches: 2 on replica 0, 1 on replica 1;"));
        }
    }
    SECTION("read_result off on one replica, also where shrink refuses it") {
        // A replica that reads a step's error throws while one that does not goes on; with
        // shrink, the refusal of read_result = false came from that replica only.
        for (const auto failure : {replica_failure::stop, replica_failure::shrink}) {
            const auto e = errors_of(3, [failure](int rank, thread_communicator& comm) {
                train_params tp;
                tp.read_result = rank != 2;
                tp.on_replica_failure = failure;
                trainer dp(
                    comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1}, tp);
            });
            for (const auto& [msg, code] : e) {
                INFO(msg);
                CHECK(code == static_cast<int>(errc::invalid_argument));
                CHECK_THAT(msg, Catch::Contains("read_result: true on replica 0, false on "
                                                "replica 2;"));
            }
        }
    }
    SECTION("loss scaling on one replica only, or with another growth_interval") {
        const auto off = errors_of(2, [](int rank, thread_communicator& comm) {
            train_params tp;
            if (rank == 1)
                tp.loss_scale = loss_scaling{.init_scale = 1024};
            trainer dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1}, tp);
        });
        for (const auto& [msg, code] : off) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("loss_scale: off on replica 0, init_scale=1024 "
                                            "growth_factor=2 backoff_factor=0.5 "
                                            "growth_interval=2000 min_scale=1 on replica 1;"));
        }
        const auto interval = errors_of(2, [](int rank, thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                       {.loss_scale = loss_scaling{.growth_interval = rank == 0 ? 2000 : 7}});
        });
        for (const auto& [msg, code] : interval) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("loss_scale: init_scale=65536 growth_factor=2 "
                                            "backoff_factor=0.5 growth_interval=2000 min_scale=1 "
                                            "on replica 0, init_scale=65536 growth_factor=2 "
                                            "backoff_factor=0.5 growth_interval=7 min_scale=1 on "
                                            "replica 1;"));
        }
    }
    SECTION("global_batch 24 on two replicas, 23 on the third: the step is skipped") {
        std::vector<std::vector<double>> before(3), after(3);
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            dp.step(12, train_fn); // agreeing: fine
            auto p = dp.parameters();
            before[rank].assign(p.begin(), p.end());
            try {
                dp.step(rank == 2 ? 23 : 24, train_fn);
            } catch (...) {
                p = dp.parameters();
                after[rank].assign(p.begin(), p.end());
                throw;
            }
        });
        for (int r = 0; r < 3; ++r) {
            INFO(e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first, Catch::Contains("step 1 skipped"));
            CHECK_THAT(e[r].first,
                       Catch::Contains("global_batch: 24 on replica 0, 23 on replica 2;"));
            CHECK(after[r] == before[r]); // nothing applied
        }
    }
    SECTION("after a step skipped for different global_batch, training goes on from the same "
            "samples on every replica") {
        // Each replica had advanced samples() by its own global_batch: replica 2 then trained
        // on samples shifted by one, silently. The skipped step now consumes no samples.
        const auto run = [](bool mistake) {
            std::vector<std::vector<double>> params(3);
            std::vector<std::uint64_t> samples(3);
            thread_group(3).run([&](thread_communicator& comm) {
                trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
                dp.step(12, train_fn);
                if (mistake) {
                    try {
                        dp.step(comm.rank() == 2 ? 23 : 24, train_fn);
                    } catch (const error&) { // invalid_argument on every replica
                    }
                }
                dp.step(24, train_fn);
                dp.step(24, train_fn);
                const auto p = dp.parameters();
                params[static_cast<std::size_t>(comm.rank())].assign(p.begin(), p.end());
                samples[static_cast<std::size_t>(comm.rank())] = dp.samples();
            });
            return std::pair(params, samples);
        };
        const auto [clean, clean_samples] = run(false);
        const auto [after, after_samples] = run(true);
        CHECK(clean_samples == std::vector<std::uint64_t>{60, 60, 60});
        CHECK(after_samples == clean_samples);
        for (std::size_t r = 0; r < 3; ++r)
            CHECK(after[r] == clean[0]); // bitwise: the same samples, the same updates
    }
    SECTION("with read_result = false, a step on samples that drifted apart is refused") {
        // The skipped step is not read before the next one, which each replica starts from its
        // own samples(): refused, naming both first samples; the read puts every replica back
        // at replica 0's, so the steps after it agree again.
        std::vector<std::uint64_t> samples(3);
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                       {.read_result = false});
            dp.step(12, train_fn);
            dp.step(rank == 2 ? 23 : 24, train_fn);
            dp.step(24, train_fn);
            try {
                (void)dp.read_result();
            } catch (const error&) {
                dp.step(24, train_fn);
                (void)dp.read_result(); // agrees again
                samples[static_cast<std::size_t>(rank)] = dp.samples();
                throw;
            }
        });
        for (int r = 0; r < 3; ++r) {
            INFO(e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first, Catch::Contains("step 2 skipped") &&
                                       Catch::Contains("first sample: 36 on replica 0, 35 on "
                                                       "replica 2"));
        }
        CHECK(samples == std::vector<std::uint64_t>{60, 60, 60});
    }
    SECTION("steps skipped for a disagreement do not count toward max_consecutive_skips") {
        // With read_result = false, 25 steps after an unread disagreement all start at drifted
        // samples and are skipped; counted as a runaway they stopped training for good at the
        // read. They are thrown as the disagreement, and training goes on after the read.
        std::vector<std::int64_t> applied(3, -1);
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                       {.max_consecutive_skips = 20, .read_result = false});
            dp.step(rank == 2 ? 23 : 24, train_fn);
            for (int s = 0; s < 25; ++s)
                dp.step(24, train_fn);
            try {
                (void)dp.read_result();
            } catch (const error&) {
                dp.step(24, train_fn);
                const step_result r = dp.read_result(); // no runaway: it applies
                applied[static_cast<std::size_t>(rank)] = r.skipped ? 0 : 1;
                throw;
            }
        });
        for (int r = 0; r < 3; ++r) {
            INFO(e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first,
                       Catch::Contains("step 25 skipped") && Catch::Contains("first sample: "));
        }
        CHECK(applied == std::vector<std::int64_t>{1, 1, 1});
    }
    SECTION("a loss scale restored on one replica only") {
        // Each replica scaled its gradients by its own scale and divided the sum by it again:
        // the replicas' weights parted silently.
        const auto e = errors_of(2, [](int rank, thread_communicator& comm) {
            train_params tp;
            tp.loss_scale = loss_scaling{.init_scale = 65536};
            trainer dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1}, tp);
            dp.step(12, train_fn);
            if (rank == 1)
                dp.scaler().restore({.scale = 1024, .growth_tracker = 0});
            dp.step(12, train_fn);
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("step 1 skipped") &&
                                Catch::Contains("loss scale: 65536 (growth tracker 1) on replica "
                                                "0, 1024 (growth tracker 0) on replica 1"));
        }
    }
    SECTION("a learning-rate schedule that differs on one replica at step 2") {
        const auto e = errors_of(2, [](int rank, thread_communicator& comm) {
            train_params tp;
            tp.lr = [rank](std::int64_t s) { return s == 2 && rank == 1 ? 0.07 : 0.05; };
            trainer dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1}, tp);
            for (int s = 0; s < 4; ++s)
                dp.step(10, train_fn);
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("step 2 skipped"));
            CHECK_THAT(msg, Catch::Contains("lr: 0.05 on replica 0, 0.07 on replica 1;"));
        }
    }
}

TEST_CASE("a scheduled learning rate that is not finite or negative is refused before the step "
          "changes anything",
          "[train][thread][agreement]") {
    // Step 2's rate is inf, NaN or negative on every replica (one schedule); with loss scaling
    // growing every step, a check after the step's own work would leave the scale grown and
    // the weights or counters moved.
    for (const double bad : {std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN(), -0.25}) {
        INFO("rate " << bad);
        std::vector<loss_scaler_state> scale_before(3), scale_after(3);
        std::vector<std::vector<double>> before(3), after(3);
        std::vector<std::int64_t> steps_after(3);
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            train_params tp;
            tp.lr = [bad](std::int64_t s) { return s == 2 ? bad : 0.05; };
            tp.loss_scale = loss_scaling{.init_scale = 8, .growth_interval = 1};
            trainer dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1}, tp);
            const auto me = static_cast<std::size_t>(rank);
            dp.step(10, train_fn);
            dp.step(10, train_fn);
            scale_before[me] = dp.scaler().state();
            auto p = dp.parameters();
            before[me].assign(p.begin(), p.end());
            try {
                dp.step(10, train_fn);
            } catch (...) {
                scale_after[me] = dp.scaler().state();
                p = dp.parameters();
                after[me].assign(p.begin(), p.end());
                steps_after[me] = dp.steps();
                throw;
            }
        });
        for (std::size_t r = 0; r < 3; ++r) {
            INFO(e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first, Catch::Contains("replica " + std::to_string(r) + ":"));
            CHECK_THAT(e[r].first, Catch::Contains("the learning rate of step 2 is "));
            CHECK(scale_before[r].scale == 32); // grown after steps 0 and 1
            CHECK(scale_after[r] == scale_before[r]);
            CHECK(after[r] == before[r]);
            CHECK(steps_after[r] == 2);
        }
    }
}

TEST_CASE("the asynchronous trainer refuses a bad scheduled learning rate before any work",
          "[train][thread][agreement][async]") {
    // Version 3 of 5 has a NaN rate: the server would meet it after applying three gradients,
    // on the server only; every replica refuses it first, with nothing changed.
    using async_t = data_parallel<linear, sgd, sync::asynchronous, reduce::per_tensor>;
    std::vector<std::vector<double>> before(3), after(3);
    std::vector<std::int64_t> steps_after(3);
    const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
        train_params tp;
        tp.lr = [](std::int64_t s) {
            return s == 3 ? std::numeric_limits<double>::quiet_NaN() : 0.05;
        };
        async_t dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1}, tp);
        const auto me = static_cast<std::size_t>(rank);
        auto p = dp.parameters();
        before[me].assign(p.begin(), p.end());
        try {
            dp.train(5, 10, train_fn);
        } catch (...) {
            p = dp.parameters();
            after[me].assign(p.begin(), p.end());
            steps_after[me] = dp.steps();
            throw;
        }
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO(e[r].first);
        CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(e[r].first, Catch::Contains("replica " + std::to_string(r) + ":"));
        CHECK_THAT(e[r].first, Catch::Contains("async_trainer.train"));
        CHECK_THAT(e[r].first, Catch::Contains("the learning rate of step 3 is "));
        CHECK(after[r] == before[r]);
        CHECK(steps_after[r] == 0);
    }
}

TEST_CASE("a schedule's error names the replica that met it", "[train][thread][agreement]") {
    // optim's schedules know no replica (they throw with replica -1): the trainer names it.
    using async_t = data_parallel<linear, sgd, sync::asynchronous, reduce::per_tensor>;
    for (const bool async : {false, true}) {
        INFO((async ? "asynchronous" : "synchronous"));
        const auto e = errors_of(3, [async](int, thread_communicator& comm) {
            train_params tp;
            tp.lr = optim::cosine{.base_lr = 0.1, .total_steps = 4, .warmup_steps = 4};
            const auto make = [](auto& ctx) { return linear(ctx.rank()); };
            if (async)
                async_t(comm, make, {.lr = 0.1}, tp).train(2, 10, train_fn);
            else
                trainer(comm, make, {.lr = 0.1}, tp).step(10, train_fn);
        });
        for (std::size_t r = 0; r < 3; ++r) {
            INFO(e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first, Catch::Contains("replica " + std::to_string(r) +
                                                   ": cosine: need 0 <= warmup_steps < total_steps "
                                                   "(warmup_steps = 4, total_steps = 4)"));
        }
    }
}

TEST_CASE("the asynchronous trainer skips a non-finite loss with finite gradients",
          "[train][thread][non_finite][async]") {
    // Work item 2's loss is NaN, its gradient finite, whichever worker computes it: skipped
    // (and left out of the server's mean_loss) like a non-finite gradient, or errc::non_finite
    // on the server with skip_non_finite = false.
    using async_t = data_parallel<linear, sgd, sync::asynchronous, reduce::per_tensor>;
    const auto nan_at_2 = [](linear& n, const shard_range& r, auto&) {
        const double loss = n.train(r);
        return r.sample_offset == std::uint64_t{2} * 10 ? std::numeric_limits<double>::quiet_NaN()
                                                        : loss;
    };
    std::vector<std::uint64_t> skipped(3);
    std::vector<double> mean_loss(3);
    std::vector<std::vector<double>> params(3);
    thread_group(3, {.timeout = std::chrono::seconds(30)}).run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        async_t dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05});
        const async_result res = dp.train(6, 10, nan_at_2);
        skipped[me] = res.skipped;
        mean_loss[me] = res.mean_loss;
        const auto p = dp.parameters();
        params[me].assign(p.begin(), p.end());
    });
    CHECK(skipped[0] == 1);
    CHECK(std::isfinite(mean_loss[0]));
    for (std::size_t r = 0; r < 3; ++r) {
        for (const double x : params[r])
            CHECK(std::isfinite(x));
        CHECK(params[r] == params[0]);
    }

    const auto e = errors_of(3, [&](int, thread_communicator& comm) {
        async_t dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05},
                   {.skip_non_finite = false});
        dp.train(6, 10, nan_at_2);
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO(e[r].first);
        if (r != 0) {
            CHECK(e[r].second == static_cast<int>(errc::peer_failure));
            continue;
        }
        CHECK(e[r].second == static_cast<int>(errc::non_finite));
        CHECK_THAT(e[r].first,
                   Catch::Contains("replica 0: data_parallel.train: the loss of worker "));
        CHECK_THAT(e[r].first, Catch::Contains(" for work item 2 is not finite (nan)"));
    }
}

TEST_CASE("a NaN loss with finite gradients skips the step on every replica",
          "[train][thread][non_finite]") {
    check_only_step_2_skipped<trainer>(
        [](int rank, trainer& dp, int s) { dp.network().nan_loss = s == 2 && rank == 1; });
    const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
        trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                   {.skip_non_finite = false});
        dp.network().nan_loss = rank == 1;
        dp.step(10, train_fn);
    });
    for (const auto& [msg, code] : e) {
        INFO(msg);
        CHECK(code == static_cast<int>(errc::non_finite));
        CHECK_THAT(msg, Catch::Contains("the loss is not finite on replica 1;"));
        CHECK_THAT(msg, !Catch::Contains("replica 0;") && !Catch::Contains("replica 2;"));
    }
}

TEST_CASE("parameter_server: a NaN only Root's reduced gradient holds skips every replica",
          "[train][thread][non_finite]") {
    // The gradient hook runs where the reduced gradient lies: on Root alone. A NaN it writes is
    // in no replica's own gradient, so only Root's check sees it; the others must still skip
    // (their BN statistics, loss scale and results follow the decision) and, with
    // skip_non_finite = false, throw errc::non_finite themselves rather than run on.
    using ps = data_parallel<linear, sgd, sync::synchronous, reduce::parameter_server<1>>;
    check_only_step_2_skipped<ps>([](int, ps& dp, int s) {
        if (s == 0) // the hook runs in the middle of step dp.steps()
            dp.set_gradient_hook([&dp](std::span<double> g, std::span<const tensor_info>) {
                if (dp.steps() == 2)
                    g[3] = std::numeric_limits<double>::quiet_NaN();
            });
    });
    const auto e = errors_of(3, [](int, thread_communicator& comm) {
        ps dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
              {.skip_non_finite = false});
        dp.set_gradient_hook([](std::span<double> g, std::span<const tensor_info>) {
            g[3] = std::numeric_limits<double>::infinity();
        });
        dp.step(10, train_fn);
    });
    for (const auto& [msg, code] : e) {
        INFO(msg);
        CHECK(code == static_cast<int>(errc::non_finite));
        CHECK_THAT(msg, Catch::Contains("step 0:"));
    }
}

TEST_CASE("one NaN gradient element on one replica: the message names the tensor, the replica "
          "and count 1",
          "[train][thread][non_finite]") {
    using net = mlp<float, thread_communicator, storage::registry>;
    const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>> dp(comm, [](auto& ctx) { return net(ctx); },
                                                 {.lr = 0.1}, {.skip_non_finite = false});
        dp.network().poison = rank == 1;
        dp.step(12, [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
    });
    for (const auto& [msg, code] : e) {
        INFO(msg);
        CHECK(code == static_cast<int>(errc::non_finite));
        CHECK_THAT(msg, Catch::Contains(" 1 non-finite gradient element(s) on replica 1, the "
                                        "first in 'fc2.weight' (element 0);"));
        CHECK_THAT(msg, !Catch::Contains("on replica 0") && !Catch::Contains("on replica 2"));
    }
}

namespace {
using bn_ctx = replica_context<float, thread_communicator>;
/// x -> bn::global batch norm (gamma, beta in the registry) -> loss = sum(y * t) * scale.
/// `nan_input` puts a NaN into this replica's input.
struct bn_net {
    using bn_policies = std::tuple<bn::global>;
    using bn_type = nn::batch_norm<float, bn::global, nn::nc>;
    static constexpr std::size_t channels = 3;
    explicit bn_net(bn_ctx& ctx) {
        auto& reg = ctx.registry();
        gamma = reg.add("bn.weight", {channels});
        beta = reg.add("bn.bias", {channels});
        reg.finalize();
        bn.emplace(
            ctx.comm(), channels,
            bn_type::parameter_spans{gamma.value(), beta.value(), gamma.grad(), beta.grad()});
    }
    double train(const shard_range& r, bn_ctx& ctx) {
        const std::size_t n = r.size();
        std::vector<float> x(n * channels), y(x.size()), t(x.size()), dy(x.size()), dx(x.size());
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t c = 0; c < channels; ++c) {
                x[s * channels + c] = float(feature(r.sample_index(r.begin + s), c));
                t[s * channels + c] = float(feature(r.sample_index(r.begin + s), c + 3));
            }
        if (nan_input && n > 0)
            x[0] = std::numeric_limits<float>::quiet_NaN();
        const nn::tensor_shape shape{n, channels};
        bn->forward_train(ctx, std::span<const float>(x), shape, std::span<float>(y));
        double loss = 0;
        for (std::size_t i = 0; i < y.size(); ++i) {
            loss += double(y[i] * t[i]) * r.scale;
            dy[i] = float(t[i] * r.scale);
        }
        bn->backward(ctx, std::span<const float>(dy), std::span<float>(dx));
        return loss;
    }
    bn_ctx::handle gamma, beta;
    std::optional<bn_type> bn;
    bool nan_input = false;
};

std::vector<float> running_of(bn_net& n) {
    std::vector<float> out(n.bn->running_mean().begin(), n.bn->running_mean().end());
    out.insert(out.end(), n.bn->running_var().begin(), n.bn->running_var().end());
    return out;
}
} // namespace

TEST_CASE("a NaN input under bn::global leaves every replica's running statistics unchanged",
          "[train][thread][non_finite][bn]") {
    for (int micro : {1, 2}) {
        INFO("micro_batches " << micro);
        std::vector<std::vector<std::vector<float>>> running(3);
        std::vector<std::vector<bool>> skipped(3);
        thread_group(3).run([&](thread_communicator& comm) {
            data_parallel<bn_net, optim::sgd<float>> dp(comm, [](auto& ctx) { return bn_net(ctx); },
                                                        {.lr = 0.1}, {.micro_batches = micro});
            for (int s = 0; s < 4; ++s) {
                dp.network().nan_input = s == 2 && comm.rank() == 1;
                skipped[comm.rank()].push_back(
                    dp.step(12, [](bn_net& n, const shard_range& r, auto& ctx) {
                          return n.train(r, ctx);
                      }).skipped);
                running[comm.rank()].push_back(running_of(dp.network()));
            }
        });
        for (int r = 0; r < 3; ++r) {
            CHECK(skipped[r] == std::vector<bool>{false, false, true, false});
            CHECK(running[r][2] == running[r][1]); // restored, bit for bit
            CHECK(running[r][1] != running[r][0]);
            CHECK(running[r][3] != running[r][2]); // updated again after the skipped step
            for (float v : running[r][3])
                CHECK(std::isfinite(v));
            CHECK(running[r] == running[0]);
        }
    }
}

TEST_CASE("local SGD: clipping by each replica's own gradient norm equals the naive reference",
          "[train][thread][hooks][local_sgd]") {
    // Reference: each replica r takes its shard of every global batch, its own mean gradient,
    // clips it by its own norm and steps alone (plain SGD); the weights are averaged every 2
    // steps and at the end.
    const int R = 2;
    const double lr = 0.05, max_norm = 0.05;
    std::vector<std::vector<double>> w(R, initial_weights());
    std::uint64_t offset = 0;
    for (std::size_t s = 0; s < batches.size(); ++s) {
        for (int r = 0; r < R; ++r) {
            const shard_range sh = shard(0, batches[s], r, R);
            std::vector<double> g(6, 0.0);
            for (std::size_t i = sh.begin; i < sh.end; ++i) {
                const std::uint64_t smp = offset + i;
                double y = w[r][5];
                for (std::size_t k = 0; k < 5; ++k)
                    y += w[r][k] * feature(smp, k);
                const double e = y - 0.5 * feature(smp, 5);
                for (std::size_t k = 0; k < 5; ++k)
                    g[k] += 2 * e * feature(smp, k) / double(sh.size());
                g[5] += 2 * e / double(sh.size());
            }
            double n2 = 0;
            for (double x : g)
                n2 += x * x;
            const double c = std::min(1.0, max_norm / (std::sqrt(n2) + 1e-6));
            for (std::size_t k = 0; k < 6; ++k)
                w[r][k] -= lr * c * g[k];
        }
        offset += batches[s];
        if ((s + 1) % 2 == 0 || s + 1 == batches.size())
            for (std::size_t k = 0; k < 6; ++k) {
                const double m = (w[0][k] + w[1][k]) / 2;
                w[0][k] = w[1][k] = m;
            }
    }
    std::vector<std::vector<double>> out(R);
    thread_group(R).run([&](thread_communicator& comm) {
        data_parallel<linear, sgd, sync::local_sgd<2>, reduce::per_tensor> dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = lr},
            {.max_grad_norm = max_norm});
        for (std::size_t B : batches)
            dp.step(B, train_fn);
        dp.finish();
        const auto p = dp.parameters();
        out[comm.rank()].assign(p.begin(), p.end());
    });
    for (int r = 0; r < R; ++r)
        CHECK(max_abs_diff(out[r], w[0]) <= tol);
}

TEST_CASE("local SGD: a global_batch that differs on one replica fails at the next average",
          "[train][thread][agreement][local_sgd]") {
    const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
        data_parallel<linear, sgd, sync::local_sgd<2>, reduce::per_tensor> dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
        for (int s = 0; s < 4; ++s)
            dp.step(s == 3 && rank == 1 ? 23 : 24, train_fn);
    });
    for (const auto& [msg, code] : e) {
        INFO(msg);
        CHECK(code == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(msg, Catch::Contains("step 3: global_batch: 24 on replica 0, 23 on replica 1;"));
    }
}

TEST_CASE("a load forgets the unread step taken before it", "[train][thread][checkpoint]") {
    // With read_result = false the step before a load was not read: its read after the load
    // threw a result of the replaced state and, for a step the replicas disagreed on, took
    // samples() back to that step's first sample.
    // In a directory of its own, removed with the save's shard files beside the marker.
    const temp_dir dir("forget_unread");
    const auto path = dir.path / "ckpt";
    std::vector<std::string> read_after(3);
    std::vector<std::uint64_t> samples(3);
    thread_group(3).run([&](thread_communicator& comm) {
        const auto rank = static_cast<std::size_t>(comm.rank());
        trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                   {.read_result = false});
        dp.step(24, train_fn);
        save_checkpoint(dp, path); // at 24 samples
        dp.step(24, train_fn);
        dp.step(comm.rank() == 2 ? 23 : 24, train_fn); // disagreed at sample 48, not read
        load_checkpoint(dp, path);
        try {
            (void)dp.read_result();
        } catch (const error& e) {
            read_after[rank] = e.what();
        }
        dp.step(24, train_fn);
        (void)dp.read_result(); // agrees
        samples[rank] = dp.samples();
    });
    for (const std::string& msg : read_after)
        CHECK_THAT(msg, Catch::Contains("data_parallel.read_result: no step was taken yet"));
    CHECK(samples == std::vector<std::uint64_t>{48, 48, 48});
}

TEST_CASE("local SGD: save_checkpoint checks the steps since the last average before writing",
          "[train][thread][agreement][local_sgd][checkpoint]") {
    // A save between averages would drop what the next average checks: the resumed run would
    // keep replica 1's shifted samples for good. The save itself compares them.
    const temp_dir dir("local_sgd_save");
    const auto path = dir.path / "ckpt";
    SECTION("another global_batch") {
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            data_parallel<linear, sgd, sync::local_sgd<4>, reduce::per_tensor> dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            for (int s = 0; s < 2; ++s)
                dp.step(s == 1 && rank == 1 ? 13 : 12, train_fn);
            save_checkpoint(dp, path);
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("save_checkpoint: the replicas disagree"));
            CHECK_THAT(msg,
                       Catch::Contains("step 1: global_batch: 12 on replica 0, 13 on replica 1;"));
        }
    }
    SECTION("another learning rate") {
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            data_parallel<linear, sgd, sync::local_sgd<4>, reduce::per_tensor> dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            dp.step(12, train_fn);
            if (rank == 2)
                dp.optimizer().set_lr(0.5);
            dp.step(12, train_fn);
            save_checkpoint(dp, path);
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("step 1: lr: 0.1 on replica 0, 0.5 on replica 2;"));
        }
    }
    SECTION("a replica that does not save") {
        // Replica 0 saves after 2 steps; the others step on to their average at step 4, whose
        // check meets the save's: named as such, not as a step count to fix.
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            data_parallel<linear, sgd, sync::local_sgd<4>, reduce::per_tensor> dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            for (int s = 0; s < (rank == 0 ? 2 : 4); ++s)
                dp.step(12, train_fn);
            if (rank == 0)
                save_checkpoint(dp, path);
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::shape_mismatch));
            CHECK_THAT(msg, Catch::Contains("'save_checkpoint'"));
            CHECK_THAT(msg, Catch::Contains("'data_parallel.average'"));
        }
    }
    SECTION("another step count") {
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            data_parallel<linear, sgd, sync::local_sgd<4>, reduce::per_tensor> dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            for (int s = 0; s < (rank == 2 ? 3 : 2); ++s)
                dp.step(12, train_fn);
            save_checkpoint(dp, path);
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::count_mismatch));
            CHECK_THAT(msg, Catch::Contains("2 on replica 0 (2 since the last check), 3 on "
                                            "replica 2 (3)"));
        }
    }
    CHECK_FALSE(std::filesystem::exists(path)); // nothing committed
}

TEST_CASE("local SGD with a period longer than the run averages at finish, checking only the "
          "steps taken",
          "[train][thread][local_sgd]") {
    // K = 2^40 ("average only at finish"): what the check gathers is sized by the 5 steps
    // taken, not by K; the result is local_sgd<5>'s, whose average falls on the last step.
    const auto run = [](auto period) {
        using K = decltype(period);
        std::vector<std::vector<double>> out(3);
        thread_group(3).run([&](thread_communicator& comm) {
            data_parallel<linear, sgd, sync::local_sgd<K::value>, reduce::per_tensor> dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            for (int s = 0; s < 5; ++s)
                dp.step(12, train_fn);
            dp.finish();
            const auto p = dp.parameters();
            out[comm.rank()].assign(p.begin(), p.end());
        });
        return out;
    };
    const auto huge = run(std::integral_constant<std::size_t, std::size_t(1) << 40>{});
    const auto five = run(std::integral_constant<std::size_t, 5>{});
    for (int r = 0; r < 3; ++r)
        CHECK(huge[r] == five[0]);
}

TEST_CASE("the asynchronous trainer refuses learning rates that differ across replicas",
          "[train][thread][agreement][async]") {
    // An lr set on one replica only was ignored on a worker and silently changed the run on
    // the server: refused on every replica before any work.
    for (const int who : {0, 1}) {
        using async_t = data_parallel<linear, sgd, sync::bounded_staleness<0>, reduce::per_tensor>;
        std::vector<std::int64_t> steps_after(3);
        const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
            async_t dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05});
            dp.train(2, 8, train_fn);
            if (rank == who)
                dp.optimizer().set_lr(0.0);
            try {
                dp.train(2, 8, train_fn);
            } catch (...) {
                steps_after[static_cast<std::size_t>(rank)] = dp.steps();
                throw;
            }
        });
        for (std::size_t r = 0; r < 3; ++r) {
            INFO("set_lr on replica " << who << ": " << e[r].first);
            CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(e[r].first,
                       Catch::Contains("replicas disagree on the learning rates of versions 2..3"));
            CHECK(steps_after[r] == 2);
        }
    }
}

TEST_CASE("the asynchronous trainer: a rate only one replica's schedule refuses fails everywhere",
          "[train][thread][agreement][async]") {
    // The refusing replica threw before the agreement's all_reduce; the others waited in it
    // (peer_failure on threads, the timeout under MPI). Now every replica throws at once.
    using async_t = data_parallel<linear, sgd, sync::bounded_staleness<0>, reduce::per_tensor>;
    const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
        train_params tp;
        tp.lr = [rank](std::int64_t s) { return s == 1 && rank == 1 ? -0.5 : 0.05; };
        async_t dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05}, tp);
        dp.train(2, 8, train_fn);
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO(e[r].first);
        CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(e[r].first,
                   r == 1 ? Catch::Contains("the learning rate of step 1 is -0.5")
                          : Catch::Contains("replica 1 refused a learning rate of versions 0..1"));
    }
}

TEST_CASE("the asynchronous trainer: a schedule's own exception on one replica fails everywhere",
          "[train][thread][agreement][async]") {
    using async_t = data_parallel<linear, sgd, sync::bounded_staleness<0>, reduce::per_tensor>;
    std::vector<std::string> what(3);
    try {
        thread_group(3).run([&](thread_communicator& comm) {
            train_params tp;
            tp.lr = [rank = comm.rank()](std::int64_t s) {
                if (s == 1 && rank == 1)
                    throw std::out_of_range("no rate for version 1");
                return 0.05;
            };
            async_t dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05}, tp);
            try {
                dp.train(2, 8, train_fn);
            } catch (const std::exception& e) {
                what[static_cast<std::size_t>(comm.rank())] = e.what();
                throw;
            }
        });
    } catch (const std::exception&) {
    }
    CHECK_THAT(what[1], Catch::Contains("no rate for version 1"));
    for (const std::size_t r : {0u, 2u})
        CHECK_THAT(what[r], Catch::Contains("replica 1 refused a learning rate of versions 0..1"));
}

TEST_CASE("the asynchronous trainer refuses rates that differ version by version but sum alike",
          "[train][thread][agreement][async]") {
    // Replica 1 applies the same two rates in the other order: equal sums, different runs on
    // a server and a worker. Refused on every replica before any work. -0.0 and 0.0 apply
    // alike and are accepted.
    using async_t = data_parallel<linear, sgd, sync::bounded_staleness<0>, reduce::per_tensor>;
    const auto swapped = [](int rank) {
        return [rank](std::int64_t s) { return (s % 2 == 0) == (rank == 1) ? 0.25 : 0.125; };
    };
    std::vector<std::int64_t> steps_after(3);
    const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
        train_params tp;
        tp.lr = swapped(rank);
        async_t dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05}, tp);
        try {
            dp.train(2, 8, train_fn);
        } catch (...) {
            steps_after[static_cast<std::size_t>(rank)] = dp.steps();
            throw;
        }
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO(e[r].first);
        CHECK(e[r].second == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(e[r].first,
                   Catch::Contains("replicas disagree on the learning rates of versions 0..1") &&
                       Catch::Contains("equal sums of rates that differ version by version"));
        CHECK(steps_after[r] == 0);
    }
    std::vector<std::int64_t> zero_steps(3);
    thread_group(3).run([&](thread_communicator& comm) {
        const double zero = comm.rank() == 1 ? -0.0 : 0.0;
        train_params tp;
        tp.lr = [zero](std::int64_t) { return zero; };
        async_t dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05}, tp);
        dp.train(2, 8, train_fn);
        zero_steps[static_cast<std::size_t>(comm.rank())] = dp.steps();
    });
    CHECK(zero_steps == std::vector<std::int64_t>{2, 2, 2});
}

TEST_CASE("the asynchronous trainer refuses steps that differ across replicas, naming them",
          "[train][thread][agreement][async]") {
    // Sums of the rates over different step counts differ too: the steps are compared first,
    // so the message names them rather than the learning rates.
    using async_t = data_parallel<linear, sgd, sync::asynchronous, reduce::per_tensor>;
    const auto e = errors_of(3, [&](int rank, thread_communicator& comm) {
        async_t dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05});
        dp.train(rank == 0 ? 5 : 4, 8, train_fn);
    });
    for (std::size_t r = 0; r < 3; ++r) {
        INFO(e[r].first);
        CHECK(e[r].second == static_cast<int>(errc::count_mismatch));
        CHECK_THAT(e[r].first, Catch::Contains("replicas disagree on the steps: from 4 to 5 (this "
                                               "replica: " +
                                               std::string(r == 0 ? "5" : "4") + ")"));
    }
}

TEST_CASE("the asynchronous trainers refuse settings they have no use for",
          "[train][thread][agreement][async]") {
    using async_t = data_parallel<linear, sgd, sync::bounded_staleness<1>, reduce::per_tensor>;
    struct refused {
        train_params tp;
        errc code;
        const char* text;
    };
    const std::vector<refused> cases = {
        {{.on_replica_failure = replica_failure::shrink},
         errc::unsupported,
         "on_replica_failure = shrink: the optimizer state lives on the server only"},
        {{.min_replicas = 0}, errc::invalid_argument, "min_replicas = 0 (must be >= 1)"},
        {{.read_result = false}, errc::unsupported, "read_result = false: "},
        {{.overlap = overlap_mode::always}, errc::unsupported, "overlap = always: "},
    };
    for (const auto& c : cases) {
        const auto e = errors_of(2, [&](int, thread_communicator& comm) {
            async_t dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05}, c.tp);
        });
        for (std::size_t r = 0; r < 2; ++r) {
            INFO(e[r].first);
            CHECK(e[r].second == static_cast<int>(c.code));
            CHECK_THAT(e[r].first, Catch::Contains("replica " + std::to_string(r) +
                                                   ": data_parallel(asynchronous): " + c.text));
        }
    }
}

TEST_CASE("on_apply's versions count from the trainer's construction, across train() calls",
          "[train][thread][async]") {
    // bounded_staleness<0>: every gradient is computed on the version it is applied to.
    using async_t = data_parallel<linear, sgd, sync::bounded_staleness<0>, reduce::per_tensor>;
    std::vector<std::uint64_t> versions, computed;
    std::vector<std::int64_t> steps_seen;
    thread_group(3, {.timeout = std::chrono::seconds(30)}).run([&](thread_communicator& comm) {
        async_params ap;
        ap.on_apply = [&](const apply_info& a, double) { // the server (replica 0) only
            versions.push_back(a.version);
            computed.push_back(a.computed_version);
        };
        async_t dp(
            comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.05}, {}, ap);
        dp.train(3, 8, train_fn);
        dp.train(3, 8, [&](linear& n, const shard_range& r, auto& ctx) {
            if (comm.rank() == 1)
                steps_seen.push_back(ctx.step());
            return n.train(r);
        });
    });
    CHECK(versions == std::vector<std::uint64_t>{0, 1, 2, 3, 4, 5});
    CHECK(computed == versions);
    for (const std::int64_t s : steps_seen) // worker 1's ctx.step() counts the same way
        CHECK(s >= 3);
}

TEST_CASE("replicas with other reduce or BN policies fail at construction naming both",
          "[train][thread][agreement]") {
    SECTION("reduce policy") {
        const auto e = errors_of(2, [](int rank, thread_communicator& comm) {
            auto make = [](auto& ctx) { return linear(ctx.rank()); };
            if (rank == 1)
                data_parallel<linear, sgd, sync::synchronous, reduce::bucketed<>> dp(comm, make,
                                                                                     {.lr = 0.1});
            else
                trainer dp(comm, make, {.lr = 0.1});
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("reduce: reduce::per_tensor on replica 0, "
                                            "reduce::bucketed<"));
        }
    }
    SECTION("BN policy") {
        const auto e = errors_of(2, [](int rank, thread_communicator& comm) {
            using global = mlp<float, thread_communicator, storage::registry, bn::global>;
            using local = mlp<float, thread_communicator, storage::registry, bn::local>;
            if (rank == 1)
                data_parallel<local, optim::sgd<float>, sync::synchronous, reduce::per_tensor> dp(
                    comm, [](auto& ctx) { return local(ctx); }, {.lr = 0.1});
            else
                data_parallel<global, optim::sgd<float>, sync::synchronous, reduce::per_tensor> dp(
                    comm, [](auto& ctx) { return global(ctx); }, {.lr = 0.1});
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::invalid_argument));
            CHECK_THAT(msg, Catch::Contains("bn_policies: bn::global on replica 0, bn::local on "
                                            "replica 1;"));
        }
    }
}

TEST_CASE("local SGD: a NaN gradient skips only that replica's step and restores its running "
          "statistics",
          "[train][thread][non_finite][local_sgd][bn]") {
    using net = mlp<float, thread_communicator, storage::registry, bn::local>;
    std::vector<std::vector<bool>> skipped(2);
    std::vector<std::vector<float>> before(2), after(2);
    std::string message;
    thread_group(2).run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::local_sgd<4>, reduce::per_tensor> dp(
            comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1});
        auto fn = [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); };
        auto running = [&] {
            std::vector<float> v(dp.network().batch_norm().running_mean().begin(),
                                 dp.network().batch_norm().running_mean().end());
            v.insert(v.end(), dp.network().batch_norm().running_var().begin(),
                     dp.network().batch_norm().running_var().end());
            return v;
        };
        dp.step(12, fn);
        before[comm.rank()] = running();
        dp.network().poison = comm.rank() == 1; // a NaN gradient on replica 1 only
        skipped[comm.rank()].push_back(dp.step(12, fn).skipped);
        after[comm.rank()] = running();
    });
    CHECK(skipped[0] == std::vector<bool>{false});
    CHECK(skipped[1] == std::vector<bool>{true});
    CHECK(after[1] == before[1]); // replica 1's statistics restored
    CHECK(after[0] != before[0]); // replica 0 trained on
}

TEST_CASE("finish: a replica that stops early is an error on every replica, itself included",
          "[train][thread][finish]") {
    const int n = GENERATE(2, 3);
    const int short_one = n - 1;
    const auto e = errors_of(n, [&](int rank, thread_communicator& comm) {
        trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
        for (int s = 0; s < (rank == short_one ? 2 : 3); ++s)
            dp.step(12, train_fn);
        dp.finish();
    });
    for (int r = 0; r < n; ++r) {
        const auto& [msg, code] = e[static_cast<std::size_t>(r)];
        INFO(msg);
        CHECK(code == static_cast<int>(errc::shape_mismatch));
        CHECK_THAT(msg, Catch::Contains("] replica " + std::to_string(r) + ": "));
        // Both calls are named: the short replica's finish and a peer's step collective.
        CHECK_THAT(msg,
                   Catch::Contains("replica " + std::to_string(short_one) + " called all_reduce") &&
                       Catch::Contains("tag 'data_parallel.finish'") &&
                       Catch::Contains("replica 0 called all_reduce"));
        if (r == short_one)
            CHECK_THAT(msg, Catch::Contains("data_parallel.finish: this replica finished after 2 "
                                            "step(s)"));
    }
}

// With buckets on a communication thread, a peer still in its step waits in a bucket reduction on
// that thread's split, not on the communicator: finish's collective runs there too and meets it,
// instead of both replicas waiting out the timeout.
TEST_CASE("finish: with overlap, a replica that stops early is still an error on every replica",
          "[train][thread][finish][overlap]") {
    const int n = GENERATE(2, 3);
    const int short_one = n - 1;
    const auto start = std::chrono::steady_clock::now();
    std::vector<int> overlapped(static_cast<std::size_t>(n), 0);
    const auto e = errors_of(n, [&](int rank, thread_communicator& comm) {
        trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                   {.overlap = overlap_mode::always});
        overlapped[static_cast<std::size_t>(rank)] = dp.overlaps() ? 1 : 0;
        for (int s = 0; s < (rank == short_one ? 2 : 3); ++s)
            dp.step(12, train_fn);
        dp.finish();
    });
    // Within the 30 s timeout errors_of's thread group sets, by a margin.
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(15));
    CHECK(overlapped == std::vector<int>(static_cast<std::size_t>(n), 1));
    for (int r = 0; r < n; ++r) {
        const auto& [msg, code] = e[static_cast<std::size_t>(r)];
        INFO(msg);
        CHECK(code != static_cast<int>(errc::timeout));
        CHECK_THAT(msg, Catch::Contains("] replica " + std::to_string(r) + ": "));
        CHECK_THAT(msg, Catch::Contains("tag 'data_parallel.finish'"));
        if (r == short_one)
            CHECK_THAT(msg, Catch::Contains("data_parallel.finish: this replica finished after 2 "
                                            "step(s)"));
    }
}

TEST_CASE("with overlap, a step function's exception reaches every peer as the cause",
          "[train][thread][overlap]") {
    // Replica 1's fn throws while its peers' buckets wait on the communication thread's split,
    // which departs as replica 1 unwinds its trainer: the peers must name the exception (a handle
    // left while unwinding counts as gone only once its thread has recorded the failure and
    // ended), not that departure. 3 trials each.
    const int n = GENERATE(3, 6);
    for (int trial = 0; trial < 3; ++trial) {
        std::vector<std::string> errors(static_cast<std::size_t>(n));
        std::string thrown;
        try {
            thread_group(n, {.timeout = std::chrono::seconds(30)})
                .run([&](thread_communicator& comm) {
                    try {
                        trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1},
                                   {.overlap = overlap_mode::always});
                        for (int s = 0; s < 3; ++s)
                            dp.step(12, [&](linear& net, const shard_range& r, auto& ctx) {
                                if (s == 1 && comm.rank() == 1)
                                    throw std::runtime_error("replica 1 could not read its batch");
                                return train_fn(net, r, ctx);
                            });
                        dp.finish();
                    } catch (const std::exception& e) {
                        errors[static_cast<std::size_t>(comm.rank())] = e.what();
                        throw;
                    }
                });
        } catch (const std::runtime_error& e) {
            thrown = e.what();
        }
        CHECK(thrown == "replica 1 could not read its batch");
        for (int r = 0; r < n; ++r) {
            CAPTURE(n, trial, r, errors[static_cast<std::size_t>(r)]);
            CHECK_THAT(errors[static_cast<std::size_t>(r)],
                       Catch::Contains("replica 1 could not read its batch"));
            CHECK_THAT(errors[static_cast<std::size_t>(r)], !Catch::Contains("left the group"));
        }
    }
}

TEST_CASE("finish: equal step counts return them; unequal local steps name every count",
          "[train][thread][finish][local_sgd]") {
    SECTION("equal") {
        std::vector<std::int64_t> done(3, -1);
        thread_group(3).run([&](thread_communicator& comm) {
            trainer dp(comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            for (int s = 0; s < 3; ++s)
                dp.step(12, train_fn);
            done[static_cast<std::size_t>(comm.rank())] = dp.finish();
        });
        CHECK(done == std::vector<std::int64_t>(3, 3));
    }
    SECTION("local SGD steps between averages issue no collective: the counts tell") {
        // local_sgd<2> averages after steps 2 and 4; replica 2's third step is local, so every
        // replica reaches finish's collective, which compares the counts.
        const auto e = errors_of(3, [](int rank, thread_communicator& comm) {
            data_parallel<linear, sgd, sync::local_sgd<2>, reduce::per_tensor> dp(
                comm, [](auto& ctx) { return linear(ctx.rank()); }, {.lr = 0.1});
            for (int s = 0; s < (rank == 2 ? 3 : 2); ++s)
                dp.step(24, train_fn);
            dp.finish();
        });
        for (const auto& [msg, code] : e) {
            INFO(msg);
            CHECK(code == static_cast<int>(errc::count_mismatch));
            CHECK_THAT(msg, Catch::Contains("data_parallel.finish: replicas ran different numbers "
                                            "of steps: replica 0 ran 2, replica 1 ran 2, replica "
                                            "2 ran 3"));
        }
    }
}

namespace {
using reg_ctx = replica_context<double, thread_communicator>;
/// linear's model with its tensors in the registry: each is marked ready after its gradient,
/// so in a step's last micro-batch mark_ready launches its bucket from inside fn.
struct linear_registry {
    reg_ctx::handle w, b;
    explicit linear_registry(reg_ctx& ctx) {
        w = ctx.registry().add("w", {5});
        b = ctx.registry().add("b", {1});
        for (std::size_t i = 0; i < 5; ++i)
            w.value()[i] = 0.1 * double(i + ctx.rank());
    }
    double train(const shard_range& r, reg_ctx& ctx) {
        const auto W = w.value(), DW = w.grad(), B = b.value(), DB = b.grad();
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const auto g = r.sample_index(i);
            double y = B[0];
            for (std::size_t k = 0; k < 5; ++k)
                y += W[k] * feature(g, k);
            const double e = y - 0.5 * feature(g, 5);
            loss += e * e * r.scale;
            for (std::size_t k = 0; k < 5; ++k)
                DW[k] += 2 * e * r.scale * feature(g, k);
            DB[0] += 2 * e * r.scale;
        }
        ctx.mark_ready(w);
        ctx.mark_ready(b);
        return loss;
    }
};
} // namespace

TEST_CASE("a step function that throws in the last micro-batch leaves no ready hook behind",
          "[train][thread][hooks]") {
    // micro_batches = 2 and per-tensor buckets launched by mark_ready. Step 0's fn throws on
    // every replica at the start of its last micro-batch, after the trainer installed the ready
    // hook; the replicas catch it and train the whole schedule. A hook left installed would
    // launch the buckets in the next step's first micro-batch, with half of its gradient.
    using reg_trainer = data_parallel<linear_registry, sgd, sync::synchronous, reduce::per_tensor>;
    const std::vector<double> expect = reference_run{}.run(batches);
    std::vector<std::vector<double>> out(3);
    std::vector<std::string> caught(3);
    thread_group(3, {.timeout = std::chrono::seconds(30)}).run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        reg_trainer dp(comm, [](auto& ctx) { return linear_registry(ctx); },
                       {.lr = 0.05, .momentum = 0.9}, {.micro_batches = 2});
        int calls = 0;
        auto fn = [&](linear_registry& n, const shard_range& r, reg_ctx& ctx) {
            if (++calls == 2)
                throw std::runtime_error("batch unavailable");
            return n.train(r, ctx);
        };
        try {
            dp.step(batches[0], fn);
        } catch (const std::runtime_error& e) {
            caught[me] = e.what();
        }
        for (std::size_t B : batches)
            dp.step(B, fn);
        const auto p = dp.parameters();
        out[me].assign(p.begin(), p.end());
    });
    for (std::size_t r = 0; r < 3; ++r) {
        CAPTURE(r);
        CHECK(caught[r] == "batch unavailable");
        CHECK(out[r] == out[0]);
        CHECK(max_abs_diff(out[r], expect) <= tol);
    }
}

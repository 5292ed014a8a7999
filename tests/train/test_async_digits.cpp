// tests/train/test_async_digits.cpp: the asynchronous trainers on the real digits data: exactness
// with one worker, convergence of async / bounded staleness / local SGD next to synchronous.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "mlp.hpp" // examples/digits: the user-written network of the demo

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

using namespace lockstep;

namespace {

const digits::split_data& data() {
    static const digits::split_data d = digits::load(LOCKSTEP_DIGITS_CSV);
    return d;
}

using net = digits::mlp<bn::local>;
using sgd = optim::sgd<float>;

struct outcome {
    double accuracy = 0;
    std::vector<float> params, state;
    staleness_report staleness;
};

/// Trains `net` with SyncPolicy on `replicas` threads for `epochs` over the training data.
/// Synchronous / local SGD: global batch `batch`; asynchronous: `batch` per worker.
template <class SyncPolicy>
outcome train(int replicas, int epochs, std::size_t batch, digits::mlp_options mo,
              optim::sgd_params opt) {
    const auto& d = data();
    const std::size_t total = d.train.size() * static_cast<std::size_t>(epochs);
    const digits::sampler order(d.train.size(), static_cast<std::size_t>(epochs) + 1, 7);
    outcome out;
    std::mutex mu;
    thread_group group(replicas, {.timeout = std::chrono::seconds(120)});
    group.run([&](thread_communicator& comm) {
        auto factory = [&](auto& ctx) { return net(mo, ctx.system()); };
        auto fn = [&](net& m, const shard_range& r, auto& ctx) {
            return m.train(ctx, d.train, order, r);
        };
        const train_params tp{.seed = 7};
        data_parallel<net, sgd, SyncPolicy, reduce::bucketed<>> trainer(comm, factory, opt, tp);
        staleness_report rep;
        if constexpr (is_asynchronous_v<SyncPolicy>) {
            rep = trainer.train((total + batch - 1) / batch, batch, fn).staleness;
        } else {
            for (std::size_t s = 0; s < (total + batch - 1) / batch; ++s)
                trainer.step(batch, fn);
            trainer.finish();
        }
        if (comm.rank() == 0) {
            std::lock_guard lock(mu);
            out.accuracy = trainer.network().accuracy(d.test);
            out.params.assign(trainer.parameters().begin(), trainer.parameters().end());
            trainer.network().for_each_state([&](auto, std::span<float> s) {
                out.state.insert(out.state.end(), s.begin(), s.end());
            });
            out.staleness = rep;
        }
    });
    return out;
}

} // namespace

TEST_CASE("asynchronous training with one worker is sequential SGD, BN running statistics "
          "included",
          "[train][async][thread][digits]") {
    // One worker never computes on stale parameters, so the server's trajectory must equal
    // plain sequential training of the same network on the same batches: SGD (lr, momentum)
    // written out here, and the BN running statistics the layer itself keeps when it runs every
    // batch (the server rebuilds them from the worker's batch statistics).
    const digits::mlp_options mo{.hidden = 16, .dropout = 0.2f};
    const optim::sgd_params opt{.lr = 0.05, .momentum = 0.9};
    const std::size_t batch = 24, steps = 15;
    const outcome async = [&] {
        const auto& d = data();
        const digits::sampler order(d.train.size(), 2, 7);
        outcome out;
        thread_group group(2);
        group.run([&](thread_communicator& comm) {
            auto factory = [&](auto& ctx) { return net(mo, ctx.system()); };
            auto fn = [&](net& m, const shard_range& r, auto& ctx) {
                return m.train(ctx, d.train, order, r);
            };
            data_parallel<net, sgd, sync::asynchronous> trainer(comm, factory, opt, {.seed = 7},
                                                                {.bn_momentum = 0.1});
            const auto res = trainer.train(steps, batch, fn);
            if (comm.rank() == 0) {
                out.staleness = res.staleness; // checked below, on this test's thread
                out.params.assign(trainer.parameters().begin(), trainer.parameters().end());
                trainer.network().for_each_state([&](auto, std::span<float> s) {
                    out.state.insert(out.state.end(), s.begin(), s.end());
                });
            }
        });
        return out;
    }();

    // The reference: one replica of the network, stepped by hand.
    const auto& d = data();
    const digits::sampler order(d.train.size(), 2, 7);
    thread_group solo(1);
    std::vector<double> w, velocity;
    std::vector<float> state;
    solo.run([&](thread_communicator& comm) {
        replica_context<float, thread_communicator> ctx(comm, 7);
        net m(mo, comm.system());
        auto gather = [&](bool grads) {
            std::vector<float> v;
            m.for_each_parameter([&](auto, std::span<float> val, std::span<float> g) {
                const auto& s = grads ? g : val;
                v.insert(v.end(), s.begin(), s.end());
            });
            return v;
        };
        auto scatter = [&](const std::vector<double>& v) {
            std::size_t at = 0;
            m.for_each_parameter([&](auto, std::span<float> val, std::span<float>) {
                for (float& x : val)
                    x = static_cast<float>(v[at++]);
            });
        };
        const auto w0 = gather(false);
        w.assign(w0.begin(), w0.end());
        velocity.assign(w.size(), 0.0);
        for (std::size_t k = 0; k < steps; ++k) {
            m.for_each_parameter([&](auto, std::span<float>, std::span<float> g) {
                std::fill(g.begin(), g.end(), 0.0f);
            });
            shard_range r{0, batch, batch, 1.0 / double(batch), k * batch};
            ctx.set_step(static_cast<std::int64_t>(k), true);
            m.train(ctx, d.train, order, r);
            const auto g = gather(true);
            for (std::size_t i = 0; i < w.size(); ++i) {
                velocity[i] = k == 0 ? g[i] : 0.9 * velocity[i] + g[i];
                w[i] -= 0.05 * velocity[i];
            }
            scatter(w);
        }
        m.for_each_state(
            [&](auto, std::span<float> s) { state.insert(state.end(), s.begin(), s.end()); });
    });

    CHECK(async.staleness.max == 0);
    REQUIRE(async.params.size() == w.size());
    double max_rel = 0;
    for (std::size_t i = 0; i < w.size(); ++i)
        max_rel = std::max(max_rel, std::abs(async.params[i] - w[i]) / (std::abs(w[i]) + 1e-3));
    // float arithmetic on the server vs double here, over 15 steps: ~1e-6 expected.
    CHECK(max_rel < 1e-4);
    REQUIRE(async.state.size() == state.size());
    double max_state = 0;
    for (std::size_t i = 0; i < state.size(); ++i)
        max_state = std::max(max_state, double(std::abs(async.state[i] - state[i])) /
                                            (std::abs(state[i]) + 1e-3));
    CHECK(max_state < 1e-4);
    // The statistics did move away from their initial 0 / 1.
    CHECK(std::abs(state[0]) > 1e-3);
}

TEST_CASE("asynchronous, bounded-staleness and local SGD training reach the accuracy of "
          "synchronous training on digits",
          "[train][async][thread][digits]") {
    const digits::mlp_options mo{.hidden = 32, .dropout = 0.1f};
    const optim::sgd_params opt{.lr = 0.05, .momentum = 0.9};
    const int epochs = 4;
    const outcome sync_run = train<sync::synchronous>(3, epochs, 48, mo, opt);
    // Two workers with half the global batch each: the same samples per epoch.
    const outcome async_run = train<sync::asynchronous>(3, epochs, 24, mo, opt);
    const outcome stale_run = train<sync::bounded_staleness<1>>(3, epochs, 24, mo, opt);
    const outcome local_run = train<sync::local_sgd<4>>(3, epochs, 48, mo, opt);
    INFO("test accuracy: synchronous "
         << sync_run.accuracy << ", asynchronous " << async_run.accuracy << " (max staleness "
         << async_run.staleness.max << "), bounded_staleness<1> " << stale_run.accuracy
         << ", local_sgd<4> " << local_run.accuracy);
    CHECK(sync_run.accuracy >= 0.93);
    // "Comparable": within 4 points of synchronous training (360 test samples: 1 point = 3.6).
    CHECK(async_run.accuracy >= sync_run.accuracy - 0.04);
    CHECK(stale_run.accuracy >= sync_run.accuracy - 0.04);
    CHECK(local_run.accuracy >= sync_run.accuracy - 0.04);
    CHECK(stale_run.staleness.max <= 1);
    CHECK(stale_run.staleness.applied == (data().train.size() * epochs + 23) / 24);
}

TEST_CASE("asynchronous training split over two train() calls follows one learning-rate schedule",
          "[train][async][thread][digits]") {
    // With one worker the run is sequential, so 15 gradients applied by one train() call and by
    // train(8) + train(7) must give the same bits: the second call continues the schedule (the
    // rate drops tenfold at step 10) and the step numbers the network sees (dropout keys).
    const digits::mlp_options mo{.hidden = 16, .dropout = 0.2f};
    const optim::sgd_params opt{.lr = 0.05, .momentum = 0.9};
    const std::size_t batch = 24;
    const auto run = [&](std::vector<std::size_t> calls) {
        const auto& d = data();
        const digits::sampler order(d.train.size(), 2, 7);
        std::vector<float> params;
        std::int64_t steps = 0;
        thread_group group(2);
        group.run([&](thread_communicator& comm) {
            auto factory = [&](auto& ctx) { return net(mo, ctx.system()); };
            auto fn = [&](net& m, const shard_range& r, auto& ctx) {
                return m.train(ctx, d.train, order, r);
            };
            const train_params tp{.lr = [](std::int64_t s) { return s < 10 ? 0.05 : 0.005; },
                                  .seed = 7};
            data_parallel<net, sgd, sync::asynchronous> trainer(comm, factory, opt, tp,
                                                                {.bn_momentum = 0.1});
            for (std::size_t n : calls)
                trainer.train(n, batch, fn);
            if (comm.rank() == 0) { // rank 0 is the server
                params.assign(trainer.parameters().begin(), trainer.parameters().end());
                steps = trainer.steps();
            }
        });
        return std::pair(params, steps);
    };
    const auto [whole, whole_steps] = run({15});
    const auto [split, split_steps] = run({8, 7});
    CHECK(whole_steps == 15);
    CHECK(split_steps == 15);
    REQUIRE(whole.size() == split.size());
    CHECK(std::memcmp(whole.data(), split.data(), whole.size() * sizeof(float)) == 0);
}

TEST_CASE("a BN layer whose momentum is not async_params::bn_momentum is refused on the worker",
          "[train][async][thread][digits]") {
    // The server folds each worker's update of the running statistics (made with the layer's
    // momentum) into its own with bn_momentum: unequal, a stale gradient's statistics would mix
    // in the worker's old ones without a word.
    const digits::mlp_options mo{.hidden = 16, .bn_momentum = 0.1};
    const auto& d = data();
    const digits::sampler order(d.train.size(), 2, 7);
    std::vector<std::string> errors(3);
    std::mutex mu;
    try {
        thread_group(3).run([&](thread_communicator& comm) {
            try {
                auto factory = [&](auto& ctx) { return net(mo, ctx.system()); };
                data_parallel<net, sgd, sync::asynchronous> trainer(
                    comm, factory, {.lr = 0.05}, {.seed = 7}, {.bn_momentum = 0.05});
                trainer.train(4, 8, [&](net& m, const shard_range& r, auto& ctx) {
                    return m.train(ctx, d.train, order, r);
                });
            } catch (const error& e) {
                const std::lock_guard lock(mu);
                errors[static_cast<std::size_t>(comm.rank())] = e.what();
                throw;
            }
        });
    } catch (const error&) {
    }
    // Each worker refuses its first work item (or is stopped by the other's failure first).
    int refused = 0;
    for (std::size_t r = 1; r < 3; ++r) {
        INFO(errors[r]);
        const std::string own = "[invalid_argument] replica " + std::to_string(r) +
                                ": batch_norm.forward_train: this layer's momentum is 0.1 but "
                                "the asynchronous trainer's server updates the running "
                                "statistics with async_params::bn_momentum = 0.05: set "
                                "bn_momentum to the layers' momentum";
        refused += errors[r].find(own) != std::string::npos ? 1 : 0;
        CHECK(errors[r].find("bn_momentum = 0.05") != std::string::npos);
    }
    CHECK(refused >= 1);
    INFO(errors[0]);
    CHECK(errors[0].find("peer_failure") != std::string::npos);
}

// tests/train/test_async_bn.cpp: the BN running statistics the asynchronous trainers' server
// keeps, against a layer that sees the same micro-batches in the server's order, with stale
// workers and several micro-batches per work item. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "support/bn_probe.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <thread>
#include <tuple>
#include <vector>

using namespace lockstep;

namespace {

constexpr std::size_t channels = 3;

/// Channel k of sample g: its own scale and offset per channel, the same on every replica.
double feature(std::uint64_t g, std::size_t k) {
    return rng_stream{0xB0B, 1}.normal(g, k) * double(k + 1) + double(k);
}

using probe = lockstep_test::bn_probe<bn::local, feature>;

} // namespace

// Each work item of `batch` samples runs as `micro` micro-batches, so the worker's layer updates
// its running statistics `micro` times from the statistics the worker pulled, which are stale
// when other workers' items were applied meanwhile. The server must end with the statistics of
// every micro-batch folded in, item after item in the order it applied them, as one layer that
// sees those micro-batches in that order has: nothing of the worker's stale copy may remain.
TEST_CASE("the server's running statistics take every micro-batch of stale workers exactly",
          "[train][async][thread]") {
    constexpr std::size_t batch = 12, micro = 3, steps = 24;
    std::vector<std::uint64_t> applied; // work items in the server's order
    std::vector<double> server_mean, server_var;
    std::uint64_t max_staleness = 0;
    thread_group(3, {.timeout = std::chrono::seconds(60)}).run([&](thread_communicator& comm) {
        train_params tp;
        tp.micro_batches = static_cast<int>(micro);
        async_params ap;
        ap.bn_momentum = 0.1;
        std::vector<std::uint64_t> order; // written on the server's thread only
        ap.on_apply = [&](const apply_info& a, double) { order.push_back(a.index); };
        data_parallel<probe, optim::sgd<double>, sync::asynchronous> trainer(
            comm, [](auto& ctx) { return probe(ctx); }, {.lr = 0.01}, tp, ap);
        const auto res =
            trainer.train(steps, batch, [&](probe& n, const shard_range& r, auto& ctx) {
                if (comm.rank() == 2) // a slow worker: the other's items are applied meanwhile
                    std::this_thread::sleep_for(std::chrono::milliseconds(3));
                return n.train(r, ctx);
            });
        if (comm.rank() == 0) { // read on this test's thread after run() joined
            applied = order;
            max_staleness = res.staleness.max;
            const auto m = trainer.network().bn->running_mean();
            const auto v = trainer.network().bn->running_var();
            server_mean.assign(m.begin(), m.end());
            server_var.assign(v.begin(), v.end());
        }
    });
    REQUIRE(applied.size() == steps);
    REQUIRE(max_staleness > 0); // else the stale copy could not show

    // The reference: one layer, the same micro-batches, in the server's order.
    std::vector<double> ref_mean, ref_var;
    thread_group(1).run([&](thread_communicator& comm) {
        probe::bn_type layer(comm, channels);
        for (const std::uint64_t item : applied)
            for (std::size_t m = 0; m < micro; ++m) {
                const std::size_t begin = batch * m / micro, end = batch * (m + 1) / micro;
                const std::size_t n = end - begin;
                std::vector<double> x(n * channels), y(n * channels);
                for (std::size_t s = 0; s < n; ++s)
                    for (std::size_t k = 0; k < channels; ++k)
                        x[s * channels + k] = feature(item * batch + begin + s, k);
                layer.forward_train(comm, std::span<const double>(x), nn::tensor_shape{n, channels},
                                    std::span<double>(y));
            }
        ref_mean.assign(layer.running_mean().begin(), layer.running_mean().end());
        ref_var.assign(layer.running_var().begin(), layer.running_var().end());
    });
    // double arithmetic in another association on each side, over 72 updates: ~1e-15 relative.
    for (std::size_t k = 0; k < channels; ++k) {
        INFO("channel " << k << ": server " << server_mean[k] << ", " << server_var[k]
                        << "; reference " << ref_mean[k] << ", " << ref_var[k]);
        CHECK(std::abs(server_mean[k] - ref_mean[k]) <= 1e-12 * (1 + std::abs(ref_mean[k])));
        CHECK(std::abs(server_var[k] - ref_var[k]) <= 1e-12 * (1 + std::abs(ref_var[k])));
    }
}

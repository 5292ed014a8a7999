// A synchronous step with several bn::global layers waits on the host exactly once (the
// end-of-step read), or never with read_result = false, besides each layer's settings check
// at its first training call (one all_reduce and one host wait per layer, in the first step); the
// device-side decisions (layer errors, non-finite skip, the clipping factor, the BN running
// statistics kept or restored) still reach every replica. Counted with host_sync_count() on the
// host system, which counts the same points the CUDA system would wait at. SPDX-License-Identifier:
// Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "support/counting_communicator.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

using namespace lockstep;

namespace {

using comm_type = testing::counting_communicator<thread_communicator>;
using ctx_type = replica_context<float, comm_type>;
constexpr std::size_t channels = 5;
constexpr int layers = 3;

/// The host waits (and collectives) of the first step's settings checks: one per BN layer.
std::vector<std::uint64_t> first_step_more(std::size_t steps, std::uint64_t each) {
    std::vector<std::uint64_t> v(steps, each);
    v[0] += layers;
    return v;
}

/// x -> bn1 -> bn2 -> bn3 -> loss = sum(y * t) * scale: three bn::global layers whose gamma and
/// beta live in the registry. `poison` makes the loss's gradient NaN on this replica; `single`
/// feeds a global batch of one sample (an error the layers find on the device).
struct bn_stack {
    using bn_policies = std::tuple<bn::global>;
    using bn_type = nn::batch_norm<float, bn::global, nn::nc>;

    explicit bn_stack(ctx_type& ctx) {
        auto& reg = ctx.registry();
        for (int l = 0; l < layers; ++l) {
            gamma[l] = reg.add("bn" + std::to_string(l) + ".weight", {channels});
            beta[l] = reg.add("bn" + std::to_string(l) + ".bias", {channels});
        }
        reg.finalize();
        for (int l = 0; l < layers; ++l)
            bn[l].emplace(ctx.comm(), channels,
                          bn_type::parameter_spans{gamma[l].value(), beta[l].value(),
                                                   gamma[l].grad(), beta[l].grad()});
    }

    double train(const shard_range& r, ctx_type& ctx) {
        const std::size_t n = r.size();
        std::vector<float> a(n * channels), b(a.size()), t(a.size());
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t c = 0; c < channels; ++c) {
                const double g = static_cast<double>(r.sample_index(r.begin + s));
                a[s * channels + c] = static_cast<float>(std::sin(0.7 * g + 1.3 * double(c)));
                t[s * channels + c] = static_cast<float>(std::cos(0.3 * g - double(c)));
            }
        const nn::tensor_shape shape{n, channels};
        bn[0]->forward_train(ctx, std::span<const float>(a), shape, std::span<float>(b));
        bn[1]->forward_train(ctx, std::span<const float>(b), shape, std::span<float>(a));
        std::vector<float> y(a.size());
        bn[2]->forward_train(ctx, std::span<const float>(a), shape, std::span<float>(y));
        double loss = 0;
        std::vector<float> dy(y.size()), d1(y.size()), d2(y.size());
        for (std::size_t i = 0; i < y.size(); ++i) {
            loss += static_cast<double>(y[i] * t[i]) * r.scale;
            dy[i] = static_cast<float>(t[i] * r.scale);
        }
        if (poison && !dy.empty())
            dy[0] = std::numeric_limits<float>::quiet_NaN();
        bn[2]->backward(ctx, std::span<const float>(dy), std::span<float>(d1));
        bn[1]->backward(ctx, std::span<const float>(d1), std::span<float>(d2));
        bn[0]->backward(ctx, std::span<const float>(d2), std::span<float>(d1));
        return loss;
    }

    ctx_type::handle gamma[layers], beta[layers];
    std::optional<bn_type> bn[layers];
    bool poison = false;
};

using trainer_type =
    data_parallel<bn_stack, optim::adam<float>, sync::synchronous, reduce::bucketed<>, comm_type>;

struct run_record {
    std::vector<std::uint64_t> syncs; ///< host_sync_count() increase per step
    std::vector<int> collectives;     ///< collectives per step
    std::vector<double> losses;
    std::vector<bool> skipped;
    std::vector<std::vector<float>> after_step; ///< parameters after each step
    std::int64_t applied = -1;                  ///< the optimizer's step_count() at the end
    std::string error;
};

/// Runs `steps` steps of global batch `batch` on `replicas` replicas; `poison_step` poisons a
/// gradient on replica 1 in that step. Returns replica 0's record, and checks that every
/// replica holds the same parameters after every step.
run_record run(int replicas, int steps, std::size_t batch, bool read_each, int poison_step = -1) {
    std::vector<run_record> records(static_cast<std::size_t>(replicas));
    thread_group group(replicas, {.timeout = std::chrono::seconds(30)});
    group.run([&](thread_communicator& inner) {
        comm_type comm(inner);
        run_record& rec = records[static_cast<std::size_t>(comm.rank())];
        try {
            trainer_type trainer(comm, [](ctx_type& ctx) { return bn_stack(ctx); }, {.lr = 0.01},
                                 {.read_result = read_each, .max_grad_norm = 10.0});
            for (int k = 0; k < steps; ++k) {
                trainer.network().poison = k == poison_step && comm.rank() == 1;
                const auto before = host_sync_count();
                const int c0 = comm.counts().collectives();
                const step_result r =
                    trainer.step(batch, [](bn_stack& net, shard_range sr, ctx_type& ctx) {
                        return net.train(sr, ctx);
                    });
                rec.syncs.push_back(host_sync_count() - before);
                rec.collectives.push_back(comm.counts().collectives() - c0);
                const step_result done = r.ready ? r : trainer.read_result();
                rec.losses.push_back(done.loss);
                rec.skipped.push_back(done.skipped);
                const auto p = trainer.parameters();
                rec.after_step.emplace_back(p.begin(), p.end());
            }
            rec.applied = trainer.optimizer().step_count();
        } catch (const error& e) {
            rec.error = e.what();
        }
    });
    for (const auto& r : records)
        CHECK(r.after_step == records[0].after_step);
    return records[0];
}

} // namespace

TEST_CASE("a synchronous step with three bn::global layers waits on the host once",
          "[train][thread][sync]") {
    const run_record rec = run(2, 3, 7, true);
    INFO(rec.error);
    REQUIRE(rec.error.empty());
    // One read of the step's status; 3 layers x (all_gather + all_reduce) + 1 bucket + status;
    // in the first step each layer's settings check adds one all_reduce and one host wait.
    CHECK(rec.syncs == first_step_more(3, 1));
    CHECK(rec.collectives == std::vector<int>{3 * layers + 2, 2 * layers + 2, 2 * layers + 2});
    for (const double l : rec.losses)
        CHECK(std::isfinite(l));
}

TEST_CASE("with read_result = false a step never waits on the host; read_result() reads it",
          "[train][thread][sync]") {
    const run_record waiting = run(3, 3, 8, true);
    const run_record deferred = run(3, 3, 8, false);
    REQUIRE(deferred.error.empty());
    CHECK(deferred.syncs == first_step_more(3, 0));
    // The same step results and bitwise the same parameters after every step either way.
    CHECK(deferred.losses == waiting.losses);
    CHECK(deferred.after_step == waiting.after_step);
}

TEST_CASE("a NaN gradient on one replica skips the step on every replica, decided on the device",
          "[train][thread][sync]") {
    const run_record poisoned = run(2, 4, 6, false, 1);
    INFO(poisoned.error);
    REQUIRE(poisoned.error.empty());
    CHECK(poisoned.skipped == std::vector<bool>{false, true, false, false});
    CHECK(poisoned.syncs == first_step_more(4, 0));
    // Skipped on the device: the parameters keep their bits through step 1, the other steps
    // change them, and Adam counts 3 applied steps of 4.
    REQUIRE(poisoned.after_step.size() == 4);
    CHECK(poisoned.after_step[1] == poisoned.after_step[0]);
    CHECK(poisoned.after_step[2] != poisoned.after_step[1]);
    CHECK(poisoned.applied == 3);
}

TEST_CASE("a layer error found on the device (one value per channel) is an error on every "
          "replica at the end of the step",
          "[train][thread][sync]") {
    std::vector<std::string> errors(2);
    // Catch2 checks on this thread, after run(); int, not bool: std::vector<bool> packs both
    // replicas' flags into one word.
    std::vector<int> unchanged(2, 0);
    thread_group group(2, {.timeout = std::chrono::seconds(30)});
    group.run([&](thread_communicator& inner) {
        comm_type comm(inner);
        trainer_type trainer(comm, [](ctx_type& ctx) { return bn_stack(ctx); });
        const auto before = trainer.parameters();
        const std::vector<float> start(before.begin(), before.end());
        try {
            (void)trainer.step(
                1, [](bn_stack& net, shard_range sr, ctx_type& ctx) { return net.train(sr, ctx); });
        } catch (const error& e) {
            errors[static_cast<std::size_t>(comm.rank())] = e.what();
        }
        const auto after = trainer.parameters();
        unchanged[static_cast<std::size_t>(comm.rank())] =
            std::vector<float>(after.begin(), after.end()) == start;
    });
    CHECK(unchanged == std::vector<int>{1, 1});
    for (const auto& e : errors) {
        CHECK(e.find("invalid_argument") != std::string::npos);
        CHECK(e.find("step 0 skipped: batch_norm layer 0 (in forward order): expected more than "
                     "1 value per channel") != std::string::npos);
    }
}

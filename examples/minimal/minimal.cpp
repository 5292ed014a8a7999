// examples/minimal: a user-written two-layer network fits y = sin(3 x0) + x1 / 2, trained
// data-parallel on 4 thread replicas with synchronous SGD. SPDX-License-Identifier: Apache-2.0
#include <lockstep/lockstep.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

using namespace lockstep;
using context = replica_context<float, thread_communicator>;

struct sample {
    float x0, x1, y;
};
sample make_sample(std::uint64_t g) { // sample g of the run: the same on every replica
    const float x0 = float(rng_stream{7, 0}.normal(g, 0)),
                x1 = float(rng_stream{7, 0}.normal(g, 1));
    return {x0, x1, std::sin(3 * x0) + 0.5f * x1};
}

// 2 -> 32 (tanh) -> 1. Its tensors live in the replica's registry (one flat buffer).
struct net {
    static constexpr std::size_t H = 32;
    tensor_handle<float> w1, b1, w2, b2;
    explicit net(context& ctx)
        : w1(ctx.registry().add("w1", {H, 2})), b1(ctx.registry().add("b1", {H})),
          w2(ctx.registry().add("w2", {H})), b2(ctx.registry().add("b2", {1})) {
        const rng_stream init{1, 0};
        for (std::size_t i = 0; i < 2 * H; ++i)
            w1.value()[i] = float(init.normal(0, i));
        for (std::size_t i = 0; i < H; ++i)
            w2.value()[i] = float(init.normal(1, i) / std::sqrt(H));
    }
    // Forward and backward over this replica's samples: accumulates the gradients of the mean
    // squared error over the global batch (r.scale = 1 / its size), returns its share of it.
    double train(const shard_range& r) {
        auto W1 = w1.value(), B1 = b1.value(), W2 = w2.value(), B2 = b2.value();
        auto gW1 = w1.grad(), gB1 = b1.grad(), gW2 = w2.grad(), gB2 = b2.grad();
        double loss = 0;
        for (std::size_t i = r.begin; i < r.end; ++i) {
            const sample s = make_sample(r.sample_index(i));
            float h[H], out = B2[0];
            for (std::size_t j = 0; j < H; ++j) {
                h[j] = std::tanh(W1[2 * j] * s.x0 + W1[2 * j + 1] * s.x1 + B1[j]);
                out += W2[j] * h[j];
            }
            const float err = out - s.y, d = float(2 * err * r.scale);
            loss += double(err) * err * r.scale;
            gB2[0] += d;
            for (std::size_t j = 0; j < H; ++j) {
                const float dh = d * W2[j] * (1 - h[j] * h[j]);
                gW2[j] += d * h[j];
                gW1[2 * j] += dh * s.x0;
                gW1[2 * j + 1] += dh * s.x1;
                gB1[j] += dh;
            }
        }
        return loss;
    }
};

int main() {
    const int replicas = 4, steps = 3000, batch = 128;
    std::vector<double> first(replicas), last(replicas);
    thread_group(replicas).run([&](thread_communicator& comm) {
        data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>> trainer(
            comm, [](context& ctx) { return net(ctx); }, {.lr = 0.05, .momentum = 0.9});
        auto fn = [](net& n, const shard_range& r, context&) { return n.train(r); };
        first[comm.rank()] = trainer.step(batch, fn).loss; // the global batch's mean loss
        for (int s = 1; s < steps; ++s) {
            const double loss = trainer.step(batch, fn).loss; // the same on every replica
            last[comm.rank()] += s >= steps - 100 ? loss / 100 : 0.0;
        }
    });
    std::printf("mean squared error: step 0 %.4f, last 100 steps %.4f\n", first[0], last[0]);
    const bool same = std::all_of(last.begin(), last.end(), [&](double l) { return l == last[0]; });
    const bool ok = last[0] < 0.1 * first[0] && same;
    std::printf("%s\n", ok ? "minimal: trained" : "minimal: did NOT train");
    return ok ? 0 : 1;
}

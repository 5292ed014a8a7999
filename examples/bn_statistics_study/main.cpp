// examples/bn_statistics_study: which running mean/variance do data-parallel replicas end up
// with under different batch-norm statistics policies, on i.i.d. and on class-sorted shards.
// SPDX-License-Identifier: Apache-2.0
//
// A stream of global batches is split over R replicas (threads). Every replica feeds the same
// shard to three lockstep batch-norm layers that differ only in their policy:
//   (a) bn::tower<0>   every replica keeps the running statistics of replica 0's batches
//   (b) bn::local      each replica keeps its own; we then average them over the replicas
//   (c) bn::global     exact statistics of the global batch (Chan merge of every replica's
//                      count, mean and M2)
// and compares the final running mean/variance with the true mean/variance of the data.
//
// With i.i.d. shards all three are unbiased ((a) is just noisier). With class-sorted shards,
// replica r sees N(mu_r, sigma^2): (a) learns replica 0's distribution, and (b) learns the
// average WITHIN-replica variance sigma^2, missing the spread of the replica means: by the law
// of total variance the true variance is sigma^2 + Var(mu_r). Only (c) is right.
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/nn/batch_norm.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

struct study {
    int replicas = 4;
    int steps = 800;
    std::size_t per_replica = 8; // samples per replica per step, each 1 x 4 x 4 values
    double momentum = 0.01;      // a long average, so the table shows bias rather than noise
};

struct estimate {
    double mean = 0, var = 0;
};

struct outcome {
    estimate tower, local_average, global;
};

/// Runs the stream; replica r draws from N(mean_of(r), sigma^2).
template <class MeanOf>
outcome run(const study& s, MeanOf mean_of, double sigma) {
    using namespace lockstep;
    outcome out;
    thread_group group(s.replicas);
    group.run([&](thread_communicator& comm) {
        const nn::batch_norm_params p{.momentum = s.momentum};
        nn::batch_norm<double, bn::tower<0>, nn::nchw> tower(1, p);
        nn::batch_norm<double, bn::local, nn::nchw> local(1, p);
        nn::batch_norm<double, bn::global, nn::nchw> global(1, p);
        const nn::tensor_shape shape{s.per_replica, 1, 4, 4};
        std::vector<double> x(shape.elements()), y(x.size());
        std::mt19937_64 gen(12345u + 7919u * static_cast<unsigned>(comm.rank()));
        std::normal_distribution<double> z(mean_of(comm.rank()), sigma);
        for (int step = 0; step < s.steps; ++step) {
            for (auto& v : x)
                v = z(gen);
            const std::span<const double> in(x);
            tower.forward_train(comm, in, shape, std::span<double>(y));
            local.forward_train(comm, in, shape, std::span<double>(y));
            global.forward_train(comm, in, shape, std::span<double>(y));
        }
        // (b): what averaging the replicas' running buffers gives
        const double mine[2] = {local.running_mean()[0], local.running_var()[0]};
        double sum[2];
        comm.all_reduce(std::span<const double>(mine), std::span<double>(sum), reduce_op::sum);
        if (comm.rank() == 0) {
            out.tower = {tower.running_mean()[0], tower.running_var()[0]};
            out.local_average = {sum[0] / s.replicas, sum[1] / s.replicas};
            out.global = {global.running_mean()[0], global.running_var()[0]};
        }
    });
    return out;
}

void print(const char* scenario, const outcome& o, estimate truth) {
    auto row = [&](const char* name, estimate e) {
        std::printf("  %-34s %10.3f %10.3f %12.1f%%\n", name, e.mean, e.var,
                    100.0 * (e.var - truth.var) / truth.var);
    };
    std::printf("%s\n", scenario);
    std::printf("  %-34s %10.3f %10.3f\n", "true value", truth.mean, truth.var);
    row("(a) one replica (bn::tower<0>)", o.tower);
    row("(b) average of per-replica (local)", o.local_average);
    row("(c) exact global (bn::global)", o.global);
}

} // namespace

int main(int argc, char** argv) {
    study s;
    if (argc > 1)
        s.replicas = std::max(1, std::atoi(argv[1]));
    if (argc > 2)
        s.steps = std::max(1, std::atoi(argv[2]));
    if (argc > 3)
        s.per_replica = static_cast<std::size_t>(std::max(2, std::atoi(argv[3])));
    std::printf("batch-norm running statistics after %d steps, %d replicas x %zu samples x 16 "
                "values, momentum %.2f\n\n",
                s.steps, s.replicas, s.per_replica, s.momentum);
    std::printf("  %-34s %10s %10s %13s\n", "estimate", "mean", "variance", "variance err");

    const double sigma = 2.0;
    const auto iid = run(
        s, [](int) { return 3.0; }, sigma);
    print("i.i.d. shards: every replica draws from N(3, 2^2)", iid, {3.0, sigma * sigma});

    // class-sorted: replica r's shard is centred at 3 + 2 (r - (R - 1) / 2), sigma = 1
    const auto mean_of = [&](int r) { return 3.0 + 2.0 * (r - (s.replicas - 1) / 2.0); };
    double between = 0;
    for (int r = 0; r < s.replicas; ++r)
        between += (mean_of(r) - 3.0) * (mean_of(r) - 3.0);
    between /= s.replicas;
    const auto sorted = run(s, mean_of, 1.0);
    std::printf("\n");
    print("class-sorted shards: replica r draws from N(mu_r, 1), mu_r spread around 3", sorted,
          {3.0, 1.0 + between});
    std::printf("\nlaw of total variance: total %.3f = within-replica %.3f + between replica "
                "means %.3f;\naveraging per-replica variances recovers only the within part.\n",
                1.0 + between, 1.0, between);

    // The study's figures, checked (CTest runs the defaults). Tolerance: 5% of the variance and
    // 0.1 of the mean. With momentum 0.01 a running estimate averages about 100 batches of
    // replicas x per_replica x 16 values, so its relative noise is about
    // sqrt(0.01 / 2 * 2 / (4 * 8 * 16)) = 0.9% of the variance at the defaults: 5% is 5 sigma.
    int failed = 0;
    const auto expect = [&](bool ok, const char* what) {
        if (!ok) {
            std::printf("CHECK FAILED: %s\n", what);
            ++failed;
        }
    };
    const auto near_var = [](double v, double truth) {
        return std::abs(v - truth) <= 0.05 * truth;
    };
    const auto near_mean = [](double m, double truth) { return std::abs(m - truth) <= 0.1; };
    expect(near_var(iid.tower.var, sigma * sigma) &&
               near_var(iid.local_average.var, sigma * sigma) &&
               near_var(iid.global.var, sigma * sigma),
           "i.i.d.: every policy's running variance is the true variance");
    expect(near_var(sorted.global.var, 1.0 + between) && near_mean(sorted.global.mean, 3.0),
           "class-sorted: bn::global's running statistics are the true ones");
    expect(s.replicas == 1 || near_var(sorted.local_average.var, 1.0),
           "class-sorted: averaged bn::local recovers only the within-replica variance");
    expect(near_mean(sorted.tower.mean, mean_of(0)) && near_var(sorted.tower.var, 1.0),
           "class-sorted: bn::tower<0> learns replica 0's distribution");
    std::printf("%s\n", failed ? "bn_statistics_study: figures NOT reproduced"
                               : "bn_statistics_study: figures reproduced");
    return failed ? 1 : 0;
}

// tests/train/mismatch_cases.hpp: the mistakes that make replicas disagree (inside a step, or on
// a setting at construction), written once for every backend (test_mismatch.cpp: the thread
// group; test_mismatch_mpi.cpp: MPI), so both check that the same mistake gives the same error
// code and names its cause.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/lockstep.hpp"

#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace lockstep_test::mismatch {

using namespace lockstep;

/// The mistakes, each made by the last replica.
enum class mistake {
    global_batch_bucketed,     ///< another global batch under reduce::bucketed<>
    global_batch_sharded,      ///< another global batch under reduce::sharded<>
    global_batch_reproducible, ///< another global batch under reduce::reproducible<4>
    bn_skipped_on_empty_shard, ///< bn::global not called where the shard is empty
    seed_per_replica,          ///< another train_params::seed (a "seed + rank" habit)
};
inline constexpr mistake all_mistakes[] = {
    mistake::global_batch_bucketed, mistake::global_batch_sharded,
    mistake::global_batch_reproducible, mistake::bn_skipped_on_empty_shard,
    mistake::seed_per_replica};

/// The code every backend throws for the mistake, and what the message must name.
inline errc expected_code(mistake m) {
    return m == mistake::bn_skipped_on_empty_shard ? errc::shape_mismatch : errc::invalid_argument;
}
inline std::vector<std::string> expected_parts(mistake m, int replicas) {
    const std::string last = std::to_string(replicas - 1);
    if (m == mistake::bn_skipped_on_empty_shard)
        return {"replicas called different collectives",
                "tag 'batch_norm layer 0 (forward order) forward_train'",
                "the step function saw no sample on replica " + last,
                "batch norm: forward_train and backward with 0 samples"};
    if (m == mistake::seed_per_replica)
        return {"data_parallel: parameter check", "replicas use different settings:",
                "seed: 1234 on replica 0, " + std::to_string(1234 + replicas - 1) + " on replica " +
                    last + ";"};
    return {"the replicas disagree: global_batch:", "9 on replica " + last};
}

/// x -> batch norm (Policy) -> loss sum(y * t) * scale, its gamma and beta in the registry.
template <class Policy, class Comm>
struct bn_net {
    using context = replica_context<double, Comm>;
    using bn_policies = std::tuple<Policy>;
    using bn_type = nn::batch_norm<double, Policy, nn::nc>;
    static constexpr std::size_t channels = 3;
    tensor_handle<double> gamma, beta;
    std::unique_ptr<bn_type> bn;
    bool skip_bn_when_empty = false;
    explicit bn_net(context& ctx)
        : gamma(ctx.registry().add("bn.gamma", {channels})),
          beta(ctx.registry().add("bn.beta", {channels})) {
        ctx.registry().finalize();
        bn = std::make_unique<bn_type>(ctx.comm(), channels,
                                       typename bn_type::parameter_spans{
                                           gamma.value(), beta.value(), gamma.grad(), beta.grad()});
    }
    template <class F>
    void for_each_state(F&& f) {
        f("bn.running_mean", bn->running_mean());
        f("bn.running_var", bn->running_var());
    }
    double train(const shard_range& r, context& ctx) {
        const std::size_t n = r.size();
        if (n == 0 && skip_bn_when_empty)
            return 0.0; // the mistake: the layer is not called on an empty shard
        std::vector<double> x(n * channels), y(x.size()), dy(x.size()), dx(x.size());
        for (std::size_t i = 0; i < x.size(); ++i)
            x[i] = std::sin(0.37 * double(r.sample_index(r.begin) * channels + i));
        bn->forward_train(ctx, std::span<const double>(x), {n, channels}, std::span<double>(y));
        for (std::size_t i = 0; i < y.size(); ++i)
            dy[i] = r.scale * std::cos(double(i));
        bn->backward(ctx, std::span<const double>(dy), std::span<double>(dx));
        return 0.0;
    }
};

/// What one replica saw.
struct outcome {
    bool threw = false;
    errc code = errc::internal;
    std::string message;
};

template <class Policy, class Reduce, class Comm>
outcome run_with(Comm& comm, mistake m) {
    using net = bn_net<Policy, Comm>;
    using context = typename net::context;
    const bool last = comm.rank() == comm.size() - 1;
    outcome out;
    try {
        data_parallel<net, optim::sgd<double>, sync::synchronous, Reduce, Comm> trainer(
            comm, [](context& ctx) { return net(ctx); }, {.lr = 0.1},
            {.seed = m == mistake::seed_per_replica && last ? 1234u + comm.size() - 1 : 1234u});
        trainer.network().skip_bn_when_empty = m == mistake::bn_skipped_on_empty_shard;
        auto fn = [](net& n, const shard_range& r, context& ctx) { return n.train(r, ctx); };
        trainer.step(8, fn); // agreed: every replica has samples
        if (m == mistake::bn_skipped_on_empty_shard)
            trainer.step(static_cast<std::size_t>(comm.size() - 1), fn); // the last shard empty
        else if (m == mistake::seed_per_replica)
            trainer.step(8, fn); // a step that agrees: only the seed differs
        else
            trainer.step(last ? 9 : 8, fn);
    } catch (const error& e) {
        out.threw = true;
        out.code = e.code();
        out.message = e.what();
    }
    return out;
}

/// Runs mistake m on this replica of comm (every replica calls it).
template <class Comm>
outcome run(Comm& comm, mistake m) {
    switch (m) {
    case mistake::global_batch_bucketed:
        return run_with<bn::global, reduce::bucketed<>>(comm, m);
    case mistake::global_batch_sharded:
        return run_with<bn::global, reduce::sharded<>>(comm, m);
    case mistake::global_batch_reproducible:
        return run_with<bn::ghost<4>, reduce::reproducible<4>>(comm, m);
    case mistake::bn_skipped_on_empty_shard:
    case mistake::seed_per_replica:
        return run_with<bn::global, reduce::bucketed<>>(comm, m);
    }
    return {};
}

} // namespace lockstep_test::mismatch

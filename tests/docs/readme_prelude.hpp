// tests/docs/readme_prelude.hpp: the names README.md's code fragments assume (a user's network
// `my_net`, its `factory`, `batches` and `step_fn`), so that every fragment compiles and links
// as written. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <lockstep/lockstep.hpp>

#include <cstddef>
#include <vector>

/// A network of one registered tensor (what the fragments' `my_net` stands for).
struct my_net {
    using context = lockstep::replica_context<float, lockstep::thread_communicator>;
    explicit my_net(context& ctx) : w(ctx.registry().add("w", {4})) {}
    template <class Batch, class Ctx>
    double loss_and_backward(const Batch&, const lockstep::shard_range& r, Ctx&) {
        for (float& g : w.grad())
            g += static_cast<float>(r.size() * r.scale);
        return 0.0;
    }
    lockstep::tensor_handle<float> w;
};

/// A global batch of samples.
struct readme_batch {
    std::size_t size() const noexcept { return 8; }
};
inline const std::vector<readme_batch> batches(3);

inline const auto factory = [](my_net::context& ctx) { return my_net(ctx); };
inline const auto step_fn = [](my_net& net, const lockstep::shard_range& r, my_net::context& ctx) {
    return net.loss_and_backward(readme_batch{}, r, ctx);
};

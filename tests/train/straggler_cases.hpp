// tests/train/straggler_cases.hpp: the run of the straggler tests (thread group and MPI): one
// replica sleeps a fixed delay inside every step, and every replica keeps the reports of
// train_params::report_stragglers_every. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "mlp_fixture.hpp"

#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <chrono>
#include <optional>
#include <thread>
#include <vector>

namespace lockstep_test {

/// The injected delay: long beside the test network's step (tens of microseconds), so the
/// report's 20 % tolerance covers a sleep's overshoot and a busy machine's wake-up latency.
inline constexpr std::chrono::milliseconds straggler_delay{50};

/// `steps` steps of 12 samples under data_parallel<mlp, sgd> on comm with report_stragglers_every
/// = every; replica `slow` sleeps straggler_delay in its step function at every step, replica
/// `slow_setup` sleeps `setup` between the trainer's construction and its first step. Returns
/// straggler() after each step.
template <class Comm>
std::vector<std::optional<straggler_report>>
run_straggler(Comm& comm, int slow, int steps, std::int64_t every, int slow_setup = -1,
              std::chrono::milliseconds setup = std::chrono::milliseconds(0)) {
    using net = mlp<float, Comm, storage::registry>;
    data_parallel<net, optim::sgd<float>, sync::synchronous, reduce::bucketed<>, Comm> dp(
        comm, [](auto& ctx) { return net(ctx); }, {.lr = 0.1}, {.report_stragglers_every = every});
    if (comm.rank() == slow_setup)
        std::this_thread::sleep_for(setup);
    std::vector<std::optional<straggler_report>> out;
    for (int k = 0; k < steps; ++k) {
        dp.step(12, [&](net& n, const shard_range& r, auto& ctx) {
            if (comm.rank() == slow)
                std::this_thread::sleep_for(straggler_delay);
            return n.train(r, ctx);
        });
        out.push_back(dp.straggler());
    }
    dp.finish();
    return out;
}

} // namespace lockstep_test

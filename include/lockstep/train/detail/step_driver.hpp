// lockstep/train/detail/step_driver.hpp: step_driver<SyncPolicy, ReducePolicy>, how one training
// step runs under a policy pair: the primary template is sync::synchronous with a reducer that
// sums whole gradients (reduce::per_tensor, bucketed, parameter_server, compressed); the
// specialisations are in sharded_driver.hpp, reproducible_driver.hpp and local_sgd_driver.hpp.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/detail/step_stages.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>

namespace lockstep::detail {

/// sync::synchronous over a reducer that leaves the summed gradient on every replica (or on
/// ReducePolicy::update_root alone). Every driver has this interface: constructed from the
/// trainer's stages (it refuses settings it cannot run, naming them), step() runs one step
/// through the stages, finish() ends training (collective, after the step counts agreed).
template <class SyncPolicy, class ReducePolicy>
class step_driver {
public:
    template <class Stages>
    explicit step_driver(Stages& /*s*/) {}

    /// One step of `global` samples: the gradient of the global batch's mean loss, summed over
    /// replicas while backward runs, then one update, identical on every replica.
    template <class Stages, class Fn>
    step_result step(Stages& s, std::size_t global, Fn& fn) {
        constexpr int root = ReducePolicy::update_root;
        const bool updates = root < 0 || s.rank() == root;
        const shard_extent all = s.core().optimizer_shard(); // every element
        s.begin(0);
        s.zero();
        s.start_reduction();
        const double loss = s.forward_backward(global, fn, false, true);
        s.finish_reduction();
        s.unscale();
        step_result r = s.open_result();
        s.report(loss, global, r.lr);
        s.freeze();
        if (updates) // parameter_server: only Root holds the reduced gradient
            s.hook();
        s.check(all);
        s.sum_status();
        s.decide(0, s.replicas());
        s.update_scale();
        s.count_skip(s.replicas());
        s.commit();
        s.set_lr(r.lr);
        // parameter_server: Root updates, then broadcasts; the others receive.
        s.reducer().apply(s.core().values(), [&] {
            s.clip(all);
            s.update(all);
        });
        return s.end(global, r);
    }

    template <class Stages>
    void finish(Stages& /*s*/) {}
};

} // namespace lockstep::detail

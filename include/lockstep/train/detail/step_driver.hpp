// lockstep/train/detail/step_driver.hpp: step_driver<SyncPolicy>, how one training step runs
// under a SyncPolicy, composing the ReducePolicy's collective (gradient_collective.hpp) with the
// policy-free stages (step_stages.hpp): the primary template is sync::synchronous; sync::local_sgd
// is in local_sgd_driver.hpp. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/detail/gradient_collective.hpp"
#include "lockstep/train/detail/step_stages.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>

namespace lockstep::detail {

/// sync::synchronous with any collective: the gradient of the global batch's mean loss, reduced
/// while backward runs, then one update, identical on every replica. Every driver has this
/// interface: constructed from the trainer's stages (it refuses settings it cannot run, naming
/// them), step(s, c, global, fn) runs one step of `global` samples through the stages and the
/// collective c, finish(s, c) ends training (collective, after the step counts agreed).
template <class SyncPolicy>
class step_driver {
public:
    template <class Stages>
    explicit step_driver(Stages& /*s*/) {}

    template <class Stages, class Collective, class Fn>
    requires gradient_collective<Collective, Stages> step_result step(Stages& s, Collective& c,
                                                                      std::size_t global, Fn& fn) {
        const double loss = c.gradient(s, global, fn); // begins the step; reduced as it runs
        s.unscale();
        step_result r = s.open_result();
        s.report(loss, global, r.lr);
        s.freeze();
        if (c.reduced_here(s.rank()))
            s.hook();
        c.agree(s); // the reduced gradient's checks; the status summed over replicas
        s.decide(0, s.replicas());
        s.update_scale();
        s.count_skip(s.replicas());
        s.commit(); // the layers keep or restore their state (bn::ghost: running statistics)
        s.set_lr(r.lr);
        c.update(s); // clipped and updated where the policy updates; values equal everywhere
        return s.end(global, r);
    }

    template <class Stages, class Collective>
    void finish(Stages& /*s*/, Collective& /*c*/) {}
};

} // namespace lockstep::detail

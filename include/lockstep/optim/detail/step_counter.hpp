// lockstep/optim/detail/step_counter.hpp: an optimizer's applied-step count and per-step
// scalars, kept in its system's memory. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/optim/detail/flat_layout.hpp"
#include "lockstep/system/buffer.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace lockstep::optim::detail {

/// The step state of an optimizer (kernels::step_state) in System memory, advanced by one
/// kernels::begin_step per step. The count is read and written by kernels only, so a step
/// whose skip flag is a device value needs no host synchronisation; the host reads it only
/// through applied() and writes it only through set_applied() (checkpoints).
template <class Rule, class System>
class step_counter {
public:
    using scalars_type = typename kernels::begin_step<Rule>::scalars_type;
    using state_type = kernels::step_state<scalars_type>;

    /// A count of 0 in sys's memory (allocated here, once: steps never allocate).
    explicit step_counter(const System& sys)
        : state_(to_system(std::vector<state_type>{state_type{}}, sys)) {}

    /// Enqueues the prologue of a step on sys: reads *skip there (skip null: never skip), and
    /// when the step is applied counts it and computes rule(t). ensures: noop() and state()
    /// describe this step for every pass enqueued after it.
    void begin(const System& sys, const int* skip, const Rule& rule) {
        kernels::for_each_index(sys, 1, kernels::begin_step<Rule>{state_.data(), skip, rule}, 1);
    }

    /// The drivers' noop flag: the step state's `skip` field, in System memory.
    const int* noop() const noexcept {
        // The address of the field without dereferencing the (possibly device) pointer.
        return reinterpret_cast<const int*>(reinterpret_cast<const char*>(state_.data()) +
                                            offsetof(state_type, skip));
    }
    /// The step state (System memory) the update functors read.
    const state_type* state() const noexcept { return state_.data(); }

    /// The number of applied steps. On a device system this is a synchronising copy of the
    /// device value (it waits for the steps enqueued so far): not meant for use inside a step.
    std::int64_t applied(const System& sys) const {
        state_type h{};
        lockstep::copy(state_.span(), sys, std::span<state_type>(&h, 1), host_system{1});
        return h.applied;
    }
    /// Sets the applied-step count (restoring a checkpoint); a synchronising copy on a device.
    /// requires: applied >= 0.
    void set_applied(const System& sys, std::int64_t applied) {
        state_type h{};
        h.applied = applied;
        lockstep::copy(std::span<const state_type>(&h, 1), host_system{1}, state_.span(), sys);
    }

private:
    buffer<state_type, System> state_;
};

} // namespace lockstep::optim::detail

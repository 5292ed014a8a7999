// lockstep/optim/detail/state_block.hpp: state_block, what every optimizer keeps (its params, its
// system, the flat layout over the parameter segments, named moment buffers and the applied-step
// counter) and the accessors they share. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/optim/detail/flat_layout.hpp"
#include "lockstep/optim/detail/step_counter.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::optim::detail {

/// The state block of an optimizer over a flat buffer of n parameters of type T in System memory:
/// params (Params, with a `lr` member), the flat layout over `segments`, Slots named moment
/// buffers of n elements each (zero at construction; a slot constructed absent holds nothing and
/// is not part of state()), and the applied-step counter with the optimizer's Rule (see
/// step_counter). An optimizer derives from it and adds its step(); the accessors below are the
/// optimizer concept's (optim/optimizer.hpp). `name` is the optimizer's name in error messages.
template <class T, class System, class Params, class Rule, std::size_t Slots>
class state_block {
public:
    using value_type = T;
    using system_type = System;
    using params_type = Params;

    double lr() const noexcept { return p_.lr; }
    /// Sets the learning rate of the next steps. requires: lr finite and >= 0.
    void set_lr(double lr) {
        check_param<T>((std::string(name_) + ".set_lr").c_str(), "lr", lr, 0.0);
        p_.lr = lr;
    }
    const Params& params() const noexcept { return p_; }
    const System& system() const noexcept { return sys_; }
    std::size_t size() const noexcept { return layout_.size(); }
    /// The number of applied steps. On a device system a synchronising read of the device
    /// count: not meant for use inside a step.
    std::int64_t step_count() const { return count_.applied(sys_); }
    const std::vector<tensor_segment>& segments() const noexcept { return layout_.segments(); }

    /// The checkpointable state: the step count (read as step_count() does) and the present
    /// slots by name, in slot order.
    state_view<T> state() { return view<T>(*this); }
    state_view<const T> state() const { return view<const T>(*this); }
    /// Restores a state saved by state() of an optimizer of the same kind, size and slots.
    /// Throws lockstep::error (checkpoint) when the slots do not match.
    void load_state(const state_view<const T>& saved) {
        count_.set_applied(
            sys_, load_slots((std::string(name_) + ".load_state").c_str(), saved, state(), sys_));
    }

protected:
    /// requires: every name outlives the block (string literals). present[k] false: slot k
    /// holds no memory.
    state_block(const char* name, std::array<const char*, Slots> slot_names,
                std::array<bool, Slots> present, std::size_t n, const Params& p, System sys,
                std::span<const tensor_segment> segments)
        : name_(name), slot_names_(slot_names), present_(present), p_(p), sys_(sys),
          layout_(n, segments, sys_, name), count_(sys_) {
        for (std::size_t k = 0; k < Slots; ++k)
            if (present_[k])
                slots_[k] = zeros<T>(n, sys_);
    }

    /// Moment buffer k (System memory; empty when absent).
    T* slot(std::size_t k) noexcept { return slots_[k].data(); }

    const char* name_;
    std::array<const char*, Slots> slot_names_;
    std::array<bool, Slots> present_;
    Params p_;
    System sys_;
    flat_layout<System> layout_;
    std::array<buffer<T, System>, Slots> slots_{};
    step_counter<Rule, System> count_;

private:
    template <class U, class Self>
    static state_view<U> view(Self& self) {
        state_view<U> s{self.step_count(), {}};
        for (std::size_t k = 0; k < Slots; ++k)
            if (self.present_[k])
                s.slots.push_back({self.slot_names_[k], self.slots_[k].span()});
        return s;
    }
};

} // namespace lockstep::optim::detail

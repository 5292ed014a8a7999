// lockstep/train/detail/step_rollback.hpp: step_rollback, the state a synchronous step changes,
// kept on the host from the step's start so that the survivors of a lost replica can compute the
// step again (train_params::on_replica_failure = shrink). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/nn/layer_step.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/detail/visitor.hpp"
#include "lockstep/train/loss_scaler.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// One copy of everything a step of the trainer over `Core` (replica_core) changes: the flat
/// parameters, the registry's and the network's state (BN running statistics), the optimizer's
/// buffers and step count, the step and sample counters and the seed, the loss scale, the skip
/// streak and the layers' host counters (num_batches_tracked). keep() replaces the copy; what
/// it costs in memory is one more copy of the parameters, the state and the optimizer buffers
/// (with Adam: three times the parameters), on the host.
template <class Core>
class step_rollback {
public:
    using T = typename Core::value_type;

    /// Copies the state of `core` before step core.steps() of `global` samples; `counts` are
    /// the layers' host counters the last step touched (those of step `layers_id`), `streak`
    /// the skip streak's doubles (in the system's memory).
    void keep(Core& core, std::size_t global, const loss_scaler_state& scale,
              std::span<const double> streak, const std::vector<nn::step_count>& counts,
              std::uint64_t layers_id) {
        const auto sys = core.comm().system();
        std::size_t k = 0;
        for_each_part(core, [&](std::span<T> part) {
            if (k == parts_.size())
                parts_.emplace_back();
            parts_[k].resize(part.size());
            copy(std::span<const T>(part), sys, std::span<T>(parts_[k]), host_system{1});
            ++k;
        });
        parts_.resize(k);
        streak_.resize(streak.size());
        copy(streak, sys, std::span<double>(streak_), host_system{1});
        counters_.clear();
        for (const nn::step_count& c : counts)
            counters_.emplace_back(c.counter, *c.counter);
        layers_id_ = layers_id;
        step_ = core.steps();
        samples_ = core.samples();
        seed_ = core.context().seed();
        optimizer_steps_ = core.optimizer().step_count();
        global_ = global;
        scale_ = scale;
    }

    /// The step whose start is kept (-1: none yet) and its global batch.
    std::int64_t step() const noexcept { return step_; }
    std::size_t global() const noexcept { return global_; }
    const loss_scaler_state& scale() const noexcept { return scale_; }
    std::span<const double> streak() const noexcept { return streak_; }

    /// Puts the kept state back into `core`. `counts`/`layers_id`: the layers' counters of the
    /// step begun last; when that step began after keep(), what it added to a counter keep()
    /// did not see is taken back too (the first step of a trainer). The loss scale and the skip
    /// streak are the caller's (scale(), streak()): they live in the step's stages.
    void restore(Core& core, const std::vector<nn::step_count>& counts,
                 std::uint64_t layers_id) const {
        const auto sys = core.comm().system();
        auto& opt = core.optimizer();
        const auto view = opt.state();
        std::size_t k = 0;
        for_each_part(core, [&](std::span<T> part) { // the optimizer's slots too, kept last
            copy(std::span<const T>(parts_[k]), host_system{1}, part, sys);
            ++k;
        });
        core.unpack_values();
        // load_state copies with the optimizer's system, so its source must be that system's
        // memory (a host vector on cuda_system would be read as device memory): the slots were
        // copied host -> system above, and load_state gets them in place (as a checkpoint's
        // restore does), which sets the step count and copies nothing.
        state_view<const T> saved{optimizer_steps_, {}};
        for (const auto& slot : view.slots)
            saved.slots.push_back({slot.name, std::span<const T>(slot.data)});
        opt.load_state(saved); // the step count
        core.restore_position(step_, samples_, seed_);
        for (const auto& [counter, value] : counters_)
            *counter = value;
        if (layers_id != layers_id_)
            for (const nn::step_count& c : counts)
                if (std::none_of(counters_.begin(), counters_.end(),
                                 [&](const auto& kept) { return kept.first == c.counter; }))
                    *c.counter -= c.added;
    }

private:
    /// f(span) over every tensor the step changes, in a fixed order.
    template <class F>
    static void for_each_part(Core& core, F&& f) {
        auto& reg = core.registry();
        f(core.values());
        f(reg.states());
        visit_state<T>(core.network(), [&](std::string_view, std::span<T> s) { f(s); });
        for (const auto& slot : core.optimizer().state().slots)
            f(slot.data);
    }

    std::vector<std::vector<T>> parts_;
    std::vector<double> streak_;
    std::vector<std::pair<std::int64_t*, std::int64_t>> counters_;
    std::uint64_t layers_id_ = 0;
    std::int64_t step_ = -1;
    std::uint64_t samples_ = 0;
    std::uint64_t seed_ = 0;
    std::int64_t optimizer_steps_ = 0;
    std::size_t global_ = 0;
    loss_scaler_state scale_{};
};

} // namespace lockstep::detail

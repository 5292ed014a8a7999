// lockstep/optim/detail/layerwise_block.hpp: layerwise_block, the state block of the layer-wise
// adaptive optimizers (LARS, LAMB): their per-segment norms, the norms' reduction over replicas
// and the per-segment trust ratios. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/optim/detail/state_block.hpp"
#include "lockstep/system/buffer.hpp"

#include <array>
#include <cstddef>
#include <functional>
#include <span>
#include <utility>

namespace lockstep::optim::detail {

/// A state_block whose step scales each segment s's learning rate by a trust ratio taken from
/// two norms of the segment: per step, a tile reduction of {||w_s||^2, ||x_s||^2} (x is the
/// optimizer's own: LARS's gradient, LAMB's update), accumulated in double in a fixed order per
/// segment, then the optional norm reduction (set_norm_reduction), then one per-segment pass
/// that writes the ratio and lr * ratio (trust_pass).
template <class T, class System, class Params, class Rule, std::size_t Slots>
class layerwise_block : public state_block<T, System, Params, Rule, Slots> {
    using base = state_block<T, System, Params, Rule, Slots>;

public:
    /// The per-segment norm reduction, for an optimizer whose segments are parts of tensors
    /// split over replicas (reduce::sharded): every step() (applied or skipped) calls f(norms)
    /// on the calling thread once the per-segment partial sums {||w_s||^2, ||x_s||^2} are in
    /// norms (segment_count() entries, System memory, on the system's stream; zero when the
    /// step is skipped) and before the trust ratios are taken from them; f must leave there the
    /// sums over the whole tensors (e.g. through an all_reduce), the same on every replica. An
    /// empty f (the default) uses the segment's own sums: the segments are whole tensors.
    void set_norm_reduction(std::function<void(std::span<kernels::sum_pair>)> f) {
        norm_reduction_ = std::move(f);
    }

    /// The trust ratio of every segment in the last applied step (1 before the first), System
    /// memory.
    std::span<const double> trust_ratios() const noexcept { return trust_.span(); }

protected:
    /// As state_block's constructor.
    layerwise_block(const char* name, std::array<const char*, Slots> slot_names,
                    std::array<bool, Slots> present, std::size_t n, Params p, System sys,
                    std::span<const tensor_segment> segments)
        : base(name, slot_names, present, n, p, sys, segments),
          partial_(this->layout_.tile_count(), this->sys_),
          norms_(this->layout_.segment_count(), this->sys_),
          scaled_lr_(this->layout_.segment_count(), this->sys_),
          trust_(zeros<double>(this->layout_.segment_count(), this->sys_, 1.0)) {}

    /// The norms of a step and the trust ratios from them, unless *noop: `norm` (a tile functor
    /// of flat_layout::reduce) sums {||w_s||^2, ||x_s||^2} per segment, the norm reduction (if
    /// any) runs, then `trust` (a segment functor with the members norms, flags, scaled_lr and
    /// trust_out, which this sets) writes every segment's ratio and scaled learning rate.
    template <class Norm, class Trust>
    void trust_pass(const Norm& norm, Trust trust, const int* noop) {
        this->layout_.reduce(this->sys_, norm, partial_, norms_.data(), noop);
        if (norm_reduction_)
            norm_reduction_(norms_.span());
        trust.norms = norms_.data();
        trust.flags = this->layout_.flags();
        trust.scaled_lr = scaled_lr_.data();
        trust.trust_out = trust_.data();
        this->layout_.for_each_segment(this->sys_, trust, noop);
    }

    /// lr * ratio of every segment after trust_pass (System memory).
    const double* scaled_lr() const noexcept { return scaled_lr_.data(); }

private:
    buffer<kernels::sum_pair, System> partial_, norms_;
    buffer<double, System> scaled_lr_, trust_;
    std::function<void(std::span<kernels::sum_pair>)> norm_reduction_;
};

} // namespace lockstep::optim::detail

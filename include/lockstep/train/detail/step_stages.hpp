// lockstep/train/detail/step_stages.hpp: step_stages, the named stages of a training step
// (begin, zero, forward/backward, unscale, report, freeze, hook, check, sum, decide, count skips,
// commit, clip, update, end), written once, knowing no policy, composed by the step drivers and
// the collectives.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/host_wait.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/optimizer_shard.hpp"
#include "lockstep/train/detail/replica_digest.hpp"
#include "lockstep/train/detail/step_checks.hpp"
#include "lockstep/train/detail/step_report.hpp"
#include "lockstep/train/loss_scaler.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/step_state.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <thrust/fill.h>

namespace lockstep::detail {

/// forward_backward's `ready` when nothing happens as tensors become ready (local SGD).
struct no_ready_hook {};

/// The stages a step driver and a collective compose, each a call into the file that does the
/// work, over one replica's core (network, context, optimizer, flat buffers: replica_core.hpp).
/// Owns what the stages share: the step's state (step_state.hpp), the skip flag the optimizer
/// kernels read, the gradient checks (step_checks.hpp), the host read of the state, the loss
/// scaler (loss_scaler.hpp), the step as the layers see it (nn/layer_step.hpp) and the gradient
/// hook. Nothing here knows which policy runs: the drivers and collectives say which stages run,
/// in which order, over which elements.
template <class Core>
class step_stages {
public:
    using T = typename Core::value_type;
    using system_type = typename Core::system_type;
    using gradient_hook = std::function<void(std::span<T>, std::span<const tensor_info>)>;

    /// `plan`: the collective's reduction pieces (each checked for NaN/inf on its own);
    /// `collective_doubles`: the doubles per replica the collective keeps in the step's status.
    step_stages(Core& core, const std::vector<bucket>& plan, std::size_t collective_doubles)
        : core_(core), state_(core.comm().size(), collective_doubles, core.comm().system()),
          skip_(1, core.comm().system()),
          checks_(plan, core.registry().grads().size(), core.comm().system()),
          read_(state_.memory().size(), core.comm().system()),
          scaler_(core.params().loss_scale, core.comm().system(), core.comm().rank()) {}
    step_stages(const step_stages&) = delete;
    step_stages& operator=(const step_stages&) = delete;

    Core& core() noexcept { return core_; }
    /// The gradient checks, the step's state and the layers' step (for a collective's stages).
    gradient_checks<system_type>& checks() noexcept { return checks_; }
    step_view view() noexcept { return state_.view(); }
    nn::layer_step& layers() noexcept { return layer_step_; }
    loss_scaler<system_type>& scaler() noexcept { return scaler_; }
    system_type system() { return core_.comm().system(); }
    int rank() { return core_.comm().rank(); }
    int replicas() { return core_.comm().size(); }

    // --- the stages, in the order of a synchronous step ---

    /// Resets the step's state, begins the layers' step (their reports go into it; ghost_global:
    /// a reproducible step's global batch, else 0) and gives ctx the step's loss scale.
    step_view begin(std::size_t ghost_global) {
        state_.reset(system());
        const step_view v = state_.view();
        layer_step_.begin(&v.outcome->first_error, &v.totals->layer_errors, skip_.data(),
                          ghost_global, capturing_);
        core_.context().set_loss_scale(scaler_.scale_device(), host_loss_scale());
        return v;
    }

    /// Zeroes the gradients.
    void zero() { core_.zero_grads(); }

    /// Forward and backward: fn over this replica's part of every micro-batch, the loss into the
    /// state's totals (replica_core::run_micro_batches). `own_scale`: local SGD's scale.
    /// `ready(t)`: with a registry network, what ctx.mark_ready(t) does in the last backward (a
    /// collective launches its pieces; no_ready_hook: nothing).
    template <class Fn, class Ready>
    double forward_backward(std::size_t global, Fn& fn, bool own_scale, Ready&& ready) {
        auto& ctx = core_.context();
        const step_scope scope(ctx, &state_.view().totals->loss, &layer_step_);
        return core_.run_micro_batches(global, fn, own_scale, [&] {
            if constexpr (!Core::uses_visitor &&
                          !std::is_same_v<std::remove_cvref_t<Ready>, no_ready_hook>)
                ctx.set_ready_hook(std::forward<Ready>(ready));
        });
    }

    /// The network's gradients into the flat buffer (visitor networks; else nothing).
    void pack_gradients() { core_.pack_grads(); }

    /// Each piece of `plan`'s NaN/inf count when no collective launched it (local SGD).
    void check_pieces(const std::vector<bucket>& plan) {
        for (std::size_t k = 0; k < plan.size(); ++k)
            checks_.check_piece(system(), std::span<const T>(core_.grads()), k, plan[k]);
    }

    /// grads *= 1 / loss scale (loss scaling on).
    void unscale() { scaler_.unscale(core_.grads()); }

    /// The step's index and learning rate.
    step_result open_result() {
        step_result r;
        r.step = core_.steps();
        r.lr = core_.lr_for(r.step);
        return r;
    }

    /// This replica's row (global_batch, lr, the trainer's ordinal on the communicator, the
    /// step's first sample, the loss scale, the parameters' digest when digest_parameters() asked
    /// for it, its non-finite count and first index, a non-finite loss) and its part of the
    /// totals, from the pieces' checks.
    void report(double host_loss, std::size_t global, double lr) {
        const step_view v = state_.view();
        checks_.finish_local(
            system(), host_loss, static_cast<double>(global), lr, v.totals, &v.rows[rank()],
            rider_ != nullptr ? rider_->word() : save_word{}, static_cast<double>(core_.ordinal()),
            static_cast<double>(core_.samples()), scaler_.state_device(), start_digest());
    }

    /// The gradients of frozen tensors are zeroed (train_params::frozen).
    void freeze() { core_.zero_frozen_grads(); }

    /// The user's gradient hook (set_gradient_hook), over the flat gradient.
    void hook() {
        if (gradient_hook_)
            gradient_hook_(core_.grads(),
                           std::span<const tensor_info>(core_.registry().parameters()));
    }

    /// The reduced gradient's non-finite count, first index and (with clipping) squared norm
    /// over the optimizer's elements `own` (all, or this replica's shard).
    void check(shard_extent own) {
        checks_.check_reduced(system(), std::span<const T>(core_.grads()), own.offset,
                              own.offset + own.count, core_.params().max_grad_norm > 0,
                              state_.view().outcome);
    }

    /// Whether check(all) would read the gradient as the collective left it and count only its
    /// non-finite elements: no loss scaling (unscale leaves it), no gradient hook and no
    /// clipping (no squared norm). Zeroing frozen tensors keeps a finite gradient finite.
    bool checks_reduced_as_left() const {
        return !scaler_.enabled() && !gradient_hook_ && !(core_.params().max_grad_norm > 0);
    }
    /// [C] The status all_reduce: the rows and totals summed over replicas, so every replica
    /// takes the same skip decision, and the gradient factor from the same norm.
    void sum_status() {
        const std::span<double> reduced = state_.reduced();
        core_.comm().all_reduce(std::span<const double>(reduced), reduced, reduce_op::sum);
    }

    /// The skip decision and the gradient factor (one task), from the totals and the rows of
    /// `replicas` replicas starting at `first_row` (all of them, or this replica's alone).
    void decide(int first_row, int replicas) {
        const step_view v = state_.view();
        kernels::for_each_index(system(), 1,
                                decide_skip_fn{v.totals, v.outcome, &v.rows[first_row], replicas,
                                               skip_.data(), core_.params().max_grad_norm});
    }

    /// The loss scale's update from the step's outcome (one task).
    void update_scale() {
        const step_view v = state_.view();
        scaler_.update(&v.outcome->overflow, &v.outcome->skip, v.scale_report);
    }

    /// The run of skipped steps (train_params::max_consecutive_skips), from the skip decision
    /// and the loss scale's report (after update_scale), over the rows of `replicas` replicas
    /// (one task; the host reads it with the step's state).
    void count_skip(int replicas) {
        const step_view v = state_.view();
        const loss_scaling& sc = scaler_.config();
        kernels::for_each_index(
            system(), 1,
            count_skip_fn{.totals = v.totals,
                          .outcome = v.outcome,
                          .rows = v.rows,
                          .replicas = replicas,
                          .scale_report = v.scale_report,
                          .streak = v.streak,
                          .cause = v.cause,
                          .limit = static_cast<double>(core_.params().max_consecutive_skips),
                          .scaling = scaler_.enabled(),
                          .floor = sc.min_scale});
    }

    /// The layers that joined the step keep or restore their state (the skip flag).
    void commit() { layer_step_.commit(); }

    /// The optimizer's learning rate for this step.
    void set_lr(double lr) { core_.optimizer().set_lr(lr); }

    /// The gradient factor (clipping) over the elements `own`, unless skipped (on the device).
    void clip(shard_extent own) {
        if (core_.params().max_grad_norm > 0)
            apply_grad_factor(system(), core_.grads().subspan(own.offset, own.count),
                              &state_.view().outcome->grad_factor, skip_.data());
    }

    /// The optimizer over the elements `own` of the values, unless skipped (the kernels read
    /// the flag).
    void update(shard_extent own) {
        core_.optimizer().step(core_.values().subspan(own.offset, own.count),
                               std::span<const T>(core_.grads().subspan(own.offset, own.count)),
                               skip_.data());
    }

    /// The flat values back into the network (visitor networks), the step and sample counts
    /// advanced, and the read of the state queued; with train_params::read_result it is waited
    /// for and the step's errors thrown. While capturing: the read is part of the graph (each
    /// launch repeats it); nothing waits and last() stays the last step that ran.
    step_result end(std::size_t global, step_result r) {
        core_.unpack_values();
        core_.advance(global);
        read_.enqueue(state_.memory());
        r.ready = false;
        if (capturing_)
            return r;
        last_ = r;
        unread_ = true;
        has_last_ = true;
        last_replayed_ = false;
        if (core_.params().read_result)
            return finish_result(r);
        return r;
    }

    // --- after the step ---

    /// True when every replica's row of the step st is this trainer's (its ordinal).
    bool rows_of_this_trainer(const step_view& st) const noexcept {
        for (int r = 0; r < st.replicas; ++r)
            if (st.rows[r].trainer != static_cast<double>(core_.ordinal()))
                return false;
        return true;
    }

    /// Waits for the state read of step r, fills r and throws the step's errors.
    step_result finish_result(step_result r) {
        const step_view st = state_.view_of(wait_for(core_.comm(), read_, "data_parallel.step"));
        unread_ = false;
        // A step the replicas disagreed on consumed no samples: every replica goes on from
        // replica 0's first sample of it (each had advanced by its own global_batch), when every
        // row is this trainer's (else row 0's count is another trainer's). A graph's launch
        // carries the first sample of the captured step: its samples() stand.
        if (st.outcome->mismatch != 0 && !last_replayed_ && rows_of_this_trainer(st))
            core_.resume_samples_at(static_cast<std::uint64_t>(st.rows[0].first_sample));
        skipped_ = static_cast<std::int64_t>(st.streak->skipped);
        r.loss = st.totals->loss;
        r.skipped = st.outcome->skip != 0;
        r.loss_scale = scaler_.observe(*st.scale_report, r.step + 1 == core_.steps()).used;
        r.ready = true;
        step_report(st, rank(), r.step, std::span<const tensor_info>(core_.registry().parameters()),
                    {.local_sgd = local_sgd_,
                     .skip_non_finite = core_.params().skip_non_finite,
                     .loss_scaling = scaler_.enabled(),
                     .min_scale = scaler_.config().min_scale,
                     .micro_batches = core_.params().micro_batches})
            .throw_errors();
        // Only a step that returns its result observes the rows: an event a throwing step would
        // take is reported by a later step's result (or thrown by resolve()), never lost.
        if (rider_ != nullptr)
            r.checkpoint = rider_->observe(
                std::span<const replica_row>(st.rows, static_cast<std::size_t>(replicas())));
        return r;
    }

    /// What the layers counted on the host in the last step (nn::layer_step::count): a captured
    /// step's amounts, which each counted launch adds (count_replay).
    const std::vector<nn::step_count>& layer_counts() const noexcept {
        return layer_step_.counts();
    }

    /// The last step that ran (or launch counted), and setting it (count_replay).
    const step_result& last() const noexcept { return last_; }
    /// True once a step ran (or a launch was counted) through these stages: a trainer that
    /// resumed from a checkpoint, or rebuilt after a shrink, has a step count but no step here.
    bool has_last() const noexcept { return has_last_; }
    void set_last(const step_result& r) noexcept {
        last_ = r;
        unread_ = true;
        has_last_ = true;
        last_replayed_ = true;
    }
    /// Forgets the last step (a checkpoint load replaced the state it ran on): read_result()
    /// then refuses as in a trainer that took no step yet.
    void forget_last() noexcept {
        unread_ = false;
        has_last_ = false;
    }
    /// True when the last step's (or launch's) state was not read yet (read_result = false).
    bool unread() const noexcept { return unread_; }
    /// Skipped steps since the trainer was built, as of the last read of a step's state.
    std::int64_t skipped_steps() const noexcept { return skipped_; }

    void set_gradient_hook(gradient_hook f) { gradient_hook_ = std::move(f); }
    /// The next step's row carries the parameters' digest (replica_digest.hpp: one pass over the
    /// values on the device, no host wait), which every replica compares like lr: for the
    /// trainer's first step, where the replicas must start from replica 0's broadcast values.
    void digest_parameters() noexcept { digest_next_ = true; }
    const gradient_hook& gradient_hook_function() const noexcept { return gradient_hook_; }
    /// The skip streak in the system's memory (it lasts across steps), and putting a host copy
    /// of one back (a step computed again after a shrink; skipped_steps() follows it).
    std::span<double> streak() noexcept { return state_.streak(); }
    void restore_streak(std::span<const double> host) {
        copy(host, host_system{1}, state_.streak(), system());
        skipped_ =
            static_cast<std::int64_t>(reinterpret_cast<const skip_streak*>(host.data())->skipped);
    }
    /// True while a step is being recorded into a CUDA graph.
    void set_capturing(bool c) noexcept { capturing_ = c; }
    /// Local SGD: the rows are this replica's own (the error texts say so).
    void set_local_sgd(bool l) noexcept { local_sgd_ = l; }
    /// What rides on each step's status (a background checkpoint save; null: nothing).
    void set_rider(status_rider* r) noexcept { rider_ = r; }

private:
    /// What ctx.loss_scale() answers in this step: the scale the host knows, except while
    /// capturing with loss scaling (a launch runs with the scale then in device memory, which
    /// the host value at the capture would freeze into the graph).
    std::optional<double> host_loss_scale() const {
        if (capturing_ && scaler_.enabled())
            return std::nullopt;
        return scaler_.known_scale();
    }

    Core& core_;
    step_state<system_type> state_;
    buffer<int, system_type> skip_; ///< 1: the optimizer kernels skip the update
    gradient_checks<system_type> checks_;
    staged_read<double, system_type> read_;
    loss_scaler<system_type> scaler_;
    nn::layer_step layer_step_;
    gradient_hook gradient_hook_;
    bool digest_next_ = false;
    /// The parameters' digest of the step that asked for it (kept until its row is read).
    std::optional<section_digests<system_type, T>> start_digest_;

    /// The digest for this step's row (enqueued now) when digest_parameters() asked, else null.
    const std::int64_t* start_digest() {
        if (!digest_next_)
            return nullptr;
        digest_next_ = false;
        start_digest_.emplace(system(), std::vector<consistency_section<T>>{
                                            {"param", std::span<const T>(core_.values())}});
        start_digest_->enqueue();
        return start_digest_->digests().data();
    }
    status_rider* rider_ = nullptr;
    step_result last_{};
    std::int64_t skipped_ = 0;
    bool unread_ = false;
    bool has_last_ = false;
    bool last_replayed_ = false; ///< the last result is a graph launch's (set_last)
    bool capturing_ = false;
    bool local_sgd_ = false;
};

} // namespace lockstep::detail

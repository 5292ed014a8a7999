// lockstep/nn/detail/bn_training.hpp: bn_training, nn::batch_norm's training passes and the
// running statistics kept with a trainer's step. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/bn_statistics.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/nn/batch_norm_params.hpp"
#include "lockstep/nn/detail/bn_agreement.hpp"
#include "lockstep/nn/detail/bn_exchange.hpp"
#include "lockstep/nn/detail/bn_parameters.hpp"
#include "lockstep/nn/detail/bn_state.hpp"
#include "lockstep/nn/detail/bn_status.hpp"
#include "lockstep/nn/detail/ghost_statistics.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/nn/layout.hpp"
#include "lockstep/nn/policy_declaration.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/system/buffer.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <variant>

namespace lockstep::nn::detail {

/// The base of nn::batch_norm (whose comment states the layer's contract): the layer's state,
/// its training passes (train_forward, train_backward) and the running statistics kept aside
/// for a trainer's step, restored at the step's commit when the step is skipped.
template <class T, bn_stat_policy Policy, tensor_layout Layout, class System>
class bn_training : private step_participant {
protected:
    using param_type = kernels::accumulation_t<T>;
    using params = batch_norm_params;
    using parameter_spans = batch_norm_spans<param_type>;
    using traits = bn::traits<Policy>;

    /// The layer's state for `channels` channels, its parameters bound (bind_parameters); the
    /// running statistics are left to the layer's reset_running_stats.
    bn_training(std::size_t channels, parameter_spans ext, params p, System sys, bool owning,
                int rank)
        : p_(p), owner_(rank), s_(detail::validated_channels<param_type>(channels, p, rank), sys),
          agreement_(traits::name(), channels, p) {
        detail::bind_parameters(s_, p, owning ? nullptr : &ext, rank);
    }

    /// Refuses a call from another replica than the layer's (detail::replica_owner) before the
    /// call touches the layer; a peer waiting in a collective learns of it from thread_group.
    void claim(int rank, const char* op) {
        owner_.claim(rank, op, [&] {
            return lockstep::detail::concat(bn::traits<Policy>::name(), ", ", s_.channels,
                                            " channels");
        });
    }

    /// The communicator form inside a trainer's step function (nn::layer_step::running): the
    /// running statistics would not follow the step's skip decision and bn::ghost would act as
    /// bn::local, silently. Every replica makes the same call, so every replica throws here.
    template <communicator Comm>
    void refuse_inside_step(const Comm& comm, const char* call, const char* use) const {
        if (layer_step::running() == nullptr)
            return;
        fail(errc::invalid_argument, comm.rank(), std::string("batch_norm.") + call,
             "called with a communicator inside a data_parallel step (", bn::traits<Policy>::name(),
             ", ", s_.channels, " channels): pass the step function's context instead, bn.", use,
             ", so the layer's running statistics follow the step's skip decision, its errors "
             "go into the step and bn::ghost normalizes the step's chunks (a communicator cannot "
             "carry the step)");
    }

    template <communicator Comm>
    void train_forward(Comm& comm, layer_step* step, const policy_declaration* declared,
                       std::span<const T> x, const tensor_shape& shape, std::span<T> y) {
        static constexpr const char* op = "batch_norm.forward_train";
        const int rank = comm.rank();
        claim(rank, op);
        if (declared != nullptr) {
            declared->check(bn_facts_of<Policy>(), bn::traits<Policy>::name(), rank, op);
            declared->check_momentum(p_.momentum, rank, op);
        }
        detail::check_system(s_.sys, comm, op);
        // Outside a step the layer's error is read back after the all_gather: its pinned host
        // side is allocated before the collective is enqueued (cudaMallocHost between enqueue
        // and wait can deadlock with another thread's NCCL call).
        if (step == nullptr)
            (void)status_.errors(s_.sys);
        std::string problem = detail::check_input<Layout>(s_.channels, x.size(), shape, y.size());
        errc code = errc::shape_mismatch;
        if (problem.empty()) { // y would overwrite the x that backward reads again
            problem = lockstep::detail::overlap_problem(x, "x", y, "y");
            code = errc::invalid_argument;
        }
        forward_ = forward_state::none;
        if constexpr (!bn::communicates<Policy>) {
            if (!problem.empty())
                fail(code, rank, op, problem);
        }
        if constexpr (traits::running_replica >= 0) {
            LOCKSTEP_REQUIRE(traits::running_replica < comm.size(), errc::invalid_argument, rank,
                             op, "bn::tower<", traits::running_replica, "> needs more than ",
                             traits::running_replica, " replicas, the communicator has ",
                             comm.size());
        }
        // The replicas sharing the statistics built their layers alike (once per layer, before
        // its first statistics collective; bn::ghost checks before its step-end gather).
        if (step != nullptr && !agreement_.done())
            agreement_.set_layer(step->next_layer()); // its name in the check's error
        if constexpr (bn::communicates<Policy>)
            exchange_.agree(comm, agreement_, op);
        const kernels::channel_geometry g = problem.empty()
                                                ? Layout::geometry(shape)
                                                : kernels::channel_geometry{0, s_.channels, 1};
        const std::span<const T> xs = problem.empty() ? x : std::span<const T>{};
        if constexpr (!bn::communicates<Policy>) {
            LOCKSTEP_REQUIRE(
                g.per_channel() != 1, errc::invalid_argument, rank, op,
                "expected more than 1 value per channel when training, got input ", shape,
                bn::is_ghost<Policy>
                    ? lockstep::detail::concat(
                          " (a chunk of bn::ghost<", bn::ghost_chunk<Policy>,
                          ">: a global batch of k x ", bn::ghost_chunk<Policy>,
                          " + 1 leaves one sample in its last chunk; choose the "
                          "global batch or ChunkSamples so that none does)")
                    : lockstep::detail::concat(
                          ", 1 value per channel (", bn::traits<Policy>::name(),
                          " normalizes each replica's values alone: in a trainer, raise "
                          "global_batch, lower micro_batches or the replica count (",
                          comm.size(), "), or use a BN policy that shares statistics)"));
        }
        kernels::pack_local_moments(s_.sys, xs, g, param_type(problem.empty() ? 0 : 1),
                                    s_.block.span(), workspace(g));
        detail::forward_blocks<param_type> f = exchange_.forward(
            comm, step, std::span<const param_type>(s_.block.span()), s_.gathered, s_.sys);
        if (!problem.empty())
            fail(code, rank, op, problem);
        // bn::ghost inside a reproducible step: no running update here; the chunk's block is
        // kept and every chunk of the step is applied in global order at its end.
        bool ghost_step = false;
        if constexpr (bn::is_ghost<Policy>) {
            ghost_step = step != nullptr && step->ghost_global() != 0;
            if (ghost_step) {
                f.running_first = 0;
                f.running_last = 0;
            }
        }
        // Outside a step the running statistics are kept too, and restored when the status check
        // below throws: every replica then leaves them as they were (a peer's bad input leaves
        // this replica's valid blocks unapplied).
        const bool keep = step == nullptr ? keep_outside_step() : keep_running_statistics(step);
        forward_index_ = step != nullptr ? step->next_layer() : -1;
        const kernels::layer_report report =
            step != nullptr ? step->next_report() : kernels::layer_report{s_.own_error()};
        // The statistics finished and y normalized (one launch on the CUDA system).
        kernels::finish_and_normalize(
            s_.sys,
            kernels::finish_statistics_fn<param_type>{
                .blocks = f.blocks,
                .stride = kernels::packed_moments::size(s_.channels),
                .count_blocks = f.count,
                .self = f.self,
                .running_first = f.running_first,
                .running_last = f.running_last,
                .normalize_merged = traits::normalizes_across_replicas,
                .world_offset = f.world_offset,
                .gamma = s_.gamma.data(),
                .eps = static_cast<param_type>(p_.eps),
                .momentum = static_cast<param_type>(p_.momentum),
                .mean = s_.batch_mean().data(),
                .invstd = s_.batch_invstd().data(),
                .scale = s_.batch_scale().data(),
                .running_mean = s_.running_mean().data(),
                .running_var = s_.running_var().data(),
                .count = s_.normalization_count(),
                .report = report,
                .kept_mean = keep ? kept_running_.data() : nullptr,
                .kept_var = keep ? kept_running_.data() + s_.channels : nullptr},
            xs, y.first(xs.size()), g, std::span<const param_type>(s_.beta));
        if (step == nullptr) { // y is written, its values unspecified, when this throws
            try {
                status_.throw_error(comm, s_.sys, s_.own_error(), op, shape);
            } catch (...) {
                restore_running(nullptr);
                throw;
            }
        }
        if constexpr (bn::is_ghost<Policy>) {
            if (ghost_step)
                ghost_.record(comm, *step, std::span<const param_type>(s_.block.span()),
                              !xs.empty(), s_.sys, agreement_);
            else
                count_batches(step, 1);
        } else {
            count_batches(step, 1);
        }
        forward_comm_ = detail::forward_communicator::of(comm);
        saved_x_ = x;
        saved_geometry_ = g;
        forward_ = forward_state::pending;
    }

    template <communicator Comm>
    void train_backward(Comm& comm, layer_step* step, const policy_declaration* declared,
                        std::span<const T> dy, std::span<T> dx) {
        static constexpr const char* op = "batch_norm.backward";
        const int rank = comm.rank();
        claim(rank, op);
        if (declared != nullptr)
            declared->check(bn_facts_of<Policy>(), bn::traits<Policy>::name(), rank, op);
        detail::check_system(s_.sys, comm, op);
        std::string problem;
        errc code = errc::shape_mismatch;
        if (forward_ == forward_state::none) {
            problem = "backward needs a preceding forward_train on this replica";
        } else if (forward_ == forward_state::used) {
            // The layer as the step's errors and the settings check name it.
            problem = lockstep::detail::concat(
                "backward needs a forward_train of its own, the layer's last one (",
                forward_index_ >= 0 ? lockstep::detail::concat("batch_norm layer ", forward_index_,
                                                               " in forward order, ")
                                    : std::string(),
                bn::traits<Policy>::name(), ", ", s_.channels,
                " channels) was taken by a backward already: one layer object per use (a shared "
                "branch needs its own layer or its own forward before each backward)");
            code = errc::invalid_argument;
        } else if (dy.size() != saved_x_.size() || dx.size() != saved_x_.size()) {
            problem = lockstep::detail::concat("dy has ", dy.size(), " values and dx ", dx.size(),
                                               ", the forward input had ", saved_x_.size());
        }
        if (problem.empty()) {
            problem = kernels::detail::gradient_overlap(dy, saved_x_, dx);
            if constexpr (traits::normalizes_across_replicas) {
                if (problem.empty())
                    problem = forward_comm_.problem(comm);
            }
            code = errc::invalid_argument;
        }
        if (problem.empty()) // each backward takes its forward's saved input and statistics
            forward_ = forward_state::used;
        if constexpr (!traits::normalizes_across_replicas) {
            if (!problem.empty())
                fail(code, rank, op, problem);
        }
        const std::size_t C = s_.channels;
        const kernels::channel_geometry g =
            problem.empty() ? saved_geometry_ : kernels::channel_geometry{0, C, 1};
        const std::span<const T> dys = problem.empty() ? dy : std::span<const T>{};
        const std::span<const T> xs = problem.empty() ? saved_x_ : std::span<const T>{};
        std::span<param_type> local = s_.local_sums();
        kernels::pack_backward_sums(s_.sys, dys, xs, g,
                                    std::span<const param_type>(s_.batch_mean()),
                                    param_type(problem.empty() ? 0 : 1), local, workspace(g));
        const param_type* totals = local.data();
        if constexpr (traits::normalizes_across_replicas) {
            std::span<param_type> combined = s_.combined_sums();
            if (step == nullptr)
                (void)status_.sums(s_.sys); // allocated before the enqueue, as in forward_train
            try {
                exchange_.backward(comm, step, std::span<const param_type>(local), combined);
            } catch (const error&) {
                // This replica's own diagnosis is the root cause: without a forward it meets its
                // peers' forward all_gather, which the communicator reports as a mismatch.
                if (problem.empty())
                    throw;
                fail(code, rank, op, problem);
            }
            if (!problem.empty())
                fail(code, rank, op, problem);
            // Inside a trainer's step the replica with invalid gradients throws and its peers
            // learn of it from their next collective; outside, they check the status now.
            if (step == nullptr) {
                status_.sums(s_.sys).enqueue(std::span<const param_type>(combined.last(1)));
                const param_type failed = wait_for(comm, status_.sums(s_.sys), op)[0];
                LOCKSTEP_REQUIRE(failed == 0, errc::peer_failure, rank, op, failed,
                                 " other replica(s) passed invalid gradients to this layer");
            }
            totals = combined.data();
        }
        kernels::input_gradient_fused(
            s_.sys, dys, xs, dx.first(dys.size()), g, std::span<const param_type>(totals, 2 * C),
            std::span<const param_type>(local.first(2 * C)), s_.normalization_count(),
            std::span<const param_type>(s_.gamma), std::span<const param_type>(s_.batch_mean()),
            std::span<const param_type>(s_.batch_invstd()),
            p_.affine ? s_.dgamma : std::span<param_type>{},
            p_.affine ? s_.dbeta : std::span<param_type>{});
    }

    /// The kernels' workspace for geometry g: shared by the forward and backward passes, zeroed
    /// whenever it is (re)allocated (the CUDA kernels' arrival counters at its start must start
    /// at zero; the kernels leave them at zero, so it is never cleared again).
    std::span<std::byte> workspace(const kernels::channel_geometry& g) {
        const std::size_t bytes = kernels::bn_workspace_bytes<T, param_type>(g);
        if (s_.workspace.size() < bytes) {
            s_.workspace = buffer<std::byte, System>(bytes, s_.sys);
            detail::fill(s_.sys, s_.workspace.span(), std::byte{0});
        }
        return s_.workspace.span().first(bytes);
    }

    /// Inside a trainer's step: on the layer's first forward of the step, joins the step and
    /// returns true: that forward's finish keeps the running statistics aside (kept_running_,
    /// on the device) before it updates them, and the step's commit (commit_step) restores them
    /// when the trainer's skip flag is set, so a skipped step leaves them as they were.
    /// num_batches_tracked (a host count) counts every training forward (count_batches).
    bool keep_running_statistics(layer_step* step) {
        if (step == nullptr || step->id() == kept_step_)
            return false;
        kept_step_ = step->id();
        const std::size_t n = s_.running.size();
        if (kept_running_.size() != n)
            kept_running_ = buffer<param_type, System>(n, s_.sys);
        if constexpr (bn::is_ghost<Policy>)
            ghost_.begin_step();
        joined_ = step;
        step->join(*this);
        // running_mean then running_var: a checkpoint refuses to leave them out.
        step->keeps(layer_state{step->next_layer(), &bn::traits<Policy>::name, s_.channels,
                                s_.running_mean().data(), 2 * s_.channels * sizeof(param_type),
                                sizeof(param_type)});
        return true;
    }

    /// Outside a step: the running statistics are kept before the forward's update
    /// (kept_running_), so that restore_running can undo it when the layer's check throws.
    bool keep_outside_step() {
        const std::size_t n = s_.running.size();
        if (kept_running_.size() != n)
            kept_running_ = buffer<param_type, System>(n, s_.sys);
        kept_step_ = 0; // no step's copy any more
        return true;
    }
    /// running statistics = the kept copy when skip is null or *skip != 0 (read on the device).
    void restore_running(const int* skip) {
        kernels::for_each_index(
            s_.sys, s_.running.size(),
            detail::copy_if_fn<param_type>{kept_running_.data(), s_.running.data(), skip},
            s_.running.size());
    }

    /// The step's commit (step_participant): a reproducible step's bn::ghost layer first
    /// applies the step's chunks (ghost_statistics::finish, collective) and counts them; then
    /// the running statistics = the kept copy when *skip != 0 (read on the device).
    void commit_step(const int* skip) override {
        if constexpr (bn::is_ghost<Policy>) {
            if (ghost_.pending())
                count_batches(joined_,
                              ghost_.finish({.mean = s_.running_mean(),
                                             .var = s_.running_var(),
                                             .momentum = static_cast<param_type>(p_.momentum)}));
        }
        restore_running(skip);
    }

    /// num_batches_tracked += n: inside a trainer's step through it (layer_step::count), so that
    /// each launch of a step captured into a CUDA graph counts as the plain step does
    /// (data_parallel::count_replay adds what the capture recorded); outside a step at once.
    void count_batches(layer_step* step, std::int64_t n) {
        if (step != nullptr)
            step->count(batches_, n);
        else
            batches_ += n;
    }

    params p_;
    detail::replica_owner owner_; ///< the replica whose calls the layer takes
    detail::bn_state<param_type, System> s_;
    std::int64_t batches_ = 0;
    buffer<param_type, System> kept_running_; ///< running statistics before this step
    std::uint64_t kept_step_ = 0;             ///< the step (layer_step::id) they belong to
    std::span<const T> saved_x_{};
    kernels::channel_geometry saved_geometry_{};
    detail::forward_communicator forward_comm_; ///< what the last forward_train ran on
    /// Whether backward has a forward_train to differentiate: none (or the last one failed), one
    /// pending, or the last one already used by a backward (saved_x_ and the batch statistics
    /// belong to it, so a second backward would silently pair them with another dy).
    enum class forward_state { none, pending, used } forward_ = forward_state::none;
    int forward_index_ = -1; ///< the last forward's layer number in its step (-1: outside one)
    layer_step* joined_ = nullptr; ///< the step whose commit restores them
    detail::statistics_exchange<Policy, param_type, System> exchange_;
    detail::layer_status<param_type, System> status_; ///< reads outside a step
    detail::settings_agreement agreement_;            ///< the settings check, once per layer
    /// bn::ghost: the step's chunk statistics (nothing under the other policies).
    [[no_unique_address]] std::conditional_t<
        bn::is_ghost<Policy>, detail::ghost_statistics<bn::ghost_chunk<Policy>, param_type, System>,
        std::monostate>
        ghost_;
};

} // namespace lockstep::nn::detail

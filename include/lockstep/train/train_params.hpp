// lockstep/train/train_params.hpp: train_params (the trainer's runtime knobs) and step_result.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/loss_scaler.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstdint>
#include <functional>
#include <optional>

namespace lockstep {

/// Whether gradient buckets are reduced on a communication stream while backward goes on
/// (train_params::overlap).
enum class overlap_mode {
    /// Where it pays: NCCL (a side stream), MPI across nodes (a communication thread, when MPI
    /// provides MPI_THREAD_MULTIPLE), communicators whose collectives do not use the compute
    /// cores (communicator_traits); not the shared-memory thread group or single-node MPI, whose
    /// "communication" is memory work on the same cores as the compute.
    automatic,
    /// Always on a communication stream (MPI without MPI_THREAD_MULTIPLE falls back to inline).
    /// On single-node MPI the communication thread runs at comm_priority::background, below
    /// the compute.
    always,
    /// Always inline: a bucket is reduced in mark_ready / finish on the calling thread or stream.
    never
};

/// What a synchronous trainer does when a replica is lost during a step
/// (train_params::on_replica_failure). A replica is lost when its thread ends, fails with
/// anything but a deterministic lockstep::error (invalid_argument, shape_mismatch,
/// count_mismatch, non_finite, checkpoint, unsupported, divergence, internal), or misses the
/// group's timeout; thread_group::abort is not a loss.
enum class replica_failure {
    stop,  ///< the step throws on every replica (errc::peer_failure or errc::timeout)
    shrink ///< the survivors shrink the communicator, put back the state from before the step
           ///< and compute it again with the same global batch (step_result::lost)
};

/// Runtime knobs of data_parallel (designated initialisers: `{.micro_batches = 4, .seed = 7}`).
struct train_params {
    /// Micro-batches per step (gradient accumulation): gradients are zeroed once per step,
    /// accumulated over M calls of the step function, reduced and applied once. >= 1.
    int micro_batches = 1;
    /// The learning rate of step s (0-based), e.g. an optim lr schedule; empty: the optimizer
    /// params' lr for every step. Finite and >= 0: data_parallel::step checks step s's before
    /// its first collective (errc::invalid_argument naming the replica, the step and the value).
    /// save_checkpoint and load_checkpoint evaluate it at the resume step steps() and at
    /// steps() + 1, + 10 and + 1000 (the schedule's continuation, which a load must match): it
    /// must not have undefined behaviour there (an unchecked lookup past a table's end), but may
    /// throw: a step past steps() where it throws (any std::exception) is recorded as undefined,
    /// so a schedule defined for the run's steps only saves and resumes; at steps() itself a
    /// throw fails the save, or refuses the load (errc::checkpoint), naming the step.
    std::function<double(std::int64_t)> lr = {};
    /// A step whose gradient or loss has a NaN or infinity on any replica is skipped on every
    /// replica (true), or also throws lockstep::error (non_finite) on every replica (false),
    /// naming per replica the count of non-finite gradient elements (before reduction), the
    /// tensor of the first one, and a non-finite loss. With loss_scale set, a non-finite
    /// gradient is an overflow and never throws; a non-finite loss still does.
    bool skip_non_finite = true;
    /// A run of this many consecutive skipped steps stops training (data_parallel): the host's
    /// read of the step that reaches it (step(), or read_result(), count_replay() or finish()
    /// with read_result = false) throws lockstep::error (non_finite) on every replica, naming
    /// the replicas and the first tensor of that step's non-finite values, and so does every
    /// later read. The run is counted on the device with the skip decision; an applied step ends
    /// it. With loss scaling, the skips of a scale still backing off do not count (nor end the
    /// run): only overflows at loss_scaling::min_scale, and skips for another reason. 20: longer
    /// than any run of bad batches seen in practice, far shorter than a run that no longer
    /// trains. sync::local_sgd counts each replica's own run (its decisions are its own): only
    /// that replica throws, its peers get errc::peer_failure at the next average. 0: off.
    /// requires: >= 0; ignored by the asynchronous trainers. Every replica must pass the same
    /// value.
    std::int64_t max_consecutive_skips = 20;
    /// Synchronous steps: read the step's result on the host at the end of every step (one
    /// synchronisation, through the communicator's polling wait), so step() returns the loss and
    /// the skip decision and throws the step's errors. false: step() returns without waiting
    /// (step_result::ready is false) and data_parallel::read_result() waits for the last step's
    /// result when the caller wants it. Either way a step with a non-finite gradient or a layer
    /// error is skipped on the device, identically on every replica.
    bool read_result = true;
    /// Overlap of gradient reduction with backward (synchronous steps and local SGD's averages).
    /// Every replica must pass the same value.
    overlap_mode overlap = overlap_mode::automatic;
    /// The seed of every replica's random streams (replica_context::rng), keyed by the global
    /// sample index: every replica must pass the same value (checked at construction), so a
    /// sample's randomness does not depend on the replica holding it.
    std::uint64_t seed = 0;
    /// Which parameters get weight decay and LARS/LAMB trust-ratio adaptation; empty: all.
    /// Commonly `[](const tensor_info& t) { return t.shape.size() > 1; }` (no biases, no BN).
    /// Tensors of a visitor network have the shape its visitor passes (f(name, v, g, shape));
    /// a visitor that passes none registers 1-D tensors, for which that predicate is false.
    std::function<bool(const tensor_info&)> decay = {};
    /// Dynamic loss scaling (data_parallel with sync::synchronous or sync::local_sgd; the
    /// asynchronous trainers refuse it): the step function multiplies its loss's backward seed
    /// by ctx.loss_scale() (or *ctx.loss_scale_device() on a device), the trainer multiplies the
    /// gradient by 1 / scale after the reduction and updates the scale on the device from the
    /// step's (all-reduced) status, so every replica takes the same decisions. A non-finite
    /// gradient is then an overflow: the step is skipped and the scale backs off, whatever
    /// skip_non_finite says. Empty: no scaling (ctx.loss_scale() is 1).
    std::optional<loss_scaling> loss_scale = {};
    /// Gradient clipping by global norm (torch.nn.utils.clip_grad_norm_): when > 0, the gradient
    /// the optimizer sees is g * min(1, max_grad_norm / (||g|| + 1e-6)), ||g|| the 2-norm (in
    /// double) over every non-frozen parameter. Synchronous: the norm of the reduced gradient,
    /// computed once on every replica from the same values (no extra collective), so every
    /// replica applies the same factor. Local SGD: the norm of this replica's own gradient.
    /// 0: no clipping. requires: finite and >= 0; 0 for the asynchronous trainers.
    double max_grad_norm = 0.0;
    /// Which parameters are frozen; empty: none. A frozen tensor gets no update and no optimizer
    /// state change: it is left out of the optimizer's segments, so its momentum / moments stay
    /// as they are (every trainer). Its gradient is still reduced and, in the NaN/inf check,
    /// counted; synchronous and local SGD then zero it before the gradient hook, the clipping
    /// norm and the update. Every replica must freeze the same tensors. A checkpoint records the
    /// frozen tensors, and load_checkpoint refuses another set (errc::checkpoint, naming the
    /// tensors that changed): the optimizer keeps one step count for every tensor, so a tensor
    /// frozen at the save and trained after the load would start Adam's bias correction and
    /// momentum at the run's count, not its own first step as in torch. To train another set,
    /// load with the saved one, then construct a new trainer whose network starts from the
    /// loaded parameters (a fresh optimizer). A checkpoint written before the frozen tensors
    /// were recorded loads with any set.
    std::function<bool(const tensor_info&)> frozen = {};
    /// Cross-replica consistency check (data_parallel only): every verify_every steps, after
    /// the update, the replicas compare a digest of every tensor they must hold bit for bit (the
    /// parameters; the optimizer state, except with reduce::sharded and sync::local_sgd, where it
    /// is per replica, and reduce::parameter_server, where only Root's is used; the registry and
    /// visited state, i.e. BN running statistics, when every BN policy of the network shares
    /// them (bn::traits::shares_running_statistics) or with local SGD, which averages them) in
    /// one all_gather of one int64 per tensor, plus a host read of the digests. A difference throws
    /// lockstep::error (errc::divergence) on every replica naming the step, the replicas that
    /// differ, the first differing tensor and element and every replica's value there. Use it to
    /// catch silent drift (a non-deterministic kernel on one replica, a corrupted value, a data
    /// pipeline that differs): while developing, or every few hundred steps in long runs. 0: off.
    /// requires: >= 0; with sync::local_sgd<K> a multiple of K (the replicas agree only right after
    /// an average); 0 for the asynchronous trainers. Every replica must pass the same value
    /// (checked at construction).
    std::int64_t verify_every = 0;
    /// The slow replica named (data_parallel with sync::synchronous or sync::local_sgd): after
    /// every report_stragglers_every-th step, one all_gather of one double per replica makes a
    /// straggler_report (data_parallel::straggler()): every replica's own time per step over
    /// the steps since the last report (its work between collectives: timed on the host by the
    /// thread group's and MPI's flight recorders, on the device by nccl_communicator, with two
    /// CUDA events per collective, the first step and each report waiting for the stream) and
    /// the slowest replica with its lag behind the median of the others. Other communicators
    /// and a step captured in a CUDA graph refuse it (errc::unsupported). 0: off.
    /// requires: >= 0; 0 for the asynchronous trainers. Every replica must pass the same value
    /// (checked at construction).
    std::int64_t report_stragglers_every = 0;
    /// What a synchronous data_parallel does when a replica is lost during a step
    /// (replica_failure; docs/fault_tolerance.md). shrink: with a communicator that can shrink
    /// (thread_communicator; nccl_communicator where its shrink_problem() is empty), a replicated
    /// optimizer state (not reduce::sharded, reduce::parameter_server or local SGD: they roll back
    /// to a checkpoint) and read_result (else errc::unsupported at construction), and no CUDA graph
    /// capture. Every replica must pass the same value (checked at construction).
    replica_failure on_replica_failure = replica_failure::stop;
    /// With replica_failure::shrink: the fewest replicas the run continues with; a shrink to
    /// fewer throws on the survivors (errc::peer_failure, naming both counts). requires: >= 1 and,
    /// with shrink, at most the replica count (else errc::invalid_argument at construction).
    int min_replicas = 1;
};

/// What a step's status showed of the background checkpoint save in flight
/// (save_checkpoint_async): nothing new, or its end, seen by every replica at the same step.
enum class checkpoint_event {
    none,      ///< no save ended (none in flight, or still being written)
    committed, ///< the save is committed: a load now finds it
    failed     ///< the save failed on some replica; the previous checkpoint stands
               ///< (wait_checkpoint throws the reasons)
};

/// What one data_parallel::step returns (the same on every replica for synchronous training).
struct step_result {
    /// The loss of the step: the sum of the step function's results over replicas and
    /// micro-batches (the global mean loss when fn returns sum-of-losses * range.scale). For
    /// sync::local_sgd this replica's own mean (no communication).
    double loss = 0.0;
    /// True when the step was skipped: a gradient element or the loss was not finite on some
    /// replica, a layer reported an error, or the replicas disagreed on global_batch or lr (a
    /// disagreement, and a layer error, also throw).
    bool skipped = false;
    /// The learning rate the step used.
    double lr = 0.0;
    /// The step's index (0-based).
    std::int64_t step = 0;
    /// False when the step returned without reading its result (train_params::read_result):
    /// loss, skipped and loss_scale are then not set.
    bool ready = true;
    /// The loss scale the step's backward used (train_params::loss_scale; 1 without scaling).
    double loss_scale = 1.0;
    /// The background checkpoint save that this step's status showed ending (read with the
    /// result: none while ready is false).
    checkpoint_event checkpoint = checkpoint_event::none;
    /// The replicas lost in this step (train_params::on_replica_failure = shrink): 0, or how
    /// many the group shrank by before the step was computed again on the survivors. rank()
    /// and size() of the trainer and its communicator have changed then; the step's result is
    /// that of the computation on the survivors.
    int lost = 0;
};

} // namespace lockstep

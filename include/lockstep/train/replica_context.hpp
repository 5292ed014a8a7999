// lockstep/train/replica_context.hpp: replica_context, what a network and a step function see of
// their replica (rank, communicator, system, RNG, registry). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/nn/policy_declaration.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/rng.hpp"

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>

namespace lockstep {

/// One replica's view of the training: its rank among size() replicas, its communicator and
/// system, its parameter registry and the run's random streams. data_parallel owns it at a fixed
/// address for the trainer's lifetime and passes it to the network factory and to every step
/// function call.
template <class T, communicator Communicator>
class replica_context {
public:
    using value_type = T;
    using communicator_type = Communicator;
    using system_type = typename Communicator::system_type;
    using registry_type = parameter_registry<T, system_type>;
    using handle = typename registry_type::handle;

    /// requires: comm outlives the context.
    replica_context(Communicator& comm, std::uint64_t seed)
        : comm_(&comm), registry_(comm.system(), comm.rank()), seed_(seed) {}
    replica_context(const replica_context&) = delete;
    replica_context& operator=(const replica_context&) = delete;

    int rank() const { return comm_->rank(); }
    int size() const { return comm_->size(); }
    system_type system() const { return comm_->system(); }
    Communicator& comm() noexcept { return *comm_; }
    /// The registry a network allocates its parameters and state from (path (a)).
    registry_type& registry() noexcept { return registry_; }

    /// The random stream `stream` under the run's seed (train_params::seed). Key it with GLOBAL
    /// sample indices (shard_range::sample_index) so numbers do not depend on the replica count.
    rng_stream rng(std::uint32_t stream = 0) const noexcept { return rng_stream{seed_, stream}; }
    std::uint64_t seed() const noexcept { return seed_; }

    /// Optimizer steps completed so far (the index of the step being computed).
    std::int64_t step() const noexcept { return step_; }
    /// True while the trainer runs a training step (fn of step()); false in the factory.
    bool training() const noexcept { return training_; }

    /// During a synchronous step: a pointer to one double in the replica's system memory that
    /// the step's loss is accumulated in (null outside steps). A step function that computes its
    /// loss on the device adds its part (the sum of per-sample losses times range.scale) here,
    /// e.g. from its loss kernel, and returns void, so the loss never has to come back to the
    /// host inside the step; the trainer sums it over replicas with the step's status.
    double* loss_slot() const noexcept { return loss_slot_; }

    /// The loss scale of the step being computed (train_params::loss_scale; 1 without loss
    /// scaling): multiply the loss's backward seed (dL/dy) by it. On the host. On a host system
    /// always available; on a device system when the previous step's result was read
    /// (train_params::read_result, or data_parallel::read_result() after it), else
    /// lockstep::error (invalid_argument): read *loss_scale_device() in device code instead.
    double loss_scale() const {
        LOCKSTEP_REQUIRE(loss_scale_host_.has_value(), errc::invalid_argument, rank(),
                         "replica_context.loss_scale", "the scale of step ", step_,
                         " is not known on the host: the previous step's result was not read "
                         "(read_result = false); read *loss_scale_device() on the device");
        return *loss_scale_host_;
    }
    /// The loss scale of the step being computed as one double in the replica's system memory
    /// (null before the first step): what device code multiplies the backward seed by. Its
    /// value changes at the end of each step, on the system's stream.
    const double* loss_scale_device() const noexcept { return loss_scale_device_; }

    /// During a training step: the step as the network's layers see it (pass the context to
    /// their training calls, e.g. nn::batch_norm::forward_train(ctx, ...)); null outside steps.
    nn::layer_step* layer_step() const noexcept { return layer_step_; }
    /// The trainer's policies and the network's declared BN policies, which every layer call
    /// with this context is checked against (null: no trainer).
    const nn::policy_declaration* policies() const noexcept { return policies_; }

    /// Signals that backward has finished writing the gradient of parameter h for this step,
    /// so a bucketed reducer may launch the bucket h completes. Optional: every gradient not
    /// marked is reduced when the step function returns. Only meaningful with the registry and
    /// on the last micro-batch of a step (earlier micro-batches still accumulate).
    /// requires: h was returned by this replica's registry().add (not default-constructed, not
    /// another registry's: either would mark this registry's tensor of the same index) and is a
    /// parameter, not state (add_state, which has no gradient): else lockstep::error
    /// (errc::invalid_argument) naming this replica and, where there is one, the tensor.
    void mark_ready(const handle& h) {
        LOCKSTEP_REQUIRE(h.valid(), errc::invalid_argument, rank(), "replica_context.mark_ready",
                         "the handle is default-constructed and names no tensor: mark only "
                         "handles returned by ctx.registry().add");
        LOCKSTEP_REQUIRE(
            h.belongs_to(registry_), errc::invalid_argument, rank(), "replica_context.mark_ready",
            "'", h.name(),
            "' is a tensor of another parameter_registry (another model's or replica's): mark "
            "only handles returned by this replica's ctx.registry().add");
        LOCKSTEP_REQUIRE(h.kind() == tensor_kind::parameter, errc::invalid_argument, rank(),
                         "replica_context.mark_ready", "'", h.name(),
                         "' is a state tensor (add_state): only a parameter's gradient (add) can "
                         "be marked ready");
        if (ready_hook_)
            ready_hook_(h.index());
    }

    /// For trainers: installs the hook mark_ready forwards to, and the step bookkeeping.
    void set_ready_hook(std::function<void(std::size_t)> hook) { ready_hook_ = std::move(hook); }
    void set_step(std::int64_t s, bool training) noexcept {
        step_ = s;
        training_ = training;
    }
    void set_loss_slot(double* slot) noexcept { loss_slot_ = slot; }
    void set_layer_step(nn::layer_step* step) noexcept { layer_step_ = step; }
    void set_policies(const nn::policy_declaration* p) noexcept { policies_ = p; }
    void set_loss_scale(const double* device, std::optional<double> host) noexcept {
        loss_scale_device_ = device;
        loss_scale_host_ = host;
    }
    /// For trainers restoring a checkpoint: the seed of rng() from now on.
    void set_seed(std::uint64_t seed) noexcept { seed_ = seed; }

private:
    Communicator* comm_;
    registry_type registry_;
    std::uint64_t seed_;
    std::int64_t step_ = 0;
    bool training_ = false;
    double* loss_slot_ = nullptr;
    nn::layer_step* layer_step_ = nullptr;
    const nn::policy_declaration* policies_ = nullptr;
    const double* loss_scale_device_ = nullptr;
    std::optional<double> loss_scale_host_ = 1.0;
    std::function<void(std::size_t)> ready_hook_;
};

namespace detail {
/// For trainers: a step function's view of the step for the scope's lifetime: ctx.loss_slot()
/// is `loss` and ctx.layer_step() is `step`; both null again at the end (also when the step
/// function throws). The calling thread is marked as running `step` (nn::layer_step::running:
/// a layer given the bare communicator in the step function refuses the call).
template <class Context>
class step_scope {
public:
    step_scope(Context& ctx, double* loss, nn::layer_step* step) : ctx_(ctx), running_(step) {
        ctx_.set_loss_slot(loss);
        ctx_.set_layer_step(step);
    }
    step_scope(const step_scope&) = delete;
    step_scope& operator=(const step_scope&) = delete;
    ~step_scope() {
        ctx_.set_loss_slot(nullptr);
        ctx_.set_layer_step(nullptr);
    }

private:
    Context& ctx_;
    nn::layer_step::running_scope running_;
};

/// For trainers: the ready hook a step installs in ctx (replica_context::set_ready_hook) is
/// removed at the end of the scope, also when the step function throws, so no hook outlives
/// what it refers to.
template <class Context>
class ready_hook_scope {
public:
    explicit ready_hook_scope(Context& ctx) : ctx_(ctx) {}
    ready_hook_scope(const ready_hook_scope&) = delete;
    ready_hook_scope& operator=(const ready_hook_scope&) = delete;
    ~ready_hook_scope() { ctx_.set_ready_hook({}); }

private:
    Context& ctx_;
};
} // namespace detail

} // namespace lockstep

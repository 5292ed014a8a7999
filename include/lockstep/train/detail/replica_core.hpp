// lockstep/train/detail/replica_core.hpp: replica_core, the part of a trainer every SyncPolicy
// shares: network construction, parameter discovery (registry or visitor), the cross-replica
// parameter check, the initial broadcast, micro-batch sharding and the optimizer.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/agreement.hpp"
#include "lockstep/train/detail/optimizer_shard.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/signature.hpp"
#include "lockstep/train/detail/trainer_ordinal.hpp"
#include "lockstep/train/detail/trainer_presence.hpp"
#include "lockstep/train/detail/visit_check.hpp"
#include "lockstep/train/detail/visited_buffers.hpp"
#include "lockstep/train/detail/visitor.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// Reads and restores a trainer's private state for train/checkpoint.hpp (a friend of the
/// trainers).
struct checkpoint_access;

/// An optimizer whose per-tensor norms a sharded trainer reduces across replicas (LARS, LAMB).
/// The requirement names a std::function, not a lambda: nvcc's device pass evaluates a
/// requires-expression holding a lambda as false, so the kernels of the branch it guards get
/// host stubs but no device code (cudaErrorInvalidDeviceFunction at their first launch).
template <class Optimizer>
concept norm_reducing = requires(Optimizer& o,
                                 std::function<void(std::span<kernels::sum_pair>)> f) {
    o.set_norm_reduction(std::move(f));
};

/// Builds a Network in place from factory(ctx) (guaranteed elision: Network need not move).
template <class Network, class Factory, class Context>
struct network_maker {
    Factory& factory;
    Context& ctx;
    operator Network() const { return factory(ctx); }
};

/// One replica's share of any trainer. Owns the context (fixed address: the registry and the
/// network's handles point into it), the network, the optimizer; the flat value/gradient/state
/// buffers are the registry's (path (a)) or packed copies of the network's own buffers (path
/// (b), the visitor): either way values()/grads() are flat and identically laid out on
/// every replica.
template <class Network, class Optimizer, class Communicator>
class replica_core {
public:
    using value_type = typename Optimizer::value_type;
    using T = value_type;
    using system_type = typename Communicator::system_type;
    using context_type = replica_context<T, Communicator>;
    /// True when the network exposes its parameters through for_each_parameter (path (b)).
    static constexpr bool uses_visitor = has_parameter_visitor<Network, T>;

    static_assert(std::is_same_v<typename Optimizer::system_type, system_type>,
                  "The optimizer must run on the communicator's system: use e.g. "
                  "optim::sgd<float, Communicator::system_type>.");

    /// Constructs the network on this replica, finalizes its parameters, checks that every
    /// replica declared the same ones and the same settings (describe_settings with the
    /// trainer's `policies` lines, "name<TAB>value") and broadcasts replica 0's values and
    /// state. `clips`: the trainer applies train_params::max_grad_norm (else a non-zero value
    /// is refused). `sharded`: the optimizer holds state for this replica's shard of the flat
    /// buffer only (reduce::sharded; shard_layout), its segments are the tensors intersected
    /// with the shard, and LARS/LAMB get the norm reduction over replicas (sharded_norms).
    /// Collective: every replica of comm must construct its trainer. The trainer's ordinal on
    /// comm (trainer_ordinal.hpp) is drawn first, so a construction that throws draws it too.
    template <class Factory>
    replica_core(Communicator& comm, Factory&& factory, typename Optimizer::params_type opt,
                 train_params tp, const std::vector<std::string>& policies = {}, bool clips = false,
                 bool sharded = false)
        : comm_(&comm), ordinal_(trainer_ordinal(comm)),
          presence_(&comm, tp.on_replica_failure == replica_failure::shrink, comm.rank()),
          ctx_(std::make_unique<context_type>(comm, tp.seed)), tp_(std::move(tp)) {
        LOCKSTEP_REQUIRE(tp_.micro_batches >= 1, errc::invalid_argument, comm.rank(),
                         "data_parallel", "micro_batches = ", tp_.micro_batches, " (must be >= 1)");
        LOCKSTEP_REQUIRE(tp_.max_grad_norm >= 0 && is_finite(tp_.max_grad_norm),
                         errc::invalid_argument, comm.rank(), "data_parallel",
                         "max_grad_norm = ", tp_.max_grad_norm, " (must be finite and >= 0)");
        LOCKSTEP_REQUIRE(clips || tp_.max_grad_norm == 0, errc::unsupported, comm.rank(),
                         "data_parallel", "max_grad_norm = ", tp_.max_grad_norm,
                         ": gradient clipping is applied by the synchronous and local SGD "
                         "trainers only");
        using maker = network_maker<Network, std::remove_reference_t<Factory>, context_type>;
        net_.emplace(maker{factory, *ctx_});
        auto& reg = ctx_->registry();
        std::vector<tied_pair> ties;
        if constexpr (uses_visitor)
            ties = register_visited_parameters<T>(*net_, reg, comm.rank());
        reg.finalize();
        // State the network exposes through for_each_state (with either path) is packed into a
        // buffer of the trainer's: e.g. BN running statistics a layer owns.
        vstate_ = visited_state<T, system_type>(*net_, comm.system());
        std::vector<tensor_info> all_state = reg.state_tensors();
        all_state.insert(all_state.end(), vstate_.tensors().begin(), vstate_.tensors().end());
        verify_same_tensors<T>(comm, reg.parameters(), all_state,
                               describe_settings<Optimizer>(opt, tp_, reg.parameters(), policies));
        // After the collective check: every replica declared the same names, so all throw alike.
        check_state_names(all_state, reg.state_tensors().size(), comm.rank());
        LOCKSTEP_REQUIRE(reg.parameter_count() > 0, errc::invalid_argument, comm.rank(),
                         "data_parallel",
                         "the network declared no parameters (allocate them from "
                         "ctx.registry() or define for_each_parameter)");
        broadcast_from(0);
        // The optimizer below copies its tables to the device with blocking copies on this
        // stream: wait for the broadcast through the communicator first, so that a missing peer
        // ends in its timeout and failure checks instead of in a plain stream wait.
        if constexpr (requires { comm.synchronize(); })
            comm.synchronize();

        // Frozen tensors are left out of the optimizer's segments: it never touches them.
        segments_.reserve(reg.parameters().size());
        for (std::size_t i = 0; i < reg.parameters().size(); ++i) {
            const tensor_info& t = reg.parameters()[i];
            if (tp_.frozen && tp_.frozen(t)) {
                frozen_.push_back(i);
                continue;
            }
            const bool decay = !tp_.decay || tp_.decay(t);
            segments_.push_back(tensor_segment{t.offset, t.size, decay, decay});
        }
        check_tied_tensors(ties, reg.parameters(), tp_, comm.rank());
        if (segments_.empty()) // every tensor frozen: one empty segment (no segments means all)
            segments_.push_back(tensor_segment{0, 0, false, false});
        if (!sharded) {
            shard_ = shard_extent{0, reg.parameter_count()};
            make_optimizer(reg.parameter_count(), std::move(opt), comm.system(),
                           std::span<const tensor_segment>(segments_));
            return;
        }
        shard_ =
            shard_layout(reg.parameter_count(), comm.size())[static_cast<std::size_t>(comm.rank())];
        std::vector<std::uint32_t> map;
        const std::vector<tensor_segment> local =
            shard_segments(std::span<const tensor_segment>(segments_), shard_, map);
        make_optimizer(shard_.count, std::move(opt), comm.system(),
                       std::span<const tensor_segment>(local));
        if constexpr (norm_reducing<Optimizer>) {
            norms_ = std::make_unique<sharded_norms<Communicator>>(comm, segments_.size(), map);
            opt_->set_norm_reduction(
                [n = norms_.get()](std::span<kernels::sum_pair> s) { (*n)(s); });
        }
    }

    Network& network() noexcept { return *net_; }
    const Network& network() const noexcept { return *net_; }
    context_type& context() noexcept { return *ctx_; }
    Communicator& comm() noexcept { return *comm_; }
    Optimizer& optimizer() noexcept { return *opt_; }
    const Optimizer& optimizer() const noexcept { return *opt_; }
    /// The elements of the flat buffer the optimizer updates: all of them, or this replica's
    /// shard (sharded).
    shard_extent optimizer_shard() const noexcept { return shard_; }
    /// The bytes of the optimizer's state buffers (state().slots) on this replica.
    std::size_t optimizer_state_bytes() const {
        std::size_t bytes = 0;
        for (const auto& slot : opt_->state().slots)
            bytes += slot.data.size_bytes();
        return bytes;
    }
    const train_params& params() const noexcept { return tp_; }
    /// Which trainer on this communicator object this one is (1, 2, ... in construction order;
    /// 0: the communicator has no identity, unchecked): what the step's checks compare.
    std::uint64_t ordinal() const noexcept { return ordinal_; }
    typename context_type::registry_type& registry() noexcept { return ctx_->registry(); }
    std::span<T> values() { return registry().values(); }
    /// The registration indices of the frozen parameters (train_params::frozen).
    const std::vector<std::size_t>& frozen() const noexcept { return frozen_; }
    /// Zeroes the gradients of the frozen parameters in the flat buffer.
    void zero_frozen_grads() {
        for (std::size_t i : frozen_) {
            const tensor_info& t = registry().parameters()[i];
            zero(comm_->system(), grads().subspan(t.offset, t.size));
        }
    }
    std::span<T> grads() { return registry().grads(); }
    /// Calls f(span) on every non-empty flat state buffer: the registry's state, then the
    /// packed copy of the state the network visits (call pack_state() first).
    template <class F>
    void for_each_state_buffer(F&& f) {
        if (!registry().states().empty())
            f(registry().states());
        if (!vstate_.empty())
            f(vstate_.span());
    }
    /// Steps taken (including skipped ones) and samples consumed so far.
    std::int64_t steps() const noexcept { return steps_; }
    std::uint64_t samples() const noexcept { return samples_; }

    /// The learning rate of step s: the schedule's, or the optimizer's params().lr. A
    /// lockstep::error the schedule throws without a replica (optim's schedules know none) is
    /// thrown again naming this one, with its code, operation and text.
    double lr_for(std::int64_t s) const {
        if (!tp_.lr)
            return static_cast<double>(opt_->params().lr);
        try {
            return tp_.lr(s);
        } catch (const error& e) {
            rethrow_naming_replica(e);
        }
    }
    /// lr_for(s), required finite and >= 0, else lockstep::error (errc::invalid_argument) naming
    /// this replica, the step and the value. Trainers check it before a step's first collective:
    /// every replica computes the same schedule, so every replica throws, with nothing changed.
    double checked_lr(std::int64_t s, const char* op = "data_parallel.step") const {
        const double lr = lr_for(s);
        LOCKSTEP_REQUIRE(is_finite(lr) && lr >= 0, errc::invalid_argument, comm_->rank(), op,
                         "the learning rate of step ", s, " is ", lr,
                         " (train_params::lr or the optimizer's lr: must be finite and >= 0)");
        return lr;
    }

    /// Zeroes every gradient (the flat buffer, and the network's own with the visitor).
    void zero_grads() {
        zero(comm_->system(), grads());
        if constexpr (uses_visitor)
            visit_parameters(*net_, [&](std::string_view, std::span<T>, std::span<T> g) {
                zero(comm_->system(), g);
            });
    }

    /// Before a step's work: a global batch of at least one sample, and a run-wide sample index
    /// that does not wrap when the step adds it.
    void check_global(std::size_t global) const {
        LOCKSTEP_REQUIRE(global >= 1, errc::invalid_argument, comm_->rank(), "data_parallel.step",
                         "global batch size is 0");
        (void)next_sample_offset(samples_, global, comm_->rank());
    }

    /// Runs fn (returning its loss as a number, or void when it adds the loss into
    /// ctx.loss_slot() on the device) over this replica's part of each of the M micro-batches of a
    /// global batch of `global` samples: micro-batch m is positions [global m / M, global (m + 1) /
    /// M) of the global batch, split over replicas with shard(). `own_scale`: scale each range by 1
    /// / (this replica's samples in the step) (local SGD) instead of 1 / global. `before_last` is
    /// called before the last micro-batch (trainers arm the ready hook there). Returns the sum
    /// of fn's results on this replica.
    template <class Fn, class BeforeLast>
    double run_micro_batches(std::size_t global, Fn& fn, bool own_scale, BeforeLast&& before_last) {
        check_global(global);
        const int rank = comm_->rank();
        const int size = comm_->size();
        const auto m_count = static_cast<std::size_t>(tp_.micro_batches);
        std::size_t own = 0;
        // micro_batch: global * m would wrap for global >= 2^62 (a "reversed range" error).
        const auto part = [&](std::size_t m) {
            const shard_range b = micro_batch(global, m, m_count);
            return shard(b.begin, b.end, rank, size);
        };
        for (std::size_t m = 0; m < m_count; ++m)
            own += part(m).size();
        double loss = 0;
        ctx_->set_step(steps_, true);
        // The hook before_last installs and the training flag end with the loop, also when fn
        // throws: a hook left behind would launch buckets in the next step's first micro-batch
        // or call into a collective a shrink has destroyed.
        struct loop_end {
            context_type& ctx;
            std::int64_t step;
            ~loop_end() {
                ctx.set_ready_hook({});
                ctx.set_step(step, false);
            }
        } const end{*ctx_, steps_};
        for (std::size_t m = 0; m < m_count; ++m) {
            shard_range r = part(m);
            r.global_size = global;
            r.sample_offset = samples_;
            r.scale = own_scale ? (own ? 1.0 / static_cast<double>(own) : 0.0)
                                : 1.0 / static_cast<double>(global);
            if (m + 1 == m_count)
                before_last();
            if constexpr (std::is_void_v<decltype(fn(*net_, r, *ctx_))>)
                fn(*net_, r, *ctx_);
            else
                loss += static_cast<double>(fn(*net_, r, *ctx_));
        }
        return loss;
    }

    /// Restores the position of a checkpoint: steps taken, samples consumed, the RNG seed.
    void restore_position(std::int64_t steps, std::uint64_t samples, std::uint64_t seed) {
        steps_ = steps;
        samples_ = samples;
        tp_.seed = seed;
        ctx_->set_seed(seed);
    }

    /// Ends a step's bookkeeping.
    void advance(std::size_t global) {
        ++steps_;
        samples_ += global;
    }
    /// Sets the samples consumed to `samples`: after a step the replicas disagreed on (its
    /// global_batch, its first sample), replica 0's first sample of it, on every replica.
    void resume_samples_at(std::uint64_t samples) { samples_ = samples; }
    /// Takes back the last advance(global): a step captured into a CUDA graph ran nothing
    /// (data_parallel counts each launch of the graph instead).
    void retract(std::size_t global) {
        --steps_;
        samples_ -= global;
    }

    /// Visitor path: network gradients -> flat gradient buffer (no-op with the registry).
    /// Here and in pack_values, unpack_values, pack_state, unpack_state: requires the visitor to
    /// visit the tensors it declared at construction (visit_check), else lockstep::error
    /// (errc::shape_mismatch) naming this replica and the tensor.
    void pack_grads() {
        if constexpr (uses_visitor)
            copy_visited(*net_, registry().parameters(), grads(), comm_->system(), comm_->rank(),
                         visited_copy::grads_to_flat);
    }
    /// Visitor path: network values -> flat value buffer.
    void pack_values() {
        if constexpr (uses_visitor)
            copy_visited(*net_, registry().parameters(), values(), comm_->system(), comm_->rank(),
                         visited_copy::values_to_flat);
    }
    /// Visitor path: flat value buffer -> network values.
    void unpack_values() {
        if constexpr (uses_visitor)
            copy_visited(*net_, registry().parameters(), values(), comm_->system(), comm_->rank(),
                         visited_copy::flat_to_values);
    }
    /// State the network visits (for_each_state) <-> the trainer's packed state buffer.
    void pack_state() { vstate_.move(*net_, comm_->system(), comm_->rank(), true); }
    void unpack_state() { vstate_.move(*net_, comm_->system(), comm_->rank(), false); }

    /// Every replica gets root's values and state.
    void broadcast_from(int root) {
        pack_values();
        pack_state();
        comm_->broadcast(values(), root);
        for_each_state_buffer([&](std::span<T> s) { comm_->broadcast(s, root); });
        unpack_values();
        unpack_state();
    }

private:
    /// In a handler of e: rethrows e naming this replica, unless it names one already (a user's
    /// schedule or an optimizer's params check throws without knowing the replica).
    [[noreturn]] void rethrow_naming_replica(const error& e) const {
        if (e.replica() >= 0)
            throw;
        throw error(e.code(), comm_->rank(), e.operation(), e.details());
    }

    /// Builds the optimizer from `args` (the optimizer's constructor refuses bad params with a
    /// lockstep::error): the refusal names this replica. Every replica holds the same params
    /// (describe_settings), so every replica throws.
    template <class... Args>
    void make_optimizer(Args&&... args) {
        try {
            opt_.emplace(std::forward<Args>(args)...);
        } catch (const error& e) {
            rethrow_naming_replica(e);
        }
    }

    Communicator* comm_;
    std::uint64_t ordinal_; ///< trainer_ordinal(comm) at construction
    trainer_presence presence_;
    std::unique_ptr<context_type> ctx_;
    train_params tp_;
    std::optional<Network> net_;
    std::vector<tensor_segment> segments_;
    std::vector<std::size_t> frozen_;
    shard_extent shard_;
    std::unique_ptr<sharded_norms<Communicator>> norms_; ///< sharded LARS/LAMB only
    std::optional<Optimizer> opt_;
    visited_state<T, system_type> vstate_; ///< the state the network visits, packed
    std::int64_t steps_ = 0;
    std::uint64_t samples_ = 0;
};

} // namespace lockstep::detail

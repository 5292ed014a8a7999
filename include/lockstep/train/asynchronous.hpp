// lockstep/train/asynchronous.hpp: data_parallel for sync::asynchronous and
// sync::bounded_staleness<S>, the parameter-server trainer. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/detail/agreement.hpp"
#include "lockstep/train/detail/async_agreement.hpp"
#include "lockstep/train/detail/data_parallel_fwd.hpp"
#include "lockstep/train/detail/trainer_base.hpp"
#include "lockstep/train/parameter_server.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <thrust/transform.h>

namespace lockstep {

/// Runtime knobs of the asynchronous trainers (designated initialisers).
struct async_params {
    /// The server rank: it holds the parameters, the optimizer and the BN running statistics.
    int root = 0;
    /// The momentum of the network's BN layers (batch_norm_params::momentum): the server keeps
    /// every state tensor as running = (1 - m) running + m batch, from each worker's batch
    /// statistics. requires: 0 < m <= 1, the same for every BN layer.
    double bn_momentum = 0.1;
    /// First of the four message tags of the protocol (tag .. tag + 3).
    int tag = 0x5053;
    /// Called on the server after each applied gradient with its bookkeeping and the worker's
    /// mean batch loss (progress bars, logs); its versions count the gradients the server took
    /// since the trainer was made (train()), across train() calls and resumes. Runs on the
    /// server's thread; keep it short.
    std::function<void(const apply_info&, double loss)> on_apply = {};
};

/// What data_parallel<..., sync::asynchronous | bounded_staleness<S>>::train returns.
struct async_result {
    /// Staleness measured by the server (valid on the root; workers get their computed counts
    /// in per_rank).
    staleness_report staleness;
    /// Mean of the workers' batch losses over the applied gradients (root), or over this
    /// worker's computed batches (worker).
    double mean_loss = 0.0;
    /// Gradients the server skipped because they or their loss were not finite (root).
    std::uint64_t skipped = 0;
};

namespace detail {

/// running' = keep running + d, where d is the worker's contribution (below) and keep =
/// (1 - m)^M for a work item of M micro-batches.
template <class T>
struct ema_apply_fn {
    T keep;
    LOCKSTEP_HOST_DEVICE T operator()(T running, T d) const { return keep * running + d; }
};
/// d = after - keep before: a BN layer that updated its running statistic M times, from `before`
/// to `after` = (1 - m)^M before + sum over micro-batches i of (1 - m)^(M - i) m batch_i,
/// contributed the sum, whatever `before` (the worker's possibly stale copy) was.
template <class T>
struct ema_delta_fn {
    T keep;
    LOCKSTEP_HOST_DEVICE T operator()(T after, T before) const { return after - keep * before; }
};

/// The parameter-server trainer behind data_parallel<N, O, sync::asynchronous, R, C> and
/// data_parallel<N, O, sync::bounded_staleness<S>, R, C> (see run_parameter_server for the
/// protocol).
template <class Network, class Optimizer, class SyncPolicy, class ReducePolicy, class Communicator>
class async_trainer
    : public trainer_base<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator> {
    using base_type = trainer_base<Network, Optimizer, SyncPolicy, ReducePolicy, Communicator>;
    using base_type::core_;

public:
    // The aliases and accessors are trainer_base's (network(), context(), optimizer(), rank(),
    // size(), parameters(), registry(), steps(), samples()).
    using typename base_type::system_type;
    using typename base_type::value_type;

    /// As data_parallel's constructor (collective: builds the network, checks that every replica
    /// declared the same tensors, broadcasts replica 0's values and state, prepares the
    /// optimizer); `ap` configures the server. Only the root's optimizer ever steps.
    /// requires: 0 < ap.bn_momentum <= 1 and min_replicas >= 1 (else errc::invalid_argument),
    /// no train_params::loss_scale, max_grad_norm == 0, verify_every == 0,
    /// report_stragglers_every == 0, read_result, overlap not overlap_mode::always and
    /// on_replica_failure == stop (else errc::unsupported: settings these trainers have no use
    /// for are refused, not ignored); train() checks comm.size() >= 2 (a server and a worker)
    /// and 0 <= ap.root < comm.size().
    template <class Factory>
    async_trainer(Communicator& comm, Factory&& factory, typename Optimizer::params_type opt = {},
                  train_params tp = {}, async_params ap = {})
        : base_type(comm, std::forward<Factory>(factory), std::move(opt), std::move(tp),
                    settings(ap), false),
          ap_(std::move(ap)) {
        LOCKSTEP_REQUIRE(!core_.params().loss_scale, errc::unsupported, comm.rank(),
                         "data_parallel(asynchronous)",
                         "train_params::loss_scale is not supported by the asynchronous trainers "
                         "(use sync::synchronous or sync::local_sgd)");
        LOCKSTEP_REQUIRE(core_.params().verify_every == 0, errc::unsupported, comm.rank(),
                         "data_parallel(asynchronous)",
                         "verify_every = ", core_.params().verify_every,
                         ": the asynchronous trainers' replicas do not hold identical parameters "
                         "while they train (use 0)");
        LOCKSTEP_REQUIRE(
            core_.params().report_stragglers_every == 0, errc::unsupported, comm.rank(),
            "data_parallel(asynchronous)",
            "report_stragglers_every = ", core_.params().report_stragglers_every,
            ": the asynchronous trainers' replicas do not wait for each other (use 0)");
        LOCKSTEP_REQUIRE(core_.params().read_result, errc::unsupported, comm.rank(),
                         "data_parallel(asynchronous)",
                         "read_result = false: train() returns once the server applied every "
                         "gradient, with nothing left to read later (use true)");
        LOCKSTEP_REQUIRE(core_.params().overlap != overlap_mode::always, errc::unsupported,
                         comm.rank(), "data_parallel(asynchronous)",
                         "overlap = always: the asynchronous trainers reduce no gradient buckets "
                         "(use automatic)");
        LOCKSTEP_REQUIRE(core_.params().min_replicas >= 1, errc::invalid_argument, comm.rank(),
                         "data_parallel(asynchronous)",
                         "min_replicas = ", core_.params().min_replicas, " (must be >= 1)");
        LOCKSTEP_REQUIRE(core_.params().on_replica_failure == replica_failure::stop,
                         errc::unsupported, comm.rank(), "data_parallel(asynchronous)",
                         "on_replica_failure = shrink: the optimizer state lives on the server "
                         "only, so a lost server cannot be rebuilt from the survivors; keep stop "
                         "and resume from the last checkpoint at the new count");
        LOCKSTEP_REQUIRE(ap_.bn_momentum > 0 && ap_.bn_momentum <= 1, errc::invalid_argument,
                         comm.rank(), "data_parallel(asynchronous)",
                         "bn_momentum = ", ap_.bn_momentum, " (must be in (0, 1])");
        this->declare_server_momentum(ap_.bn_momentum);
        std::size_t n = 0;
        core_.for_each_state_buffer([&](std::span<value_type> s) { n += s.size(); });
        state_ = buffer<value_type, system_type>(n, comm.system());
        before_ = buffer<value_type, system_type>(n, comm.system());
    }
    async_trainer(const async_trainer&) = delete;
    async_trainer& operator=(const async_trainer&) = delete;

    /// Trains until the server has taken `steps` gradients (applied or skipped) (collective: every
    /// replica calls it with the same arguments). Work item k is a batch of `batch` samples with
    /// global sample indices samples() + k * batch .. + batch - 1; a worker runs fn(Network&,
    /// shard_range, context_type&) -> double on it exactly like a synchronous step function
    /// (range.scale = 1 / batch, so fn's gradient is that of the batch's mean loss;
    /// train_params::micro_batches splits the batch), then pushes the gradient and its BN
    /// statistics. The server applies each at once with the optimizer (learning rate
    /// train_params::lr of the server version, which counts the gradients the server took
    /// (applied or skipped) since the trainer was made: steps() before this call, plus those
    /// taken in it, so a run
    /// split over several train() calls follows one schedule; ctx.step() in fn is the version
    /// the worker's parameters have, counted the same way), skips a gradient that is not
    /// finite or whose loss is not (counted in async_result::skipped, left out of mean_loss;
    /// when train_params::skip_non_finite is false: the server throws errc::non_finite naming
    /// the worker and the work item, and every worker errc::peer_failure), and updates the
    /// running statistics. On return every replica holds the server's final parameters and
    /// state, and steps() and samples() have grown by `steps` and `steps * batch`.
    /// requires: steps >= 1, batch >= 1, the same steps and batch on every replica (else
    /// errc::count_mismatch on every replica), comm.size() >= 2, 0 <= ap.root < comm.size(),
    /// and the learning rate of every version this call applies finite and >= 0 (else
    /// errc::invalid_argument naming the replica, the version and the value, before any work;
    /// where other replicas' schedules accept it, they throw errc::invalid_argument naming that
    /// replica) and the same on every replica (compared version by version in the batch's
    /// all_reduce: else errc::invalid_argument on every replica, before any work), and the same
    /// trainer on every replica (its ordinal on the communicator, detail/trainer_ordinal.hpp,
    /// compared in that all_reduce: replicas that call train() on their trainers in another
    /// order get errc::invalid_argument on every replica, before any work).
    template <class Fn>
    async_result train(std::size_t steps, std::size_t batch, Fn&& fn) {
        using T = value_type;
        const auto inside = this->enter("data_parallel.train");
        auto& comm = core_.comm();
        const auto sys = comm.system();
        LOCKSTEP_REQUIRE(steps >= 1 && batch >= 1, errc::invalid_argument, comm.rank(),
                         "data_parallel.train", "steps = ", steps, ", batch = ", batch,
                         " (both must be >= 1)");
        detail::agree_async_call(core_, steps, batch);
        const std::uint64_t first_sample = core_.samples();
        const std::int64_t first_version = core_.steps(); // versions continue across calls
        const auto micro = static_cast<std::size_t>(core_.params().micro_batches);
        // A BN layer runs once per micro-batch: M updates of its running statistics per item.
        const T keep = static_cast<T>(std::pow(1.0 - ap_.bn_momentum, static_cast<double>(micro)));
        async_result result;
        double loss_sum = 0;
        std::uint64_t losses = 0;

        auto compute = [&](const work_item& item, std::span<T> grad, std::span<T> stats) {
            core_.unpack_values(); // the pulled parameters (visitor path: into the network)
            unpack_state();
            copy(std::span<const T>(state_.span()), sys, before_.span(), sys);
            core_.zero_grads();
            auto& ctx = core_.context();
            ctx.set_step(first_version + static_cast<std::int64_t>(item.version), true);
            double loss = 0;
            for (std::size_t m = 0; m < micro; ++m) {
                shard_range r;
                r.begin = batch * m / micro;
                r.end = batch * (m + 1) / micro;
                r.global_size = batch;
                r.scale = 1.0 / static_cast<double>(batch);
                r.sample_offset = first_sample + item.index * batch;
                loss += static_cast<double>(fn(core_.network(), r, ctx));
            }
            ctx.set_step(first_version + static_cast<std::int64_t>(item.version), false);
            core_.pack_grads();
            copy(std::span<const T>(core_.grads()), sys, grad, sys);
            pack_state();
            const T loss_t = static_cast<T>(loss);
            copy(std::span<const T>(&loss_t, 1), host_system{}, stats.first(1), sys);
            kernels::with_policy_for(sys, state_.size(), [&](auto policy) {
                thrust::transform(policy, state_.data(), state_.data() + state_.size(),
                                  before_.data(), stats.data() + 1, ema_delta_fn<T>{keep});
            });
            loss_sum += loss;
            ++losses;
        };

        auto apply = [&](std::span<const T> grad, std::span<const T> stats,
                         const apply_info& info) {
            T loss_t{};
            copy(stats.first(1), sys, std::span<T>(&loss_t, 1), host_system{});
            // A non-finite loss is skipped like a non-finite gradient (train_params::
            // skip_non_finite), as the synchronous trainer does; neither enters mean_loss.
            const bool loss_finite = is_finite(loss_t);
            if (!loss_finite || count_non_finite(sys, grad) != 0) {
                LOCKSTEP_REQUIRE(core_.params().skip_non_finite || loss_finite, errc::non_finite,
                                 comm.rank(), "data_parallel.train", "the loss of worker ",
                                 info.worker, " for work item ", info.index, " is not finite (",
                                 loss_t, ")");
                LOCKSTEP_REQUIRE(core_.params().skip_non_finite, errc::non_finite, comm.rank(),
                                 "data_parallel.train", "the gradient of worker ", info.worker,
                                 " for work item ", info.index, " is not finite");
                ++result.skipped;
                return;
            }
            core_.optimizer().set_lr(
                core_.lr_for(first_version + static_cast<std::int64_t>(info.version)));
            core_.optimizer().step(core_.values(), grad);
            kernels::with_policy_for(sys, state_.size(), [&](auto policy) {
                thrust::transform(policy, state_.data(), state_.data() + state_.size(),
                                  stats.data() + 1, state_.data(), ema_apply_fn<T>{keep});
            });
            loss_sum += static_cast<double>(loss_t);
            ++losses;
            if (ap_.on_apply) { // versions counted since the trainer was made, as ctx.step()
                apply_info since_made = info;
                since_made.version += static_cast<std::uint64_t>(first_version);
                since_made.computed_version += static_cast<std::uint64_t>(first_version);
                ap_.on_apply(since_made, static_cast<double>(loss_t));
            }
        };

        core_.pack_values();
        pack_state();
        result.staleness = run_parameter_server<SyncPolicy>(
            comm, core_.values(), state_.span(), 1 + state_.size(),
            {.steps = steps, .root = ap_.root, .tag = ap_.tag}, compute, apply);
        core_.unpack_values();
        unpack_state();
        for (std::size_t k = 0; k < steps; ++k)
            core_.advance(batch);
        result.mean_loss = losses ? loss_sum / static_cast<double>(losses) : 0.0;
        return result;
    }

    /// The server's settings (async_params) this trainer was constructed with.
    const async_params& params() const noexcept { return ap_; }

private:
    friend struct checkpoint_access;
    // The settings every replica must share beyond the optimizer's: the policies and the
    // server's (a replica with another root or tag would wait for messages nobody sends).
    static std::vector<std::string> settings(const async_params& ap) {
        std::vector<std::string> out = base_type::policy_settings();
        add_setting(out, "async_params.bn_momentum", exact(ap.bn_momentum));
        add_setting(out, "async_params.root", std::to_string(ap.root));
        add_setting(out, "async_params.tag", std::to_string(ap.tag));
        return out;
    }
    // The network's state buffers (registry state, then visited state) <-> one flat buffer, so
    // it travels with the parameters in one message.
    void pack_state() {
        core_.pack_state();
        std::size_t at = 0;
        core_.for_each_state_buffer([&](std::span<value_type> s) {
            copy(std::span<const value_type>(s), core_.comm().system(),
                 state_.span().subspan(at, s.size()), core_.comm().system());
            at += s.size();
        });
    }
    void unpack_state() {
        std::size_t at = 0;
        core_.for_each_state_buffer([&](std::span<value_type> s) {
            copy(std::span<const value_type>(state_.span().subspan(at, s.size())),
                 core_.comm().system(), s, core_.comm().system());
            at += s.size();
        });
        core_.unpack_state();
    }

    async_params ap_;
    buffer<value_type, system_type> state_;  // server: the running state; worker: after its batch
    buffer<value_type, system_type> before_; // worker: the state it pulled
};

} // namespace detail

/// Asynchronous parameter-server training (see detail::async_trainer and run_parameter_server):
/// `trainer.train(steps, batch, fn)` instead of step(); workers push gradients, the server
/// applies each on arrival. Staleness is measured and reported, not bounded.
template <class Network, class Optimizer, reduce_policy ReducePolicy, communicator Communicator>
class data_parallel<Network, Optimizer, sync::asynchronous, ReducePolicy, Communicator>
    : public detail::async_trainer<Network, Optimizer, sync::asynchronous, ReducePolicy,
                                   Communicator> {
    using base =
        detail::async_trainer<Network, Optimizer, sync::asynchronous, ReducePolicy, Communicator>;

public:
    using base::base;
};

/// As the asynchronous trainer, but no gradient older than S server versions is ever applied:
/// a worker that runs ahead waits for its parameters (see detail::staleness_gate).
template <class Network, class Optimizer, std::size_t S, reduce_policy ReducePolicy,
          communicator Communicator>
class data_parallel<Network, Optimizer, sync::bounded_staleness<S>, ReducePolicy, Communicator>
    : public detail::async_trainer<Network, Optimizer, sync::bounded_staleness<S>, ReducePolicy,
                                   Communicator> {
    using base = detail::async_trainer<Network, Optimizer, sync::bounded_staleness<S>, ReducePolicy,
                                       Communicator>;

public:
    using base::base;
};

} // namespace lockstep

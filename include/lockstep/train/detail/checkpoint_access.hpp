// lockstep/train/detail/checkpoint_access.hpp: checkpoint_access, the trainer internals a
// checkpoint reads and restores (a friend of trainer_base and data_parallel).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/nn/layer_step.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/detail/trainer_base.hpp"

#include <cstddef>
#include <span>

namespace lockstep {

namespace detail {

/// The trainer internals a checkpoint reads and restores (a friend of trainer_base and
/// data_parallel).
struct checkpoint_access {
    /// The trainer_base of any trainer.
    template <class DP>
    static auto& base(DP& dp) noexcept {
        using base_type =
            trainer_base<typename DP::network_type, typename DP::optimizer_type,
                         typename DP::sync_policy_type, typename DP::reduce_policy_type,
                         typename DP::communicator_type>;
        return static_cast<base_type&>(dp);
    }
    /// The replica_core of any trainer (its trainer_base's).
    template <class DP>
    static auto& core(DP& dp) noexcept {
        return base(dp).core_;
    }
    /// Refuses a checkpoint call (`op`) on another thread while a training call of dp runs,
    /// or on a trainer whose communicator was moved from (trainer_base::check_use).
    template <class DP>
    static void check_use(DP& dp, const char* op) {
        base(dp).check_use(op);
    }
    /// Refuses a checkpoint call (`op`) during a training call of dp on any thread
    /// (trainer_base::check_between; `why`: what would go wrong).
    template <class DP>
    static void check_between(DP& dp, const char* op, const char* why) {
        base(dp).check_between(op, why);
    }
    /// The background save of a synchronous trainer (save_checkpoint_async).
    template <class DP>
    static auto& background(DP& dp) noexcept {
        return *dp.saves_;
    }
    /// f(u) with dp's unsettled_commit u: a synchronous trainer's, which can shrink (nothing for
    /// the other trainers).
    template <class DP, class F>
    static void unsettled(DP& dp, F&& f) {
        if constexpr (requires { dp.unsettled_; })
            f(dp.unsettled_);
    }
    /// Where dp's background saves stage their snapshots (snapshot_staging.hpp).
    template <class DP>
    static auto& staging(DP& dp) noexcept {
        return dp.staging_;
    }
    /// Waits for dp's background save when it has one unresolved (collective; see
    /// background_save::resolve): a blocking save or a load never races it.
    template <class DP, class Comm>
    static void resolve_background(DP& dp, Comm& comm, const char* op) {
        if constexpr (requires { dp.saves_; })
            (void)dp.saves_->resolve(comm, op, false);
    }
    /// Before a save (collective): local SGD compares the replicas' {global_batch, lr} of the
    /// steps since its last check, as its next average would (nothing for the other trainers,
    /// which agree on them in every step or train() call).
    template <class DP>
    static void verify_before_save(DP& dp) {
        if constexpr (is_local_sgd_v<typename DP::sync_policy_type>)
            dp.parts_->driver.verify_before_save(dp.parts_->stages);
    }
    /// After a load: the last step of dp (a synchronous or local SGD trainer) belongs to the
    /// state the load replaced, so no later read returns it, throws its errors or takes
    /// samples() back to its first sample (step_stages::forget_last).
    template <class DP>
    static void forget_last_step(DP& dp) noexcept {
        if constexpr (requires { dp.parts_->stages.forget_last(); })
            dp.parts_->stages.forget_last();
    }
    /// The state the layers of dp's last step keep in memory of their own (nn::layer_step::kept;
    /// empty for the asynchronous trainers, and before the first step).
    template <class DP>
    static std::span<const nn::layer_state> layer_states(DP& dp) noexcept {
        if constexpr (requires { dp.parts_->stages.layers(); })
            return dp.parts_->stages.layers().kept();
        (void)dp;
        return {};
    }
    /// Local SGD's steps since the last average (0 for the other trainers).
    template <class DP>
    static std::size_t since_average(const DP& dp) noexcept {
        if constexpr (is_local_sgd_v<typename DP::sync_policy_type>)
            return dp.parts_->driver.since_average();
        else
            return 0;
    }
    template <class DP>
    static void set_since_average(DP& dp, std::size_t n) noexcept {
        if constexpr (is_local_sgd_v<typename DP::sync_policy_type>)
            dp.parts_->driver.set_since_average(n);
        (void)dp;
        (void)n;
    }
};

} // namespace detail

} // namespace lockstep

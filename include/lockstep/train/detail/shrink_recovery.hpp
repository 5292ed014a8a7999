// lockstep/train/detail/shrink_recovery.hpp: how a synchronous trainer continues after losing a
// replica (train_params::on_replica_failure = shrink): whether a failure is a loss, the step the
// survivors compute again, and shrink_steps, the step's fence, rollback and recovery.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/system.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/detail/step_rollback.hpp"
#include "lockstep/train/loss_scaler.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace lockstep::detail {

/// A communicator whose survivors can leave a failed group for a new one (thread_communicator,
/// nccl_communicator): shrink() returns the replicas left out, run_failure() the failure that
/// ended the group (on NCCL: the first failure this replica saw). One that can be unable to
/// shrink at run time says why in shrink_problem() (nccl_communicator without a survivor
/// agreement).
template <class C>
concept shrinkable_communicator = communicator<C> && requires(C& c, const C& cc) {
    { c.shrink() } -> std::same_as<std::vector<int>>;
    { cc.run_failure() } -> std::same_as<std::exception_ptr>;
};

/// True when `e`, thrown on this replica by a step, comes from a lost replica (its thread
/// ended, it failed with anything but a deterministic lockstep::error, or it missed the
/// timeout): this replica timed out, or it was released with errc::peer_failure by a `root`
/// failure that is a loss. thread_group::abort and the deterministic errors (a bad argument or
/// shape, a count mismatch, non-finite values, a checkpoint, an unsupported call, divergence,
/// a broken invariant) are not: they would fail again on the survivors.
inline bool is_replica_loss(const error& e, const std::exception_ptr& root) {
    if (e.code() == errc::timeout)
        return true;
    if (e.code() != errc::peer_failure || !root)
        return false;
    try {
        std::rethrow_exception(root);
    } catch (const error& r) {
        if (r.operation() == "thread_group.abort")
            return false;
        switch (r.code()) {
        case errc::timeout:
        case errc::peer_failure:
        case errc::communication:
        case errc::cuda:
        case errc::nccl:
        case errc::mpi:
            return true;
        default:
            return false;
        }
    } catch (...) {
        return true; // not lockstep's: the replica's own code died
    }
}

/// Where the survivors start again: the step `step` and whether this replica puts back the
/// state it kept from before that step (else its live state is that step's start already).
struct redo_point {
    std::int64_t step = 0;
    bool restore = false;
};

/// Agrees with the survivors (collective over the shrunk comm) on the step to compute again.
/// Each offers the steps it can start from: `kept` (the step whose start it kept, -1: none) and
/// `live` (the step its failed call had begun: its live state is that step's start when it
/// failed at the step's fence, before keeping it). A replica can be one step ahead of another (it
/// completed the last collective of a step another failed in), never more; the earliest live step
/// is chosen, which every survivor holds. Throws errc::internal when the offers do not overlap.
template <communicator Comm>
redo_point agree_redo(Comm& comm, std::int64_t kept, std::int64_t live) {
    const std::int64_t lo = kept >= 0 ? kept : live;
    const std::array<std::int64_t, 2> mine{lo, live};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(comm.size()));
    host_all_gather(comm, std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    std::int64_t redo = live;
    std::int64_t latest_lo = lo;
    std::string offers;
    for (std::size_t r = 0; r < all.size(); r += 2) {
        redo = std::min(redo, all[r + 1]);
        latest_lo = std::max(latest_lo, all[r]);
        offers += (offers.empty() ? "" : ", ") + std::to_string(all[r]) + ".." +
                  std::to_string(all[r + 1]);
    }
    LOCKSTEP_REQUIRE(latest_lo <= redo, errc::internal, comm.rank(), "data_parallel.step",
                     "the survivors of a shrink hold no common step to start again from (their "
                     "steps: ",
                     offers, ")");
    // Live state is the start of `redo` only when nothing of it ran: kept < live.
    return {redo, redo != live || kept == live};
}

/// The largest K of the bn::tower<K> among the BN policies `Policies` (a std::tuple), -1 if none.
template <class P>
constexpr int tower_replica = -1;
template <int K>
constexpr int tower_replica<bn::tower<K>> = K;
template <class... P>
constexpr int largest_tower(std::tuple<P...>*) {
    return std::max({-1, tower_replica<P>...});
}

/// train_params::on_replica_failure and min_replicas, checked at construction (every replica
/// passes the same values: the agreement checks them). requires: min_replicas >= 1, and with
/// shrink min_replicas <= comm.size() (else errc::invalid_argument naming both) and, with
/// bn::tower<K> among the network's BN policies `BnPolicies`, min_replicas > K.
template <class ReducePolicy, class SyncPolicy, class BnPolicies, class Communicator>
void check_shrink_settings(const train_params& tp, const Communicator& comm) {
    const int rank = comm.rank();
    LOCKSTEP_REQUIRE(tp.min_replicas >= 1, errc::invalid_argument, rank, "data_parallel",
                     "min_replicas = ", tp.min_replicas, " (must be >= 1)");
    if (tp.on_replica_failure != replica_failure::shrink)
        return;
    LOCKSTEP_REQUIRE(tp.min_replicas <= comm.size(), errc::invalid_argument, rank, "data_parallel",
                     "on_replica_failure = shrink with min_replicas = ", tp.min_replicas,
                     ", more than the ", comm.size(),
                     " replicas: no shrink can leave that many; set min_replicas to at most ",
                     comm.size());
    LOCKSTEP_REQUIRE(shrinkable_communicator<Communicator>, errc::unsupported, rank,
                     "data_parallel",
                     "on_replica_failure = shrink needs a communicator that can shrink "
                     "(thread_communicator, nccl_communicator); with MPI relaunch from the last "
                     "checkpoint instead (tools/lockstep-run)");
    if constexpr (requires { comm.shrink_problem(); }) {
        const std::string problem = comm.shrink_problem();
        LOCKSTEP_REQUIRE(problem.empty(), errc::unsupported, rank, "data_parallel",
                         "on_replica_failure = shrink: this communicator cannot shrink: ", problem);
    }
    LOCKSTEP_REQUIRE(tp.read_result, errc::unsupported, rank, "data_parallel",
                     "on_replica_failure = shrink reads every step's result (read_result = true): "
                     "a result left unread would be lost with the step's state when the group "
                     "shrinks");
    constexpr bool replicated = !ReducePolicy::shards_optimizer_state &&
                                ReducePolicy::update_root < 0 && !is_local_sgd_v<SyncPolicy>;
    LOCKSTEP_REQUIRE(replicated, errc::unsupported, rank, "data_parallel",
                     "on_replica_failure = shrink with ", ReducePolicy::name(), " and ",
                     SyncPolicy::name(),
                     ": the optimizer state (or the weights) differ between replicas, so a lost "
                     "replica's cannot be rebuilt from the survivors; keep stop and resume from "
                     "the last checkpoint at the new count");
    constexpr int tower = largest_tower(static_cast<BnPolicies*>(nullptr));
    LOCKSTEP_REQUIRE(tp.min_replicas > tower, errc::invalid_argument, rank, "data_parallel",
                     "on_replica_failure = shrink with bn::tower<", tower,
                     "> and min_replicas = ", tp.min_replicas, ": a shrink to ", tower,
                     " or fewer replicas leaves no replica ", tower,
                     " to drive the running statistics; set min_replicas to at least ", tower + 1);
}

/// The step of a synchronous trainer over `Core` (replica_core) with on_replica_failure =
/// shrink: each step starts with a fence (one barrier) and a step_rollback; when a replica is
/// lost during it, the survivors shrink the communicator, agree on the step to start from
/// (agree_redo), put its start back, rebuild the trainer's parts and compute again. One recovery
/// per step: a failure of the step computed again is thrown, also when the shrink removed
/// nobody (a replica that timed out but still joined it), so a replica that stalls at every try
/// ends the run with the redo's error instead of shrinking again forever. A replica that had
/// completed the step before the loss computes it again inside its next step() call, then that
/// call's own step with a recovery of its own, as the survivors that begin it in a new call.
template <class Core>
class shrink_steps {
public:
    /// One call of data_parallel::step: once(g) runs one step of g samples without recovery,
    /// rebuild() replaces `parts` (its `collective` and `stages`) at the communicator's new
    /// size. A replica that had completed the step before this call's computes it again first.
    template <class Parts, class Once, class Rebuild>
    step_result step(Core& core, std::unique_ptr<Parts>& parts, std::size_t global, Once&& once,
                     Rebuild&& rebuild) {
        LOCKSTEP_REQUIRE(!capturing(core.comm().system()), errc::unsupported, core.comm().rank(),
                         "data_parallel.step",
                         "a step is not captured into a CUDA graph with on_replica_failure = "
                         "shrink (a graph cannot be computed again on fewer replicas)");
        const std::int64_t target = core.steps();
        int lost = 0;
        bool recovered = false; // a second failure of the same step is thrown, lost or not
        // The end of a background save that the status of a step computed again showed: that
        // step's result is not returned, so the end rides on this call's (observe reports an
        // end once).
        checkpoint_event seen = checkpoint_event::none;
        for (;;) {
            const std::int64_t begun = core.steps();
            const bool earlier = begun < target;
            const std::size_t g = earlier ? rollback_.global() : global;
            try {
                core.comm().barrier(collective_tag("data_parallel.fence"));
                auto& st = parts->stages;
                rollback_.keep(core, g, st.scaler().state(), st.streak(), st.layer_counts(),
                               st.layers().id());
                step_result r = once(g);
                if (!earlier) {
                    r.lost = lost;
                    if (r.checkpoint == checkpoint_event::none)
                        r.checkpoint = seen;
                    return r;
                }
                // The step this replica had completed before the loss is complete again on
                // the survivors: this call's own step is a new step, as it is for the
                // survivors that begin it in a call of their own, and gets its own recovery.
                if (r.checkpoint != checkpoint_event::none)
                    seen = r.checkpoint;
                recovered = false;
            } catch (const error& e) {
                if (recovered || !is_replica_loss(e, core.comm().run_failure()))
                    throw;
                recovered = true;
                lost += recover(core, parts, e, rebuild, begun);
            }
        }
    }

private:
    /// Shrinks, agrees on the step to start from, puts its start back (parameters, state,
    /// counters, loss scale, skip streak) and rebuilds the parts. Returns the replicas lost.
    /// (The failed step drained its collective before it threw: once() is step_runner's
    /// step_once.) `live` is the step the failed call had begun, not the step counter: on a
    /// device the counter advances when the step's work is enqueued, before the wait for its
    /// result finds the loss, and the work queued behind the aborted collectives (the update)
    /// has run on whatever they left, so the step's start must be put back (on an H200 the
    /// survivors otherwise continued one update ahead of an undisturbed run).
    template <class Parts, class Rebuild>
    int recover(Core& core, std::unique_ptr<Parts>& parts, const error& cause, Rebuild& rebuild,
                std::int64_t live) {
        auto& comm = core.comm();
        const int before = comm.size();
        // This replica, named as `gone` names the lost ones, not by the rank the shrink is about
        // to renumber: its thread index (thread_communicator::replica()); else its rank before
        // the shrink (NCCL: at a first shrink, the generation-0 rank `gone` uses).
        int me = comm.rank();
        if constexpr (requires { comm.replica(); })
            me = comm.replica();
        const std::vector<int> gone = comm.shrink();
        std::string names;
        for (int r : gone)
            names += (names.empty() ? "" : ", ") + std::to_string(r);
        LOCKSTEP_REQUIRE(comm.size() >= core.params().min_replicas, errc::peer_failure, me,
                         "data_parallel.step", "replica(s) ", names, " lost in step ", live,
                         " leave ", comm.size(), " of ", before,
                         ", fewer than train_params::min_replicas = ", core.params().min_replicas,
                         "; the failure: ", cause.what());
        const redo_point at = agree_redo(comm, rollback_.step(), live);
        auto& old = parts->stages;
        const loss_scaler_state scale = at.restore ? rollback_.scale() : old.scaler().state();
        std::vector<double> streak(old.streak().size());
        if (at.restore) {
            std::copy(rollback_.streak().begin(), rollback_.streak().end(), streak.begin());
            rollback_.restore(core, old.layer_counts(), old.layers().id());
        } else {
            copy(std::span<const double>(old.streak()), comm.system(), std::span<double>(streak),
                 host_system{1});
        }
        rebuild();
        parts->stages.scaler().restore(scale);
        parts->stages.restore_streak(streak);
        return before - comm.size();
    }

    step_rollback<Core> rollback_; ///< the start of the step in progress (or the last one)
};

} // namespace lockstep::detail

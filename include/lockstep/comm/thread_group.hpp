// lockstep/comm/thread_group.hpp: thread_group, N replicas as threads of one process, each with
// its own thread_communicator. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_event.hpp"
#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/detail/shm_group.hpp"
#include "lockstep/comm/detail/shm_shrink.hpp"
#include "lockstep/comm/detail/shm_sync.hpp"
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/error.hpp"

#include <chrono>
#include <concepts>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {

/// Runtime knobs of a thread_group.
struct thread_group_params {
    /// How long a replica waits for its peers (in a collective or a recv) before it throws
    /// errc::timeout and fails the run. Default: LOCKSTEP_TIMEOUT seconds when that
    /// environment variable is set, else 120 s. Timeouts over 1e9 s (~31 years, e.g.
    /// std::chrono::milliseconds::max() for "wait forever") are taken as 1e9 s.
    std::chrono::milliseconds timeout = default_timeout(std::chrono::seconds(120));
    /// Whether collectives without a collective_tag name compare their call sites across
    /// replicas, so that two calls of the same collective and shape issued in another order
    /// (or one skipped) are an error instead of a wrong value (see collective_tag). Default:
    /// default_check_call_sites(), i.e. LOCKSTEP_CHECK_CALL_SITES (1 on, 0 off); unset, on in
    /// builds without NDEBUG and off with NDEBUG.
    bool check_call_sites = default_check_call_sites();
    /// Fault injection (tests): called on the replica's own thread when it enters each
    /// collective and when it has arrived at the collective's first phase (collective_event).
    /// A hook that throws there makes the replica fail at that point as a crash would: the
    /// exception leaves the collective (after arrival, as a failed data phase does: peers that
    /// saw the arrival may complete the collective, the others get errc::peer_failure). Empty
    /// (the default): none.
    std::function<void(const collective_event&)> on_collective = {};
};

/// A replica a shrink left out of a thread_group's run (thread_communicator::shrink).
struct lost_replica {
    int replica;        ///< its index in the thread_group
    int generation;     ///< the generation of the group it was lost from
    std::string reason; ///< its failure, or why it was left out (departed, stalled)
};

/// N replicas as threads of one process:
///     lockstep::thread_group group(4, {.timeout = std::chrono::seconds(30)});
///     group.run([&](lockstep::thread_communicator& comm) { ... });
///
/// Aborting: abort(reason) may be called from any thread (a watchdog, a thread that waits for
/// signals, a replica), not from a signal handler (it takes a mutex). Every replica blocked in a
/// collective, send or recv wakes at once and throws errc::peer_failure ("the run was aborted:
/// <reason>"), and so does every later call. A replica that is inside its own code (computing,
/// sleeping, waiting on something that is not lockstep's) cannot be interrupted: run() joins every
/// replica thread, so it returns only when that code returns or calls into the communicator. Code
/// with long loops can poll thread_communicator::run_failed() to return early. There is no deadline
/// after which run() detaches threads. A thread_group is movable, not copyable.
class thread_group {
public:
    using params = thread_group_params;

    /// requires: size >= 1, p.timeout > 0.
    explicit thread_group(int size, params p = {})
        : size_(size), params_(std::move(p)), control_(std::make_unique<control>()) {
        LOCKSTEP_REQUIRE(size >= 1, errc::invalid_argument, -1, "thread_group", "size ", size,
                         " must be at least 1");
        LOCKSTEP_REQUIRE(params_.timeout.count() > 0, errc::invalid_argument, -1, "thread_group",
                         "timeout ", params_.timeout.count(), " ms must be positive");
    }

    /// The number of replicas run() starts.
    int size() const noexcept { return size_; }
    /// The knobs this group was made with.
    const params& parameters() const noexcept { return params_; }

    /// Fails the run in progress with `reason`, from any thread: every replica blocked in or
    /// later entering a collective, send or recv throws errc::peer_failure naming the reason,
    /// and run() rethrows lockstep::error(errc::peer_failure, operation "thread_group.abort")
    /// once every replica has returned. When no run is in progress, the next run() throws that
    /// error at once without starting replicas. A call after a replica failed changes nothing
    /// for that group, but survivors that then shrink it (thread_communicator::shrink, e.g.
    /// train_params::on_replica_failure = shrink) get a group that is aborted from the start, and
    /// run() throws the abort's error. ensures: idempotent (a later call changes nothing);
    /// returns true when this call aborted a run in progress at once (false when the run's
    /// newest group had already failed).
    bool abort(std::string reason) {
        LOCKSTEP_REQUIRE(control_ != nullptr, errc::invalid_argument, -1, "thread_group.abort",
                         "this thread_group was moved from");
        std::lock_guard lock(control_->mutex);
        if (auto ctx = control_->current) {
            // Reaches the survivors' group after a shrink, and a shrink still to come.
            const error e(errc::peer_failure, -1, "thread_group.abort", reason);
            return ctx->record_abort(std::make_exception_ptr(e), std::move(reason));
        }
        if (!control_->pending)
            control_->pending = std::move(reason);
        return false;
    }

    /// Calls f(comm) on size() new threads, each with its own thread_communicator of rank
    /// 0..size()-1, and joins them all. f is called concurrently and must allow that.
    /// ensures: returns when every replica has returned; if any replica failed, rethrows the
    /// first failure (the root cause, not the peer_failure errors it caused in the others).
    /// Where the communicator raised that failure on a replica (a timeout, a peer found gone)
    /// and the replica's function let a lockstep::error of the same code out for it, run()
    /// rethrows the function's error: the same failure with what the function added (a
    /// wrapper's rank or layer).
    /// After a shrink (thread_communicator::shrink) only the failures of the newest group count:
    /// run() returns normally when the survivors did, and lost() names the replicas left out.
    /// A replica whose thread ended with the errc::peer_failure or errc::timeout a failure
    /// caused (outside a shrink) is never shrunk over: that shrink is refused and throws on
    /// every survivor, so run() rethrows the root failure.
    /// A handle is valid only inside f: one moved out and used after run() returned (or a split
    /// of it) throws errc::invalid_argument from every collective, split, shrink, send and recv.
    template <class F>
    requires std::invocable<F&, thread_communicator&>
    void run(F&& f) {
        LOCKSTEP_REQUIRE(control_ != nullptr, errc::invalid_argument, -1, "thread_group.run",
                         "this thread_group was moved from");
        auto ctx = std::make_shared<detail::shm::run_context>(params_.timeout, size_,
                                                              params_.check_call_sites);
        ctx->set_hook(params_.on_collective);
        lost_.clear();
        {
            std::lock_guard lock(control_->mutex);
            if (control_->pending) {
                std::string reason = std::move(*control_->pending);
                control_->pending.reset();
                fail(errc::peer_failure, -1, "thread_group.abort", reason,
                     " (aborted before run() started; no replica ran)");
            }
            control_->current = ctx;
        }
        // On every way out: abort() no longer reaches this run, and a handle kept past it
        // (moved out of f) is refused at once, in every group the run's shrinks made too.
        struct detach {
            control* c;
            std::shared_ptr<detail::shm::run_context> ctx;
            ~detach() {
                for (auto at = ctx; at; at = at->successor())
                    at->mark_finished();
                std::lock_guard lock(c->mutex);
                c->current.reset();
            }
        } detach_on_exit{control_.get(), ctx};
        std::vector<int> replicas(static_cast<std::size_t>(size_));
        std::iota(replicas.begin(), replicas.end(), 0);
        auto world = std::make_shared<detail::shm::group_state>(ctx, std::move(replicas),
                                                                std::string(), size_);
        world->mark_world();
        const auto replica_main = [&](int r) {
            // Made outside the try block: a failing replica records its failure before its
            // handle departs, so peers report the failure rather than the departure.
            thread_communicator comm(world, r);
            try {
                std::invoke(f, comm);
            } catch (...) {
                // Into the context of the group the replica is in now (a shrink's, maybe).
                const auto e = std::current_exception();
                auto& at = comm.group_ ? comm.group_->context() : *ctx;
                at.record_exit(r, e, detail::shm::describe(e));
                // Ended by a peer's failure (peer_failure, timeout): the survivors' shrink of
                // this group is refused rather than dropping this healthy replica silently.
                if (comm.group_)
                    detail::shm::note_departure(*comm.group_, comm.rank_, e);
            }
            // After its failure is recorded: peers that wait for a handle this thread left
            // while unwinding now take it as gone (group_state::gone).
            ctx->mark_thread_ended(r);
        };
        std::vector<std::thread> threads;
        threads.reserve(static_cast<std::size_t>(size_));
        try {
            for (int r = 0; r < size_; ++r)
                threads.emplace_back(replica_main, r);
        } catch (...) {
            const auto e = std::current_exception();
            ctx->record_failure(static_cast<int>(threads.size()), e, detail::shm::describe(e));
            for (std::size_t r = threads.size(); r < static_cast<std::size_t>(size_); ++r) {
                world->depart(static_cast<int>(r));
                ctx->mark_thread_ended(static_cast<int>(r));
            }
        }
        for (auto& t : threads)
            t.join();
        auto last = ctx;
        while (auto next = last->successor()) {
            for (auto& x : last->excluded())
                lost_.push_back({x.replica, last->generation(), std::move(x.reason)});
            last = next;
        }
        if (auto e = last->root_failure())
            std::rethrow_exception(e);
    }

    /// The replicas the last run() lost to shrinks, in the order they were left out (empty
    /// when nothing shrank).
    const std::vector<lost_replica>& lost() const noexcept { return lost_; }

private:
    // What abort() reaches: the run in progress, or an abort waiting for the next run.
    struct control {
        std::mutex mutex;
        std::shared_ptr<detail::shm::run_context> current;
        std::optional<std::string> pending;
    };

    int size_;
    params params_;
    std::unique_ptr<control> control_;
    std::vector<lost_replica> lost_;
};

} // namespace lockstep

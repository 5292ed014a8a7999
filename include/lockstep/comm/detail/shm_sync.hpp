// lockstep/comm/detail/shm_sync.hpp: the state one thread_group::run shares by all its replica
// threads (the first failure, and spin-then-block waiting). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_event.hpp"
#include "lockstep/comm/detail/adaptive_spin.hpp"
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::detail::shm {

using clock = std::chrono::steady_clock;

/// Tells the core that this thread is spinning (the other hyper-thread may run).
inline void cpu_relax() noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) && !defined(__CUDA_ARCH__)
    asm volatile("yield");
#endif
}

/// What every replica of one thread_group::run shares: the first (root-cause) failure and the
/// place where blocked replicas sleep. Every state change another replica may wait for (an
/// arrival, a message, a departure, a failure) is followed by notify().
class run_context {
public:
    /// requires: timeout > 0, replicas >= 1 (the threads of the run). check_call_sites: see
    /// thread_group_params.
    run_context(std::chrono::milliseconds timeout, int replicas, bool check_call_sites = false)
        : spin_(spin_budget(replicas)), core_per_replica_(core_per_replica(replicas)),
          timeout_(timeout), check_call_sites_(check_call_sites),
          ended_(new std::atomic<bool>[static_cast<std::size_t>(replicas)]()) {}
    run_context(const run_context&) = delete;
    run_context& operator=(const run_context&) = delete;

    /// How long a replica waits for its peers before it throws errc::timeout.
    std::chrono::milliseconds timeout() const noexcept { return timeout_; }
    /// Whether collectives compare the call sites of unnamed calls (collective_tag).
    bool check_call_sites() const noexcept { return check_call_sites_; }
    /// The deadline of a wait that starts now: deadline_after(timeout()) (a timeout over
    /// max_wait, milliseconds::max() included, waits max_wait: the sum cannot overflow).
    clock::time_point deadline() const { return deadline_after<clock>(timeout_); }

    /// True once any replica of the run has failed.
    bool failed() const noexcept { return failed_.load(); }

    /// True once the thread_group::run this context serves has returned (mark_finished): a
    /// handle kept past it has no peers left, so its every call is refused at once instead of
    /// waiting out the timeout (or, alone in its group, succeeding).
    bool finished() const noexcept { return finished_.load(std::memory_order_acquire); }
    /// Called by thread_group::run after it has joined every replica thread.
    void mark_finished() noexcept { finished_.store(true, std::memory_order_release); }

    /// Records `e`, thrown on `replica`, as the failure of the run unless one is recorded
    /// already, and wakes every sleeping replica. A recorded errc::peer_failure only echoes a
    /// failure that may be recorded after it (a parameter server tells its workers before it
    /// throws; a failing replica's split communicator departs while it unwinds): the first
    /// failure of another kind replaces it, so run() rethrows the root cause. ensures: failed();
    /// returns true when this call recorded the root failure.
    bool record_failure(int replica, std::exception_ptr e, std::string what) {
        return record(replica, std::move(e), std::move(what), true);
    }

    /// As record_failure, for `e` leaving `replica`'s own code (thread_group::run, or a
    /// handle's record_failure while an object of the caller's still holds it). Where the
    /// recorded failure is one the communicator itself raised on that same replica (a timeout,
    /// a departed peer it found) and e is a lockstep::error of the same code, e replaces it:
    /// the same failure as the replica's code reported it, with what that code added (e.g. a
    /// hierarchical_communicator's rank in the whole job).
    bool record_exit(int replica, std::exception_ptr e, std::string what) {
        {
            std::lock_guard lock(failure_mutex_);
            if (root_ && replica >= 0 && raised_on_ == replica && same_code(root_, e)) {
                replaced_.push_back(std::move(root_));
                root_ = std::move(e);
                root_what_ = std::move(what);
                raised_on_ = -1;
                return true;
            }
        }
        return record(replica, std::move(e), std::move(what), false);
    }

    /// Records thread_group::abort's error `e` (reason `what`): as the failure of the newest
    /// context of the run (this one, or the one a shrink replaced it with), and, first abort
    /// only, as this context's abort, which set_successor hands on: the group a shrink makes of
    /// a failed group starts failed with it, so an abort between a replica's loss and the
    /// survivors' shrink is not lost. Returns true when this call recorded the root failure.
    bool record_abort(std::exception_ptr e, std::string what) {
        std::shared_ptr<run_context> next;
        {
            std::lock_guard lock(failure_mutex_);
            if (abort_)
                return false; // idempotent: the first abort stands (and was handed on)
            abort_ = e;
            abort_what_ = what;
            next = successor_; // read under the same mutex as set_successor's hand-on
        }
        if (next)
            return next->record_abort(std::move(e), std::move(what));
        return record_failure(-1, std::move(e), std::move(what));
    }

    /// "replica R failed: <what>" for the recorded failure ("the run was aborted: <reason>"
    /// after thread_group::abort, recorded with replica -1). requires: failed().
    std::string failure_description() const {
        std::lock_guard lock(failure_mutex_);
        if (successor_) // a shrink replaced the group: what a replica still on it must learn
            return superseded_ + " (it had failed: " + root_text() + ")";
        return root_text();
    }
    /// What a replica still on this group is told once a shrink replaced it.
    void set_superseded(std::string text) {
        std::lock_guard lock(failure_mutex_);
        superseded_ = std::move(text);
    }

private:
    // record_failure (`raised`: by the communicator itself) and record_exit's common path.
    bool record(int replica, std::exception_ptr e, std::string what, bool raised) {
        const bool echo = echoes_peer(e);
        {
            std::lock_guard lock(failure_mutex_);
            if (root_ && (echo || !root_echoes_))
                return false;
            // The echo it replaces stays alive with the context: other threads may still read
            // the exception object (a thread's own exception_ptr to it may be its last).
            if (root_)
                replaced_.push_back(std::move(root_));
            root_ = std::move(e);
            root_echoes_ = echo;
            root_replica_ = replica;
            raised_on_ = raised ? replica : -1;
            root_what_ = std::move(what);
            failed_.store(true);
        }
        notify();
        return true;
    }

    static std::optional<errc> code_of(const std::exception_ptr& e) {
        try {
            if (e)
                std::rethrow_exception(e);
        } catch (const lockstep::error& le) {
            return le.code();
        } catch (...) {
        }
        return std::nullopt;
    }
    static bool same_code(const std::exception_ptr& a, const std::exception_ptr& b) {
        const auto ca = code_of(a);
        return ca && ca == code_of(b);
    }

    static bool echoes_peer(const std::exception_ptr& e) {
        return code_of(e) == errc::peer_failure;
    }

    std::string root_text() const {
        if (root_replica_ < 0)
            return "the run was aborted: " + root_what_;
        return "replica " + std::to_string(root_replica_) + " failed: " + root_what_;
    }

public:
    /// The replica whose failure is recorded (-1 if none).
    int failed_replica() const {
        std::lock_guard lock(failure_mutex_);
        return root_replica_;
    }
    /// The recorded failure (null if none).
    std::exception_ptr root_failure() const {
        std::lock_guard lock(failure_mutex_);
        return root_;
    }

    /// Waits until ready() is true or `deadline` passes: spins briefly, then sleeps, so
    /// replicas that outnumber the cores do not burn the time their peers need. (No
    /// sched_yield phase: on a loaded machine each yield can cost a whole time slice.)
    /// requires: every change that can make ready() true is followed by notify().
    /// ensures: returns ready() as last evaluated (false only after the deadline).
    /// `spin`: spin at least this long (see data_phase_spin).
    template <class Ready>
    bool wait_until(Ready ready, clock::time_point deadline,
                    std::chrono::nanoseconds spin = std::chrono::nanoseconds(0)) {
        const clock::time_point spin_end = clock::now() + std::max(spin_, spin);
        for (int i = 1;; ++i) {
            if (ready())
                return true;
            cpu_relax();
            if (i % 32 == 0 && clock::now() >= spin_end)
                break;
        }
        std::unique_lock lock(sleep_mutex_);
        // Dekker with the notifier: it publishes its change, then reads sleepers_; this thread
        // counts itself in, then evaluates ready() under the mutex. One of the two sees the
        // other, so a wake-up is never lost.
        sleepers_.fetch_add(1);
        const bool ok = sleep_.wait_until(lock, deadline, ready);
        sleepers_.fetch_sub(1);
        return ok;
    }

    /// Marks the thread of `replica` ended (thread_group::run, after it recorded the thread's
    /// failure) and wakes every sleeping replica.
    void mark_thread_ended(int replica) {
        ended_[replica].store(true);
        notify();
    }
    bool thread_ended(int replica) const noexcept { return ended_[replica].load(); }
    /// A shrink's context shares its predecessor's record (indexed as in the thread_group).
    void share_thread_ends(const run_context& from) { ended_ = from.ended_; }

    /// The fault-injection hook (thread_group_params::on_collective; empty: none).
    using event_hook = std::function<void(const collective_event&)>;
    const event_hook& hook() const noexcept { return hook_; }
    void set_hook(event_hook h) { hook_ = std::move(h); }

    /// The generation of the group this context serves: 0 for thread_group::run's, g + 1 for
    /// the group a shrink of generation g made (each shrink starts a context of its own, so
    /// the survivors' collectives never see the old group's failure).
    int generation() const noexcept { return generation_; }
    void set_generation(int g) noexcept { generation_ = g; }

    /// A replica a shrink left out: its thread_group index and why.
    struct excluded_replica {
        int replica;
        std::string reason;
    };
    /// The context of the group that replaced this one's (shrink), null when none did, and
    /// the replicas that shrink left out.
    std::shared_ptr<run_context> successor() const {
        std::lock_guard lock(failure_mutex_);
        return successor_;
    }
    std::vector<excluded_replica> excluded() const {
        std::lock_guard lock(failure_mutex_);
        return excluded_;
    }
    /// Links the context of the group that replaced this one's; an abort recorded here already
    /// (record_abort) fails `next` too, before any survivor can use it.
    void set_successor(const std::shared_ptr<run_context>& next,
                       std::vector<excluded_replica> left) {
        std::exception_ptr aborted;
        std::string what;
        {
            std::lock_guard lock(failure_mutex_);
            successor_ = next;
            excluded_ = std::move(left);
            aborted = abort_;
            what = abort_what_;
        }
        if (aborted)
            next->record_abort(std::move(aborted), std::move(what));
    }

    /// Wakes every sleeping replica so it re-evaluates what it waits for.
    void notify() {
        if (sleepers_.load() == 0)
            return;
        { std::lock_guard lock(sleep_mutex_); }
        sleep_.notify_all();
    }

    /// How long a replica that has done its share of a collective's data work (`worked`) spins
    /// for its peers before it sleeps. They do the same work, so with a core per replica they
    /// arrive within about that time: spinning that long (at most max_data_spin) saves the
    /// wake-up a sleep costs (about 15 us on the 2-core VM, twice per large all_reduce: 0.27 of
    /// a 4 MiB one). With more replicas than hardware threads the short spin stays: the peer may
    /// need this very core.
    std::chrono::nanoseconds data_phase_spin(std::chrono::nanoseconds worked) const noexcept {
        if (!core_per_replica_)
            return spin_;
        return std::clamp<std::chrono::nanoseconds>(worked, spin_, max_data_spin);
    }
    static constexpr std::chrono::nanoseconds max_data_spin = std::chrono::milliseconds(2);

    /// How long a replica spins at a collective's entry before it sleeps, from how long its
    /// recent entries waited (wait_estimate: twice that, at least the fixed budget, at most
    /// max_entry_spin). With more replicas than hardware threads the short spin stays.
    std::chrono::nanoseconds entry_spin(const wait_estimate& entries) const noexcept {
        if (!core_per_replica_)
            return spin_;
        return entries.spin(spin_, max_entry_spin);
    }
    static constexpr std::chrono::nanoseconds max_entry_spin = std::chrono::microseconds(200);

private:
    static bool core_per_replica(int replicas) {
        return replicas <= host_system::hardware_threads();
    }

    /// How long a waiter spins before it sleeps. With a core per replica the awaited peer is
    /// usually running and arrives within microseconds; with more replicas than hardware
    /// threads it is often waiting for the very core this thread spins on. (Measured on the
    /// shared 2-core box: 2 replicas, 1-float all_reduce, 20 us of spinning was 2-4x slower
    /// than 1-4 us once other processes competed for the cores.)
    static std::chrono::nanoseconds spin_budget(int replicas) {
        return core_per_replica(replicas) ? std::chrono::microseconds(4)
                                          : std::chrono::microseconds(1);
    }

    std::chrono::nanoseconds spin_;
    bool core_per_replica_;

    std::chrono::milliseconds timeout_;
    bool check_call_sites_ = false;
    std::atomic<bool> failed_{false};
    std::atomic<bool> finished_{false};
    mutable std::mutex failure_mutex_;
    std::exception_ptr root_;
    bool root_echoes_ = false; ///< root_ is an errc::peer_failure (replaceable: record_failure)
    std::vector<std::exception_ptr> replaced_; ///< the echoes root_ replaced (kept alive)
    int root_replica_ = -1;
    int raised_on_ = -1; ///< root_ was raised by the communicator on this replica (record_exit)
    std::string root_what_;
    std::shared_ptr<run_context> successor_;
    std::vector<excluded_replica> excluded_;
    std::string superseded_;
    std::exception_ptr abort_; // thread_group::abort's error, handed on to successor_
    std::string abort_what_;
    event_hook hook_;
    /// Which replica threads of the run (by their index in the thread_group) have ended.
    std::shared_ptr<std::atomic<bool>[]> ended_;
    int generation_ = 0;

    std::atomic<int> sleepers_{0};
    std::mutex sleep_mutex_;
    std::condition_variable sleep_;
};

/// The message of an exception in flight, for failure descriptions.
inline std::string describe(const std::exception_ptr& e) {
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& x) {
        return x.what();
    } catch (...) {
        return "an exception not derived from std::exception";
    }
}

} // namespace lockstep::detail::shm

// lockstep/comm/detail/shm_group.hpp: the shared state of one group of replica threads
// (phase epochs, published calls, mailboxes) and the rendezvous every collective starts with
// (shm_validate.hpp checks the calls it brings together). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/shm_call.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"
#include "lockstep/comm/detail/shm_sync.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::detail::shm {

/// One message of send/recv: a copy of the sender's elements.
struct message {
    int source = 0;
    int tag = 0;
    element_type type = element_type::bytes;
    std::size_t elem_size = 0;
    std::size_t count = 0;
    std::vector<unsigned char> bytes;
};

/// The messages addressed to one rank, in arrival order (so FIFO per source and tag).
struct mailbox {
    std::mutex mutex;
    std::deque<message> queue;
};

/// A phase epoch no real phase reaches: the replica has left the collective after a failure
/// and touches no peer's memory any more.
inline constexpr std::uint64_t left_epoch = std::numeric_limits<std::uint64_t>::max();

/// Collectives whose send data fit in this many bytes go through the senders' stash: one
/// phase instead of two or three, and nobody reads a peer's own buffers.
inline constexpr std::size_t stash_bytes = 4096;

/// One replica's shared slots, on its own cache lines.
struct alignas(64) member_slot {
    std::atomic<std::uint64_t> epoch{0}; ///< phases this replica has arrived at
    std::atomic<bool> departed{false};   ///< its communicator handle was destroyed
    /// Destroyed while its thread unwound an exception (set before departed): the thread
    /// records that exception as the run's failure when it reaches thread_group::run.
    std::atomic<bool> unwound{false};
    /// At left_epoch: the epoch of the first phase of the collective it left (a member leaves
    /// a group once).
    std::atomic<std::uint64_t> left_from{0};
    std::array<call_record, 2> calls; ///< indexed by sequence number parity
    /// A copy of the send data of small collectives, indexed like calls.
    alignas(64) std::array<std::array<unsigned char, stash_bytes>, 2> stash;
};

/// The state the replicas of one group (the whole run, or a split of it) share. Each replica
/// keeps its own sequence number and epoch in its thread_communicator; because every replica
/// calls the same collectives in the same order, they agree.
///
/// Phases: a collective of P phases moves every member's epoch from e to e + P; phase k is
/// complete when every member's epoch is >= e + k. A replica publishes its call_record (at
/// index seq % 2) before the first phase; nobody can reach seq + 2 before everybody passed the
/// first phase of seq + 1, so a record (or stash) is never overwritten while a peer reads it.
class group_state {
public:
    /// requires: replicas non-empty (replicas[r] is the global replica index of rank r).
    group_state(std::shared_ptr<run_context> ctx, std::vector<int> replicas, std::string label,
                int replicas_in_process)
        : ctx_(std::move(ctx)), replicas_(std::move(replicas)), label_(std::move(label)),
          replicas_in_process_(replicas_in_process),
          system_(host_system::default_threads(replicas_in_process)),
          members_(std::make_unique<member_slot[]>(replicas_.size())),
          mailboxes_(std::make_unique<mailbox[]>(replicas_.size())) {}
    group_state(const group_state&) = delete;
    group_state& operator=(const group_state&) = delete;

    int size() const noexcept { return static_cast<int>(replicas_.size()); }
    int replica_of(int rank) const noexcept { return replicas_[static_cast<std::size_t>(rank)]; }
    const std::vector<int>& replicas() const noexcept { return replicas_; }
    const std::string& label() const noexcept { return label_; }
    int replicas_in_process() const noexcept { return replicas_in_process_; }
    /// The host system of every member (thread budget fixed when the group is made).
    const host_system& system() const noexcept { return system_; }
    run_context& context() noexcept { return *ctx_; }
    const run_context& context() const noexcept { return *ctx_; }
    const std::shared_ptr<run_context>& context_ptr() const noexcept { return ctx_; }
    member_slot& member(int rank) noexcept { return members_[static_cast<std::size_t>(rank)]; }
    mailbox& mailbox_of(int rank) noexcept { return mailboxes_[static_cast<std::size_t>(rank)]; }
    const call_record& call(int rank, std::uint64_t seq) const noexcept {
        return members_[static_cast<std::size_t>(rank)].calls[seq % 2];
    }

    /// "all_reduce #3" (plus " in <label>" for a sub-group): how messages name a call.
    std::string operation(op_label l) const {
        std::string s = std::string(l.name) + " #" + std::to_string(l.seq);
        if (!label_.empty())
            s += " in " + label_;
        return s;
    }

    /// True once any collective of this group was abandoned after a failure (the group is
    /// dead: every later collective throws at once).
    bool aborted() const noexcept { return aborted_.load(); }
    /// Makes the group dead (a shrink replaced it) and wakes its waiters.
    void abort_group() {
        aborted_.store(true);
        ctx_->notify();
    }

    /// What the survivors of a shrink of this group agree through (comm/detail/shm_shrink.hpp):
    /// who arrived, and once decided, the survivors' ranks and their new group.
    struct shrink_slot {
        std::mutex mutex;
        std::condition_variable changed;
        std::vector<char> arrived;
        bool decided = false;
        std::vector<int> survivors;
        std::shared_ptr<group_state> next;
    };
    shrink_slot& shrink_state() noexcept { return shrink_; }
    /// True for a group thread_group::run or a shrink made (not a split): the groups that
    /// can shrink.
    bool world() const noexcept { return world_; }
    void mark_world() noexcept { world_ = true; }

    /// Marks rank's handle destroyed and wakes the peers (who may be waiting for it).
    /// `unwinding`: destroyed while its thread unwinds an exception (see gone()).
    void depart(int rank, bool unwinding = false) {
        if (unwinding)
            member(rank).unwound.store(true);
        member(rank).departed.store(true);
        ctx_->notify();
    }

    /// Whether rank's member is gone for good: its handle was destroyed, and, when that
    /// happened while its thread unwound an exception (a trainer's split, e.g. the
    /// communication thread's, destroyed by the step's exception), its thread has ended too.
    /// Until then its peers wait for the run's failure, which that thread records as it leaves
    /// (thread_group::run): they name the exception, not the departure. A thread that catches
    /// the exception and goes on leaves them waiting until the timeout.
    bool gone(int rank) const noexcept {
        const member_slot& m = members_[static_cast<std::size_t>(rank)];
        return m.departed.load() && (!m.unwound.load() || ctx_->thread_ended(replica_of(rank)));
    }

    /// Throws errc::peer_failure if the run has failed or the group is dead.
    template <class Op>
    void throw_if_failed(int rank, const Op& op) {
        if (ctx_->failed() || aborted())
            fail(errc::peer_failure, replica_of(rank), name(op), ctx_->failure_description());
    }

    /// Publishes rank's call for `seq` (and `bytes` of data into its stash, bytes <=
    /// stash_bytes), before it arrives at the collective's first phase.
    void publish(int rank, std::uint64_t seq, call_record rec, const void* data,
                 std::size_t bytes) {
        member_slot& m = member(rank);
        m.calls[seq % 2] = std::move(rec);
        if (bytes != 0)
            std::memcpy(m.stash[seq % 2].data(), data, bytes);
    }
    /// The stash rank filled for `seq`.
    const unsigned char* stash(int rank, std::uint64_t seq) const noexcept {
        return members_[static_cast<std::size_t>(rank)].stash[seq % 2].data();
    }

    /// Arrives at phase epoch `target` (rank's epoch becomes target) and waits until every
    /// member has. `first` and `last` are the epochs of the collective's first and final phase
    /// (no data phase follows `last`). On failure (the run failed, a missing member departed,
    /// or the timeout passed) the group is aborted and this throws, after waiting until no peer
    /// can still be reading or writing rank's buffers; at the final phase, once every member
    /// reached it (reached_by_all), it returns although the group failed since.
    /// `spin`: see run_context::wait_until.
    void arrive_and_wait(int rank, std::uint64_t target, std::uint64_t first, std::uint64_t last,
                         op_label label,
                         std::chrono::nanoseconds spin = std::chrono::nanoseconds(0)) {
        member(rank).epoch.store(target);
        ctx_->notify();
        if (target == first && ctx_->hook()) {
            // Fault injection: a hook that throws here leaves the collective as a failed data
            // phase does (peers may already be past this phase).
            try {
                ctx_->hook()({collective_event::moment::arrived, replica_of(rank), rank,
                              ctx_->generation(), label.seq, label.name, label_,
                              call(rank, label.seq).tag});
            } catch (...) {
                abandon_current(rank, first, last, std::current_exception());
            }
        }
        const auto complete = [&] {
            for (int j = 0; j < size(); ++j)
                if (member(j).epoch.load() < target)
                    return false;
            return true;
        };
        const auto departed_missing = [&] {
            for (int j = 0; j < size(); ++j)
                if (member(j).epoch.load() < target && gone(j))
                    return true;
            return false;
        };
        const auto ready = [&] {
            return complete() || aborted() || ctx_->failed() || departed_missing();
        };
        const bool in_time = ctx_->wait_until(ready, ctx_->deadline(), spin);
        // Epochs first, then the abort flag: a member that aborts sets the flag before it
        // reads the epochs, so either it sees this replica proceed or this replica sees it.
        if (complete() && !aborted())
            return;
        // The final phase, which every member reached (one at left_epoch left a later
        // collective, after it had come here): every data phase is done and this replica's
        // result is whole, although the group failed since. It returns, as the members that
        // saw the phase complete before the failure did, and its next collective reports the
        // failure: members that all completed a collective agree that they did.
        if (target == last && reached_by_all(target))
            return;
        const int me = replica_of(rank);
        const std::string op = operation(label);
        if (aborted() || ctx_->failed()) {
            abandon(rank, first, last,
                    error(errc::peer_failure, me, op, ctx_->failure_description()));
        }
        if (departed_missing()) {
            std::string who;
            for (int j = 0; j < size(); ++j)
                if (member(j).epoch.load() < target && gone(j))
                    who += (who.empty() ? "" : ", ") + std::to_string(replica_of(j));
            error e(errc::peer_failure, me, op,
                    "replica " + who +
                        " left the group (its communicator was destroyed) without joining");
            ctx_->record_failure(me, std::make_exception_ptr(e), e.what());
            abandon(rank, first, last, std::move(e));
        }
        (void)in_time;
        std::string missing;
        for (int j = 0; j < size(); ++j)
            if (member(j).epoch.load() < target)
                missing += (missing.empty() ? "" : ", ") + std::to_string(replica_of(j));
        error e(errc::timeout, me, op,
                "timed out after " + std::to_string(ctx_->timeout().count()) +
                    " ms waiting for replica(s) " + missing + " (missing)");
        ctx_->record_failure(me, std::make_exception_ptr(e), e.what());
        abandon(rank, first, last, std::move(e));
    }

    /// For an exception thrown inside a data phase (between phases `first`..`last` of a
    /// collective): records it as the run's failure, leaves the collective like a failed wait
    /// does, and rethrows it.
    [[noreturn]] void abandon_current(int rank, std::uint64_t first, std::uint64_t last,
                                      const std::exception_ptr& e) {
        ctx_->record_failure(replica_of(rank), e, describe(e));
        leave_collective(rank, first, last);
        std::rethrow_exception(e);
    }

private:
    std::string name(const std::string& op) const { return op; }
    std::string name(op_label l) const { return operation(l); }

    /// Leaves the current collective after a failure: marks the group dead, then waits until
    /// no peer can still be reading or writing this replica's buffers; then throws e.
    [[noreturn]] void abandon(int rank, std::uint64_t first, std::uint64_t last, error e) {
        leave_collective(rank, first, last);
        throw std::move(e);
    }

    /// Marks the group dead and leaves the current collective (phases `first`..`last`), in
    /// every phase, the final one included (peers may still be in the data phase before it,
    /// reading this replica's send and writing its recv). It first waits until every member is
    /// drained: below `first` (never entered), at or above `last` (its data work is done:
    /// nothing follows the final phase but the wait, which sees the abort), at left_epoch, or
    /// departed. The wait is bounded: a member between `first` and `last` is in a data phase,
    /// which copies and reduces host memory and never blocks (an exception in it leaves through
    /// abandon_current), or in a phase wait, which sees the abort; either way it soon arrives
    /// at a later epoch or left_epoch. Nobody waits for a member that waits for it: a leaving
    /// member is at left_epoch before it waits. (A collective_event hook that blocks at
    /// `arrived` holds its member at `first`, as it holds its peers' phase waits.)
    void leave_collective(int rank, std::uint64_t first, std::uint64_t last) {
        aborted_.store(true);
        member(rank).left_from.store(first);
        member(rank).epoch.store(left_epoch);
        ctx_->notify();
        const auto drained = [&] {
            for (int j = 0; j < size(); ++j) {
                const std::uint64_t at = member(j).epoch.load();
                if (at >= first && at < last && !member(j).departed.load())
                    return false;
            }
            return true;
        };
        while (!ctx_->wait_until(drained, clock::now() + std::chrono::hours(1))) {
        }
    }

    /// Whether every member arrived at phase epoch `target`: its epoch is at least target, and
    /// one at left_epoch left a collective that began after target (left_from is read after
    /// the epoch, which leave_collective stores after it).
    bool reached_by_all(std::uint64_t target) const noexcept {
        for (int j = 0; j < size(); ++j) {
            const member_slot& m = members_[static_cast<std::size_t>(j)];
            const std::uint64_t at = m.epoch.load();
            if (at < target || (at == left_epoch && m.left_from.load() <= target))
                return false;
        }
        return true;
    }

    std::shared_ptr<run_context> ctx_;
    std::vector<int> replicas_;
    std::string label_;
    int replicas_in_process_;
    host_system system_;
    std::unique_ptr<member_slot[]> members_;
    std::unique_ptr<mailbox[]> mailboxes_;
    std::atomic<bool> aborted_{false};
    bool world_ = false;
    shrink_slot shrink_;
};

} // namespace lockstep::detail::shm

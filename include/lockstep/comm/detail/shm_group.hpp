// lockstep/comm/detail/shm_group.hpp: the shared state of one group of replica threads
// (phase epochs, published calls, mailboxes) and the checked rendezvous every collective starts
// with. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"
#include "lockstep/comm/detail/shm_sync.hpp"
#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
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
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace lockstep::detail::shm {

class group_state;

/// Which collective a replica called.
enum class collective_kind : unsigned char {
    barrier,
    broadcast,
    all_gather,
    all_reduce,
    reduce,
    split,
    all_to_all,
    reduce_scatter,
    all_combine
};

inline const char* name_of(collective_kind k) noexcept {
    switch (k) {
    case collective_kind::barrier:
        return "barrier";
    case collective_kind::broadcast:
        return "broadcast";
    case collective_kind::all_gather:
        return "all_gather";
    case collective_kind::all_reduce:
        return "all_reduce";
    case collective_kind::reduce:
        return "reduce";
    case collective_kind::split:
        return "split";
    case collective_kind::all_to_all:
        return "all_to_all";
    case collective_kind::reduce_scatter:
        return "reduce_scatter";
    case collective_kind::all_combine:
        return "all_combine";
    }
    return "collective";
}

/// What one replica passed to one collective; published before the first phase, read by the
/// peers after it (the phase's release/acquire orders the plain fields).
struct call_record {
    collective_kind kind = collective_kind::barrier;
    element_type type = element_type::bytes;
    std::size_t elem_size = 0;
    std::size_t count = 0;      ///< elements sent (broadcast: elements of data)
    std::size_t recv_count = 0; ///< elements of the receive span
    int root = 0;
    reduce_op op = reduce_op::sum;
    int color = 0;
    int key = 0;
    const void* send = nullptr;
    void* recv = nullptr;
    /// all_combine: the replica's `arrays` input arrays of `count` elements (send is unused).
    const void* const* arrays = nullptr;
    std::size_t array_count = 0;
    std::shared_ptr<group_state> child; ///< split: the new group, published by its leader
    /// reduce_scatter: a copy of the per-rank counts (a copy, because a peer may still read
    /// the record after this replica has returned from a one-phase collective); empty for the
    /// other collectives.
    std::vector<std::size_t> counts;
    /// reduce_scatter: the entries of a null counts span (then nothing is copied), else 0.
    std::size_t null_counts = 0;
    /// What is wrong with this replica's own arguments ("" when nothing): a null span with a
    /// non-zero count, or more elements than memory can hold. Every member then throws it.
    std::string problem;
    /// The call's identity (collective_tag::identity: its name, its call site, or "" for
    /// none), compared with the collective.
    std::string tag;
    /// True when `tag` is a call site ("train.cpp:42"), false when it is a name.
    bool tag_is_site = false;
};

/// "all_reduce #7 (4 float32s, sum, tag 'bucket 2')": one replica's call, for messages.
inline std::string describe_call(const call_record& c, std::uint64_t seq) {
    std::string s = std::string(name_of(c.kind)) + " #" + std::to_string(seq);
    std::string args;
    if (c.kind != collective_kind::barrier && c.kind != collective_kind::split)
        args = count_of(c.count, c.type, c.elem_size);
    if (c.kind == collective_kind::all_reduce || c.kind == collective_kind::reduce ||
        c.kind == collective_kind::reduce_scatter)
        args += ", " + std::string(to_string(c.op));
    if (c.kind == collective_kind::broadcast || c.kind == collective_kind::reduce)
        args += ", root " + std::to_string(c.root);
    if (!c.tag.empty())
        args += (args.empty() ? "" : ", ") +
                (c.tag_is_site ? "at " + c.tag : std::string("tag '") + c.tag + "'");
    return args.empty() ? s : s + " (" + args + ")";
}

/// What is wrong with the spans of `c` (see call_record::problem), "" when they are usable.
inline std::string record_problem(const call_record& c) {
    const std::size_t limit =
        static_cast<std::size_t>(PTRDIFF_MAX) / std::max<std::size_t>(1, c.elem_size);
    const auto check = [&](const void* p, std::size_t n, const char* what) -> std::string {
        if (p == nullptr && n != 0)
            return std::string("a null ") + what + " span of " + std::to_string(n) + " elements";
        if (n > limit)
            return std::string("a ") + what + " span of " + std::to_string(n) + " elements of " +
                   std::to_string(c.elem_size) + " bytes, more than memory can hold (at most " +
                   std::to_string(limit) + ")";
        return {};
    };
    std::string a;
    if (c.kind == collective_kind::all_combine) {
        if (c.arrays == nullptr && c.array_count != 0)
            a = "a null span of " + std::to_string(c.array_count) + " input arrays";
        for (std::size_t k = 0; a.empty() && c.arrays != nullptr && k < c.array_count; ++k)
            a = check(c.arrays[k], c.count, ("input array " + std::to_string(k)).c_str());
    } else {
        a = check(c.send, c.count, "send");
    }
    std::string b = check(c.recv, c.recv_count, "receive");
    if (c.null_counts != 0)
        b += (b.empty() ? "" : " and ") + std::string("a null counts span of ") +
             std::to_string(c.null_counts) + " entries";
    if (!a.empty() && !b.empty())
        return a + " and " + b;
    return a.empty() ? b : a;
}

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

/// Names one collective call in messages ("all_reduce #3"); formatted only when an error is.
struct op_label {
    const char* name;
    std::uint64_t seq;
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
    std::array<call_record, 2> calls;    ///< indexed by sequence number parity
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
    void depart(int rank) {
        member(rank).departed.store(true);
        ctx_->notify();
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
    /// member has. `first` is the epoch of the collective's first phase; `final_phase` says no
    /// data phase follows. On failure (the run failed, a missing member departed, or the
    /// timeout passed) the group is aborted and this throws, after waiting until no peer can
    /// still be reading rank's buffers. `spin`: see run_context::wait_until.
    void arrive_and_wait(int rank, std::uint64_t target, std::uint64_t first, bool final_phase,
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
                abandon_current(rank, first, final_phase, std::current_exception());
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
                if (member(j).epoch.load() < target && member(j).departed.load())
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
        const int me = replica_of(rank);
        const std::string op = operation(label);
        if (aborted() || ctx_->failed()) {
            abandon(rank, first, final_phase,
                    error(errc::peer_failure, me, op, ctx_->failure_description()));
        }
        if (departed_missing()) {
            std::string who;
            for (int j = 0; j < size(); ++j)
                if (member(j).epoch.load() < target && member(j).departed.load())
                    who += (who.empty() ? "" : ", ") + std::to_string(replica_of(j));
            error e(errc::peer_failure, me, op,
                    "replica " + who +
                        " left the group (its communicator was destroyed) without joining");
            ctx_->record_failure(me, std::make_exception_ptr(e), e.what());
            abandon(rank, first, final_phase, std::move(e));
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
        abandon(rank, first, final_phase, std::move(e));
    }

    /// For an exception thrown inside a data phase (between phases `first`.. of a collective):
    /// records it as the run's failure, leaves the collective like a failed wait does, and
    /// rethrows it.
    [[noreturn]] void abandon_current(int rank, std::uint64_t first, bool final_phase,
                                      const std::exception_ptr& e) {
        ctx_->record_failure(replica_of(rank), e, describe(e));
        leave_collective(rank, first, final_phase);
        std::rethrow_exception(e);
    }

    /// Checks that every member made the same call at `seq` (same collective, element type,
    /// count, reduction, root; receive spans of the right size). Every member reads the same
    /// records, so all of them throw the same error or none does.
    void validate(int rank, op_label label) const;

private:
    /// validate's part for reduce_scatter, after kinds, types and send counts agree: equal
    /// per-rank counts, one per member, summing to the send count; each receive span this
    /// member's slice of its send span or disjoint from it.
    void validate_scatter(int rank, op_label label) const;

    std::string name(const std::string& op) const { return op; }
    std::string name(op_label l) const { return operation(l); }

    /// Leaves the current collective after a failure: marks the group dead, then, if peers
    /// may be inside a data phase reading this replica's buffers, waits until each of them
    /// has left too or never entered; then throws e.
    [[noreturn]] void abandon(int rank, std::uint64_t first, bool final_phase, error e) {
        leave_collective(rank, first, final_phase);
        throw std::move(e);
    }

    /// Marks the group dead and leaves the current collective; unless final_phase, first
    /// waits until no peer can still be reading this replica's buffers: members at or past
    /// `first` are inside this collective, their data phases never block and their waits see
    /// the abort, so each of them soon reaches left_epoch (or has departed).
    void leave_collective(int rank, std::uint64_t first, bool final_phase) {
        aborted_.store(true);
        member(rank).epoch.store(left_epoch);
        ctx_->notify();
        if (final_phase)
            return;
        const auto drained = [&] {
            for (int j = 0; j < size(); ++j) {
                const std::uint64_t at = member(j).epoch.load();
                if (at >= first && at != left_epoch && !member(j).departed.load())
                    return false;
            }
            return true;
        };
        while (!ctx_->wait_until(drained, clock::now() + std::chrono::hours(1))) {
        }
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

inline void group_state::validate(int rank, op_label label) const {
    const std::uint64_t seq = label.seq;
    const auto op = [&] { return operation(label); };
    const int me = replica_of(rank);
    const int n = size();
    for (int j = 0; j < n; ++j)
        if (!call(j, seq).problem.empty())
            fail(errc::invalid_argument, me, op(), "replica ", replica_of(j), " passed ",
                 call(j, seq).problem, " to ", name_of(call(j, seq).kind),
                 "; nothing was communicated and the group stays usable");
    const call_record& c0 = call(0, seq);
    const auto list = [&](auto&& describe) {
        std::string s;
        for (int j = 0; j < n; ++j) {
            if (j > 0)
                s += ", ";
            s += "replica " + std::to_string(replica_of(j)) + " " + describe(call(j, seq));
        }
        return s;
    };
    const auto all_same = [&](auto&& field) {
        for (int j = 1; j < n; ++j)
            if (!(field(call(j, seq)) == field(c0)))
                return false;
        return true;
    };
    // A swapped, skipped or extra call shows here as another collective or tag at this
    // sequence number; every replica's whole call is named so the two sides can be found.
    if (!all_same([](const call_record& c) {
            return std::tuple(c.kind, std::string_view(c.tag), c.tag_is_site);
        }))
        fail(errc::shape_mismatch, me, op(),
             "replicas called different collectives, tags or call sites (a call swapped, "
             "skipped or added on some replica): ",
             list([&](const call_record& c) { return "called " + describe_call(c, seq); }));
    const collective_kind k = c0.kind;
    if (k == collective_kind::barrier || k == collective_kind::split)
        return;

    const auto passed = [](const call_record& c) {
        return "passed " + count_of(c.count, c.type, c.elem_size);
    };
    if (!all_same([](const call_record& c) { return std::pair(c.type, c.elem_size); }))
        fail(errc::shape_mismatch, me, op(),
             "replicas disagree on the element type: ", list(passed));
    if (!all_same([](const call_record& c) { return c.count; }))
        fail(errc::count_mismatch, me, op(),
             "replicas disagree on the element count: ", list(passed));
    if (k == collective_kind::all_reduce || k == collective_kind::reduce ||
        k == collective_kind::reduce_scatter) {
        if (!all_same([](const call_record& c) { return c.op; }))
            fail(errc::shape_mismatch, me, op(),
                 "replicas disagree on the reduction: ", list([](const call_record& c) {
                     return "passed reduce_op::" + std::string(to_string(c.op));
                 }));
    }
    if (k == collective_kind::broadcast || k == collective_kind::reduce) {
        if (!all_same([](const call_record& c) { return c.root; }))
            fail(errc::shape_mismatch, me, op(),
                 "replicas disagree on the root: ", list([](const call_record& c) {
                     return "passed root " + std::to_string(c.root);
                 }));
        LOCKSTEP_REQUIRE(c0.root >= 0 && c0.root < n, errc::invalid_argument, me, op(), "root ",
                         c0.root, " is not a rank of this group of ", n);
    }
    if (k == collective_kind::all_to_all) {
        // Counts agree (checked above), so every replica throws the same error or none does.
        if (c0.count % static_cast<std::size_t>(n) != 0)
            fail(errc::count_mismatch, me, op(), "every replica passed ",
                 count_of(c0.count, c0.type, c0.elem_size),
                 ", which is not a whole number of blocks for ", n, " replicas");
        for (int j = 0; j < n; ++j) {
            const call_record& c = call(j, seq);
            const auto s0 = reinterpret_cast<std::uintptr_t>(c.send);
            const auto r0 = reinterpret_cast<std::uintptr_t>(c.recv);
            const std::size_t bytes = c.count * c.elem_size;
            const bool overlap =
                c.count != 0 && c.recv_count == c.count && s0 < r0 + bytes && r0 < s0 + bytes;
            if (overlap)
                fail(errc::invalid_argument, me, op(), "replica ", replica_of(j),
                     " passed overlapping send and receive spans (all_to_all has no in-place "
                     "form)");
        }
    }
    if (k == collective_kind::all_combine) {
        if (!all_same([](const call_record& c) { return c.array_count; }))
            fail(
                errc::shape_mismatch, me, op(),
                "replicas disagree on the number of input arrays: ", list([](const call_record& c) {
                    return "passed " + std::to_string(c.array_count);
                }));
        LOCKSTEP_REQUIRE(c0.array_count >= 1, errc::invalid_argument, me, op(),
                         "every replica passed 0 input arrays (all_combine needs at least 1)");
    }
    if (k == collective_kind::reduce_scatter)
        validate_scatter(rank, label);
    for (int j = 0; j < n; ++j) {
        const call_record& c = call(j, seq);
        std::size_t want = c.recv_count;
        if (k == collective_kind::reduce_scatter)
            want = c.counts[static_cast<std::size_t>(j)];
        if (k == collective_kind::all_reduce || k == collective_kind::all_to_all ||
            k == collective_kind::all_combine)
            want = c.count;
        if (k == collective_kind::reduce && j == c.root)
            want = c.count;
        if (k == collective_kind::all_gather &&
            mul_overflows(c.count, static_cast<std::size_t>(n), &want))
            fail(errc::count_mismatch, me, op(), "replica ", replica_of(j), " passed ",
                 count_of(c.count, c.type, c.elem_size), ": ", n,
                 " times that overflows std::size_t");
        if (c.recv_count != want)
            fail(errc::count_mismatch, me, op(), "replica ", replica_of(j),
                 " passed a receive span of ", count_of(c.recv_count, c.type, c.elem_size), " for ",
                 count_of(want, c.type, c.elem_size));
    }
}

inline void group_state::validate_scatter(int rank, op_label label) const {
    const std::uint64_t seq = label.seq;
    const int me = replica_of(rank);
    const int n = size();
    const call_record& c0 = call(0, seq);
    for (int j = 1; j < n; ++j)
        if (call(j, seq).counts != c0.counts) {
            std::string s;
            for (int q = 0; q < n; ++q)
                s += (q == 0 ? "" : ", ") + std::string("replica ") +
                     std::to_string(replica_of(q)) + " passed counts " +
                     describe_counts(call(q, seq).counts);
            fail(errc::count_mismatch, me, operation(label),
                 "replicas disagree on the per-rank counts: ", s);
        }
    // Counts agree from here, so every replica throws the same error or none does.
    const std::span<const std::size_t> counts = c0.counts;
    const auto layout = scatter_layout_of(counts, 0);
    if (counts.size() != static_cast<std::size_t>(n))
        fail(errc::count_mismatch, me, operation(label), "every replica passed ", counts.size(),
             " counts ", describe_counts(counts), " for a group of ", n,
             " replicas (one count per rank)");
    if (layout.overflow || layout.total != c0.count)
        fail(errc::count_mismatch, me, operation(label), "the counts ", describe_counts(counts),
             layout.overflow ? std::string(" overflow std::size_t")
                             : " sum to " + std::to_string(layout.total),
             " but every replica sends ", count_of(c0.count, c0.type, c0.elem_size));
    for (int j = 0; j < n; ++j) {
        const call_record& c = call(j, seq);
        const auto at = scatter_layout_of(c.counts, j);
        const auto s0 = reinterpret_cast<std::uintptr_t>(c.send);
        const auto r0 = reinterpret_cast<std::uintptr_t>(c.recv);
        const std::size_t send_bytes = c.count * c.elem_size;
        const std::size_t recv_bytes = at.mine * c.elem_size;
        const bool in_place = r0 == s0 + at.offset * c.elem_size;
        const bool overlap = send_bytes != 0 && recv_bytes != 0 && c.recv_count == at.mine &&
                             s0 < r0 + recv_bytes && r0 < s0 + send_bytes;
        if (overlap && !in_place)
            fail(errc::invalid_argument, me, operation(label), "replica ", replica_of(j),
                 " passed a receive span that overlaps its send span but is not its own slice "
                 "of it (elements ",
                 at.offset, " to ", at.offset + at.mine, ")");
    }
}

} // namespace lockstep::detail::shm

// lockstep/comm/detail/shm_shrink.hpp: shrink_group, the one decision by which the surviving
// replicas of a thread group leave a failed group for a new one without the lost replicas.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/shm_group.hpp"
#include "lockstep/comm/detail/shm_sync.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::detail::shm {

/// What a survivor gets from shrink_group: the new group and its rank in it.
struct shrink_outcome {
    std::shared_ptr<group_state> group;
    int rank = 0;
};

/// What shrink_slot::arrived holds for a member: nothing yet, arrived at the shrink, or its
/// thread ended with the errc::peer_failure or errc::timeout a failure of the group causes
/// (note_departure).
enum member_at : char { not_arrived = 0, arrived_here = 1, ended_peer_failure, ended_timeout };

/// Called on a replica's thread whose function threw `e` (thread_group::run), before its handle
/// on g departs. When e is a lockstep::error with errc::peer_failure or errc::timeout (what a
/// failure of the group causes in a replica that is not in a shrink: in the trainer's
/// constructor, finish(), save_checkpoint, or code of its own), marks the member so that a shrink
/// of g not yet decided is refused (decide_shrink): the replica is healthy, not a loss of its own.
/// Any other exception, or a shrink already decided: no effect.
inline void note_departure(group_state& g, int rank, const std::exception_ptr& e) {
    member_at why = not_arrived;
    try {
        std::rethrow_exception(e);
    } catch (const error& x) {
        if (x.code() == errc::peer_failure)
            why = ended_peer_failure;
        else if (x.code() == errc::timeout)
            why = ended_timeout;
    } catch (...) {
    }
    if (why == not_arrived)
        return;
    auto& s = g.shrink_state();
    std::lock_guard lock(s.mutex);
    if (s.decided)
        return;
    if (s.arrived.empty())
        s.arrived.assign(static_cast<std::size_t>(g.size()), not_arrived);
    s.arrived[static_cast<std::size_t>(rank)] = why;
    s.changed.notify_all();
}

/// Why the shrink of g is refused (empty: it is not): a member's thread ended with an error the
/// group's failure caused (note_departure). requires: the slot's mutex held.
inline std::string shrink_refusal(group_state& g, const group_state::shrink_slot& s) {
    std::string who;
    for (int j = 0; j < static_cast<int>(s.arrived.size()); ++j) {
        const char at = s.arrived[static_cast<std::size_t>(j)];
        if (at == ended_peer_failure || at == ended_timeout)
            who += (who.empty() ? "replica " : ", replica ") + std::to_string(g.replica_of(j)) +
                   (at == ended_timeout ? " (errc::timeout)" : " (errc::peer_failure)");
    }
    if (who.empty())
        return who;
    const std::string failure = g.context().failed() ? g.context().failure_description()
                                                     : std::string("no failure was recorded");
    return "the group does not shrink: " + failure + "; " + who +
           " ended with an error the group's failure causes, outside a shrink (in a trainer's "
           "constructor, finish(), save_checkpoint, or code of its own): a healthy replica, not a "
           "loss of its own, so the run stops as without shrink (resume from the last checkpoint)";
}

/// Decides the shrink of g (called with the slot's mutex held). Refused (shrink_refusal not
/// empty): no new group, every member that arrives throws the refusal. Otherwise the members
/// that arrived survive, in their old rank order; the others are left out. Starts the new
/// group's context (generation + 1), makes g dead, so an excluded replica that is still alive
/// gets errc::peer_failure from every later call on it, and links the new context from g's,
/// with the excluded replicas and why (thread_group::lost).
inline void decide_shrink(group_state& g, group_state::shrink_slot& s) {
    if (!shrink_refusal(g, s).empty()) {
        s.decided = true; // s.next stays null
        s.changed.notify_all();
        return;
    }
    run_context& old = g.context();
    std::vector<int> replicas;
    std::vector<run_context::excluded_replica> left;
    const int culprit = old.failed_replica();
    for (int j = 0; j < g.size(); ++j) {
        if (s.arrived[static_cast<std::size_t>(j)] == arrived_here) {
            s.survivors.push_back(j);
            replicas.push_back(g.replica_of(j));
            continue;
        }
        std::string why;
        if (g.replica_of(j) == culprit && old.failed())
            why = old.failure_description();
        else if (g.member(j).departed.load())
            why = "replica " + std::to_string(g.replica_of(j)) +
                  " left the group (its thread ended) without joining the shrink";
        else
            why = "replica " + std::to_string(g.replica_of(j)) +
                  " did not join the shrink within " + std::to_string(old.timeout().count()) +
                  " ms (stalled; its thread is left out)";
        left.push_back({g.replica_of(j), std::move(why)});
    }
    auto ctx = std::make_shared<run_context>(old.timeout(), static_cast<int>(replicas.size()),
                                             old.check_call_sites());
    ctx->set_generation(old.generation() + 1);
    ctx->set_hook(old.hook());
    ctx->share_thread_ends(old);
    s.next = std::make_shared<group_state>(ctx, std::move(replicas), std::string(),
                                           g.replicas_in_process());
    s.next->mark_world();
    std::string kept;
    for (int r : s.survivors)
        kept += (kept.empty() ? "" : ", ") + std::to_string(g.replica_of(r));
    std::string text = "the group was shrunk: replicas " + kept + " continue as generation " +
                       std::to_string(ctx->generation()) + " without this one";
    const error gone(errc::peer_failure, -1, "thread_communicator.shrink", text);
    old.record_failure(-1, std::make_exception_ptr(gone), gone.what());
    old.set_superseded(std::move(text));
    old.set_successor(ctx, std::move(left));
    g.abort_group();
    s.decided = true;
    s.changed.notify_all();
}

/// The shrink of the whole group g by its member `rank` (see thread_communicator::shrink): waits
/// until every member has arrived here or departed, or one's thread ended with an error the
/// group's failure caused (note_departure), or the group's timeout has passed since this member
/// arrived; the first to see that decides for all (decide_shrink). Throws errc::peer_failure
/// when the shrink is refused (shrink_refusal: on every member that arrives) or the decision
/// left this member out (it arrived too late), and errc::unsupported for a split.
inline shrink_outcome shrink_group(group_state& g, int rank) {
    const int me = g.replica_of(rank);
    LOCKSTEP_REQUIRE(g.world(), errc::unsupported, me, "thread_communicator.shrink",
                     "only a thread_group's own communicator (or one a shrink returned) can "
                     "shrink, not a split (",
                     g.label(), "): shrink the whole group, then split it again");
    auto& s = g.shrink_state();
    std::unique_lock lock(s.mutex);
    if (s.arrived.empty())
        s.arrived.assign(static_cast<std::size_t>(g.size()), not_arrived);
    if (!s.decided) {
        s.arrived[static_cast<std::size_t>(rank)] = arrived_here;
        s.changed.notify_all();
        // Every member arrived or departed; or one ended by the failure: refused, decide now.
        const auto known = [&] {
            bool all = true;
            for (int j = 0; j < g.size(); ++j) {
                const char at = s.arrived[static_cast<std::size_t>(j)];
                if (at == ended_peer_failure || at == ended_timeout)
                    return true;
                if (at == not_arrived && !g.member(j).departed.load())
                    all = false;
            }
            return all;
        };
        // Departures do not signal `changed`: poll them.
        const auto deadline = g.context().deadline();
        while (!s.decided && !known() && clock::now() < deadline)
            s.changed.wait_for(lock, std::chrono::milliseconds(1));
        if (!s.decided)
            decide_shrink(g, s);
    }
    if (!s.next)
        throw error(errc::peer_failure, me, "thread_communicator.shrink", shrink_refusal(g, s));
    const auto at = std::find(s.survivors.begin(), s.survivors.end(), rank);
    if (at == s.survivors.end())
        fail(errc::peer_failure, me, "thread_communicator.shrink", "replica ", me,
             " arrived after the survivors had shrunk the group without it (generation ",
             g.context().generation() + 1,
             "); it cannot rejoin: end its thread, the others train on");
    return {s.next, static_cast<int>(at - s.survivors.begin())};
}

} // namespace lockstep::detail::shm

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

/// Decides the shrink of g (called with the slot's mutex held): the members that arrived
/// survive, in their old rank order; the others are left out. Starts the new group's context
/// (generation + 1), makes g dead, so an excluded replica that is still alive gets
/// errc::peer_failure from every later call on it, and links the new context from g's, with
/// the excluded replicas and why (thread_group::lost).
inline void decide_shrink(group_state& g, group_state::shrink_slot& s) {
    run_context& old = g.context();
    std::vector<int> replicas;
    std::vector<run_context::excluded_replica> left;
    const int culprit = old.failed_replica();
    for (int j = 0; j < g.size(); ++j) {
        if (s.arrived[static_cast<std::size_t>(j)] != 0) {
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
    old.set_successor(std::move(ctx), std::move(left));
    g.abort_group();
    s.decided = true;
    s.changed.notify_all();
}

/// The shrink of the whole group g by its member `rank` (see thread_communicator::shrink): waits
/// until every member has arrived here or departed, or the group's timeout has passed since this
/// member arrived; the first to see that decides for all (decide_shrink). Throws
/// errc::peer_failure when the decision left this member out (it arrived too late), and
/// errc::unsupported for a split.
inline shrink_outcome shrink_group(group_state& g, int rank) {
    const int me = g.replica_of(rank);
    LOCKSTEP_REQUIRE(g.world(), errc::unsupported, me, "thread_communicator.shrink",
                     "only a thread_group's own communicator (or one a shrink returned) can "
                     "shrink, not a split (",
                     g.label(), "): shrink the whole group, then split it again");
    auto& s = g.shrink_state();
    std::unique_lock lock(s.mutex);
    if (s.arrived.empty())
        s.arrived.assign(static_cast<std::size_t>(g.size()), 0);
    if (!s.decided) {
        s.arrived[static_cast<std::size_t>(rank)] = 1;
        s.changed.notify_all();
        const auto known = [&] {
            for (int j = 0; j < g.size(); ++j)
                if (s.arrived[static_cast<std::size_t>(j)] == 0 && !g.member(j).departed.load())
                    return false;
            return true;
        };
        // Departures do not signal `changed`: poll them.
        const auto deadline = g.context().deadline();
        while (!s.decided && !known() && clock::now() < deadline)
            s.changed.wait_for(lock, std::chrono::milliseconds(1));
        if (!s.decided)
            decide_shrink(g, s);
    }
    const auto at = std::find(s.survivors.begin(), s.survivors.end(), rank);
    if (at == s.survivors.end())
        fail(errc::peer_failure, me, "thread_communicator.shrink", "replica ", me,
             " arrived after the survivors had shrunk the group without it (generation ",
             g.context().generation() + 1,
             "); it cannot rejoin: end its thread, the others train on");
    return {s.next, static_cast<int>(at - s.survivors.begin())};
}

} // namespace lockstep::detail::shm

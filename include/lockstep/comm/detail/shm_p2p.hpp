// lockstep/comm/detail/shm_p2p.hpp: buffered point-to-point messages between the replica
// threads of a group (mailboxes matched by source and tag). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/shm_group.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail::shm {

/// Appends a copy of data, from `rank` with `tag`, to the mailbox of `dest` and wakes the
/// sleepers. requires: 0 <= dest < g.size().
template <class T>
void post(group_state& g, int rank, int dest, int tag, std::span<const T> data) {
    message m{rank,      tag,         element_type_of<T>(),
              sizeof(T), data.size(), std::vector<unsigned char>(data.size_bytes())};
    if (!data.empty())
        std::memcpy(m.bytes.data(), data.data(), data.size_bytes());
    auto& box = g.mailbox_of(dest);
    {
        std::lock_guard lock(box.mutex);
        box.queue.push_back(std::move(m));
    }
    g.context().notify();
}

/// Waits for the oldest message to `rank` with `tag` from `source` (-1: any) and copies it into
/// data; returns its source. Throws errc::peer_failure if the run fails or every possible
/// sender has left, errc::timeout (failing the run) after the run's timeout, and
/// errc::shape_mismatch / errc::count_mismatch if the message does not fit data: then the
/// message is consumed (as mpi_communicator's recv consumes it) and the error says it was
/// discarded.
template <class T>
int receive(group_state& g, int rank, std::span<T> data, int tag, int source,
            const std::string& op) {
    static_assert(!std::is_const_v<T> && std::is_trivially_copyable_v<T>,
                  "recv writes trivially copyable elements into a mutable span.");
    auto& ctx = g.context();
    auto& box = g.mailbox_of(rank);
    const auto matches = [&](const message& m) {
        return m.tag == tag && (source < 0 || m.source == source);
    };
    const auto available = [&] {
        std::lock_guard lock(box.mutex);
        return std::any_of(box.queue.begin(), box.queue.end(), matches);
    };
    const auto abandoned = [&] { // nobody left who could still send the message
        for (int j = 0; j < g.size(); ++j)
            if ((source < 0 ? j != rank : j == source) && !g.member(j).departed.load())
                return false;
        return true;
    };
    ctx.wait_until([&] { return ctx.failed() || available() || abandoned(); }, ctx.deadline());
    g.throw_if_failed(rank, op);
    message m;
    bool found = false;
    {
        std::lock_guard lock(box.mutex);
        const auto it = std::find_if(box.queue.begin(), box.queue.end(), matches);
        if (it != box.queue.end()) {
            m = std::move(*it);
            box.queue.erase(it);
            found = true;
        }
    }
    if (!found) { // outside the mailbox lock: recording a failure wakes the sleepers
        const bool gone = abandoned();
        error e(gone ? errc::peer_failure : errc::timeout, g.replica_of(rank), op,
                gone ? std::string("the sender(s) left the group without sending")
                     : "timed out after " + std::to_string(ctx.timeout().count()) +
                           " ms without a message");
        ctx.record_failure(g.replica_of(rank), std::make_exception_ptr(e), e.what());
        throw e;
    }
    const auto want = element_type_of<T>();
    LOCKSTEP_REQUIRE(m.type == want && m.elem_size == sizeof(T), errc::shape_mismatch,
                     g.replica_of(rank), op, "rank ", m.source, " sent ",
                     count_of(m.count, m.type, m.elem_size), ", expected ",
                     count_of(data.size(), want, sizeof(T)), "; the message was discarded");
    LOCKSTEP_REQUIRE(m.count == data.size(), errc::count_mismatch, g.replica_of(rank), op, "rank ",
                     m.source, " sent ", count_of(m.count, m.type, m.elem_size), ", expected ",
                     count_of(data.size(), want, sizeof(T)), "; the message was discarded");
    if (!m.bytes.empty())
        std::memcpy(data.data(), m.bytes.data(), m.bytes.size());
    return m.source;
}

} // namespace lockstep::detail::shm

// lockstep/comm/detail/hierarchical_messages.hpp: hierarchical_messages, the point-to-point
// messages of a hierarchical_communicator through its Routes (and no_routes).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/hierarchical_parts.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

/// The Routes of a hierarchical_communicator without point-to-point messages.
struct no_routes {};

} // namespace lockstep

namespace lockstep::detail {

/// The point-to-point messages of hierarchical_communicator (whose comment states what they
/// guarantee), over its parts: send, recv and recv_any go through the Routes, with this group's
/// ranks translated to the routes' (the whole, unsplit group's) and back. Without routes
/// (Routes = no_routes) none of them exists.
template <class Intra, class Inter, class Routes>
class hierarchical_messages : public hierarchical_parts<Intra, Inter, Routes> {
    using base = hierarchical_parts<Intra, Inter, Routes>;

protected:
    static constexpr bool has_routes = !std::is_same_v<Routes, no_routes>;
    // Routes whose receives take on_timeout (named_timeout_communicator).
    static constexpr bool routes_name_timeouts =
        has_routes && requires(Routes & r, std::span<int> i) {
        r.recv(i, 0, 0, detail::same_error{});
        r.recv_any(i, 0, detail::same_error{});
    };

public:
    using base::rank, base::size;

    /// Sends data to replica dest with tag through the routes (returns once data may be
    /// reused). Matched by (source, tag), in order. Only with routes.
    /// requires: 0 <= dest < size(); the tag and element type the routes accept (MPI: 0 <= tag
    /// <= MPI_TAG_UB).
    template <class T>
    void send(std::span<T> data, int dest, int tag) requires has_routes {
        require_peer(dest, "hierarchical_communicator.send");
        routes_.send(std::span<const std::remove_const_t<T>>(data), to_routes(dest), tag);
    }

    /// Receives the next message from replica source with tag into data. Only with routes.
    /// requires: 0 <= source < size(). ensures: the message held exactly data.size()
    /// elements, else it is consumed and errc::count_mismatch is thrown.
    template <class T>
    void recv(std::span<T> data, int source, int tag) requires has_routes {
        require_peer(source, "hierarchical_communicator.recv");
        routes_.recv(data, to_routes(source), tag);
    }
    /// As recv(data, source, tag), whose timeout fails with on_timeout(e) in place of the
    /// routes' error e (named_timeout_communicator). Only with routes that take on_timeout.
    template <class T, class OnTimeout>
    void recv(std::span<T> data, int source, int tag,
              OnTimeout&& on_timeout) requires routes_name_timeouts {
        require_peer(source, "hierarchical_communicator.recv");
        routes_.recv(data, to_routes(source), tag, on_timeout);
    }

    /// As recv, from any replica; returns the sender's rank. Waits at most the routes' timeout
    /// (then errc::timeout naming the tag). Only with routes.
    template <class T>
    int recv_any(std::span<T> data, int tag) requires has_routes {
        return from_member(routes_.recv_any(data, tag), tag);
    }
    /// As recv_any(data, tag), whose timeout fails with on_timeout(e) in place of the routes'
    /// error e (named_timeout_communicator). Only with routes that take on_timeout.
    template <class T, class OnTimeout>
    int recv_any(std::span<T> data, int tag, OnTimeout&& on_timeout) requires routes_name_timeouts {
        return from_member(routes_.recv_any(data, tag, on_timeout), tag);
    }

    /// This replica's routes (for messages on the whole, unsplit group). Only with routes.
    Routes& routes() noexcept requires has_routes { return routes_; }

protected:
    using base::base;
    using base::members_, base::routes_;

    // The rank in this group of the routes' replica `from`, a sender of recv_any.
    int from_member(int from, int tag) const {
        if (members_.empty())
            return from;
        const auto it = std::find(members_.begin(), members_.end(), from);
        LOCKSTEP_REQUIRE(it != members_.end(), errc::invalid_argument, rank(),
                         "hierarchical_communicator.recv_any", "a message with tag ", tag,
                         " came from replica ", from,
                         " of the whole group, which is not a member of this split group");
        return static_cast<int>(it - members_.begin());
    }
    void require_peer(int peer, const char* what) const {
        LOCKSTEP_REQUIRE(peer >= 0 && peer < size(), errc::invalid_argument, rank(), what,
                         "replica ", peer, " is not in [0, ", size(), ")");
    }
    int to_routes(int r) const {
        return members_.empty() ? r : members_[static_cast<std::size_t>(r)];
    }
};

} // namespace lockstep::detail

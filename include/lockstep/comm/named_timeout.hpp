// lockstep/comm/named_timeout.hpp: receives whose timeout fails with the caller's account of the
// wait (named_timeout_communicator, recv_named, recv_any_named). SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <concepts>
#include <span>
#include <type_traits>
#include <utility>

namespace lockstep {

/// An on_timeout that lets its wait last `periods` of the communicator's timeouts before it
/// fails with f(e) (see patient()).
template <class F>
struct patient_timeout {
    int periods;
    F f;
    error operator()(const error& e) const { return f(e); }
};

/// on_timeout for a wait that should outlast a peer's wait of one timeout: where the peer is
/// the one who can name the cause (the parameter server, waiting for a straggler, against a
/// worker waiting for the server), a wait of `periods` timeouts lets the peer's error end the
/// job first under a policy that ends it inside the wait (mpi_failure_action::abort). The
/// waits of mpi_communicator and hierarchical_group take it; a communicator that throws its
/// timeouts (thread_communicator, whose peers' failures end its waits) waits one timeout.
/// requires: periods >= 1 (else one).
template <class F>
patient_timeout<std::remove_cvref_t<F>> patient(int periods, F&& f) {
    return {periods, std::forward<F>(f)};
}

namespace detail {
/// How many timeouts a wait with on_timeout lasts: its periods (patient()), else 1.
template <class OnTimeout>
int timeout_periods(const OnTimeout& on_timeout) noexcept {
    if constexpr (requires { on_timeout.periods; })
        return std::max(1, on_timeout.periods);
    else
        return 1;
}

/// The on_timeout of a wait that fails with the communicator's own error.
struct same_error {
    error operator()(const error& e) const { return e; }
};

/// on_timeout(e), or e itself when on_timeout throws: a timed-out wait fails with a timeout,
/// not with whatever went wrong while describing it.
template <class OnTimeout>
error named_timeout_error(OnTimeout&& on_timeout, const error& e) {
    try {
        return on_timeout(e);
    } catch (...) {
        return e;
    }
}
} // namespace detail

/// A point_to_point_communicator whose receives take the error their timeout fails with:
/// - recv(data, source, tag, on_timeout), recv_any(data, tag, on_timeout) -> int: as recv and
///   recv_any without on_timeout, except that where the wait times out the communicator fails
///   with on_timeout(e) (a lockstep::error) in place of its own errc::timeout error e, under
///   its own failure policy. A caller that knows what it waited for (the parameter server
///   names the workers it waited for) is then heard even where the policy ends the job inside
///   the wait (mpi_failure_action::abort prints the error and calls MPI_Abort), which a rethrow
///   would come too late for.
/// mpi_communicator and hierarchical_group's communicators are; a thread_communicator throws its
/// timeouts, so recv_named / recv_any_named name them by rethrowing. Where on_timeout is a
/// patient_timeout (patient()), the wait lasts its periods of timeouts.
template <class C>
concept named_timeout_communicator = point_to_point_communicator<C> &&
    requires(C& c, std::span<int> i) {
    c.recv(i, 0, 0, detail::same_error{});
    { c.recv_any(i, 0, detail::same_error{}) } -> std::convertible_to<int>;
};

namespace detail {
/// f(), whose errc::timeout error e is rethrown as on_timeout(e).
template <class F, class OnTimeout>
decltype(auto) rethrow_named(F&& f, OnTimeout& on_timeout) {
    try {
        return f();
    } catch (const error& e) {
        if (e.code() != errc::timeout)
            throw;
        throw named_timeout_error(on_timeout, e);
    }
}
} // namespace detail

/// comm.recv(data, source, tag), whose timeout fails with on_timeout(e) in place of the
/// communicator's errc::timeout error e on every point_to_point_communicator: through its own
/// recv(data, source, tag, on_timeout) where it is a named_timeout_communicator, else by
/// catching e and throwing on_timeout(e). on_timeout(const error&) returns a lockstep::error;
/// where it throws, e is what fails.
template <point_to_point_communicator Comm, class T, class OnTimeout>
void recv_named(Comm& comm, std::span<T> data, int source, int tag, OnTimeout&& on_timeout) {
    if constexpr (named_timeout_communicator<Comm>)
        comm.recv(data, source, tag, on_timeout);
    else
        detail::rethrow_named([&] { comm.recv(data, source, tag); }, on_timeout);
}

/// comm.recv_any(data, tag) with the timeout of recv_named; returns the sender's rank.
template <point_to_point_communicator Comm, class T, class OnTimeout>
int recv_any_named(Comm& comm, std::span<T> data, int tag, OnTimeout&& on_timeout) {
    if constexpr (named_timeout_communicator<Comm>)
        return comm.recv_any(data, tag, on_timeout);
    else
        return detail::rethrow_named([&] { return comm.recv_any(data, tag); }, on_timeout);
}

} // namespace lockstep

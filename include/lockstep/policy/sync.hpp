// lockstep/policy/sync.hpp: SyncPolicy tags (how replicas combine their updates) and their concept.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

namespace lockstep {

/// The family a SyncPolicy belongs to (what data_parallel dispatches on).
enum class sync_kind {
    synchronous,  ///< one combined update per global batch; weights identical on every replica
    asynchronous, ///< parameter server: gradients applied as they arrive (bounded or not)
    local_sgd     ///< independent steps, weights averaged every `period` steps
};

namespace sync {

/// Synchronous data parallelism: every replica computes the gradient of its shard, the
/// gradients are summed, and every replica applies the same update, so weights stay bitwise
/// identical on every replica after every step.
struct synchronous {
    static constexpr sync_kind kind = sync_kind::synchronous;
    /// Largest version difference between a gradient and the weights it is applied to.
    static constexpr std::size_t max_staleness = 0;
    /// The policy's name: what checkpoints record and the agreement check compares.
    static std::string name() { return "sync::synchronous"; }
};

/// Asynchronous parameter-server training: a worker pulls the newest parameters, computes a
/// gradient, pushes it; the server applies it at once without waiting for the other workers.
/// Staleness is measured but not bounded.
struct asynchronous {
    static constexpr sync_kind kind = sync_kind::asynchronous;
    static constexpr std::size_t max_staleness = std::numeric_limits<std::size_t>::max();
    static std::string name() { return "sync::asynchronous"; }
};

/// As asynchronous, but no gradient older than S server versions is ever applied: a worker that
/// runs ahead waits. bounded_staleness<0> is synchronous in effect.
template <std::size_t S>
struct bounded_staleness {
    static constexpr sync_kind kind = sync_kind::asynchronous;
    static constexpr std::size_t max_staleness = S;
    static std::string name() { return "sync::bounded_staleness<" + std::to_string(S) + ">"; }
};

/// Local SGD (periodic model averaging): every replica steps on its own shard (its gradient is
/// the mean over its own samples), and the replicas average their weights every K steps and
/// when training finishes.
template <std::size_t K>
struct local_sgd {
    static_assert(K >= 1, "sync::local_sgd<K> averages weights every K steps: K must be >= 1.");
    static constexpr sync_kind kind = sync_kind::local_sgd;
    static constexpr std::size_t max_staleness = 0;
    /// Steps between two weight averages.
    static constexpr std::size_t period = K;
    static std::string name() { return "sync::local_sgd<" + std::to_string(K) + ">"; }
};

} // namespace sync

/// A SyncPolicy is an empty tag with a `kind`, a `max_staleness` and a `name()` (what
/// checkpoints record and the construction-time agreement check compares).
template <class P>
concept sync_policy = std::is_empty_v<P> && requires {
    { P::kind } -> std::convertible_to<sync_kind>;
    { P::max_staleness } -> std::convertible_to<std::size_t>;
    { P::name() } -> std::convertible_to<std::string>;
};

/// True for the parameter-server policies (sync::asynchronous, sync::bounded_staleness<S>).
template <sync_policy P>
inline constexpr bool is_asynchronous_v = P::kind == sync_kind::asynchronous;

/// True for sync::local_sgd<K>.
template <sync_policy P>
inline constexpr bool is_local_sgd_v = P::kind == sync_kind::local_sgd;

} // namespace lockstep

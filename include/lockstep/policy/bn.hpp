// lockstep/policy/bn.hpp: BNStatPolicy tags (bn::local, bn::global, bn::group<G>,
// bn::running_only, bn::tower<K>), the bn_stat_policy concept and traits.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <type_traits>

namespace lockstep::bn {

/// Each replica normalizes with its own batch statistics and keeps its own running statistics
/// (plain BN under data parallelism). No communication.
struct local {};

/// Every replica normalizes with the exact mean/variance of the global batch (synchronized BN):
/// one all_gather of per-replica (count, mean, M2) in forward, merged with Chan's formula in
/// rank order; one all_reduce of (sum dy, sum dy * xhat) in backward.
struct global {};

/// Global statistics within consecutive groups of G replicas: replicas [0, G), [G, 2G), ...
/// (the last group is smaller when G does not divide the replica count).
template <int G>
struct group {
    static_assert(G >= 1, "bn::group<G> needs G >= 1 replicas per group.");
    /// Replicas per group.
    static constexpr int size = G;
};

/// Normalize with local statistics; merge the per-replica moments exactly (as bn::global) for
/// the running statistics only, so they stay identical on every replica.
struct running_only {};

/// Normalize with local statistics; replica K's batch statistics drive every replica's
/// running statistics.
template <int K>
struct tower {
    static_assert(K >= 0, "bn::tower<K> needs a replica index K >= 0.");
    /// The replica whose statistics feed the running averages.
    static constexpr int replica = K;
};

/// Compile-time facts about a BNStatPolicy; specialised for every tag. Besides the flags and
/// collective counts: `group_size`, the replicas that share statistics (0: all of them), and
/// `running_replica`, the one replica whose statistics drive the running averages (-1: the
/// merge of the replicas that share statistics).
template <class P>
struct traits;

template <>
struct traits<local> {
    static constexpr bool normalizes_across_replicas = false;
    static constexpr bool shares_running_statistics = false;
    static constexpr int forward_collectives = 0;
    static constexpr int backward_collectives = 0;
    static constexpr int group_size = 0;
    static constexpr int running_replica = -1;
};
template <>
struct traits<global> {
    static constexpr bool normalizes_across_replicas = true;
    static constexpr bool shares_running_statistics = true;
    static constexpr int forward_collectives = 1;
    static constexpr int backward_collectives = 1;
    static constexpr int group_size = 0;
    static constexpr int running_replica = -1;
};
template <int G>
struct traits<group<G>> {
    static constexpr bool normalizes_across_replicas = true;
    static constexpr bool shares_running_statistics = false; // shared within a group only
    static constexpr int forward_collectives = 1;            // plus one split on first use
    static constexpr int backward_collectives = 1;
    static constexpr int group_size = G;
    static constexpr int running_replica = -1;
};
template <>
struct traits<running_only> {
    static constexpr bool normalizes_across_replicas = false;
    static constexpr bool shares_running_statistics = true;
    static constexpr int forward_collectives = 1;
    static constexpr int backward_collectives = 0;
    static constexpr int group_size = 0;
    static constexpr int running_replica = -1;
};
template <int K>
struct traits<tower<K>> {
    static constexpr bool normalizes_across_replicas = false;
    static constexpr bool shares_running_statistics = true;
    static constexpr int forward_collectives = 1;
    static constexpr int backward_collectives = 0;
    static constexpr int group_size = 0;
    static constexpr int running_replica = K;
};

/// True when a replica's gradients depend on the other replicas' data in the same step
/// (bn::global, bn::group): such a policy needs synchronous training, where every replica runs
/// the same step at the same time (not asynchronous, bounded staleness or local SGD).
template <class P>
inline constexpr bool needs_synchronous = traits<P>::normalizes_across_replicas;

/// True when the policy calls a collective in every training forward pass, so every replica
/// must run forward_train the same number of times in the same order.
template <class P>
inline constexpr bool communicates = traits<P>::forward_collectives > 0;

} // namespace lockstep::bn

namespace lockstep {

/// A batch-norm statistics policy: one of the bn:: tags.
template <class P>
concept bn_stat_policy = requires {
    { bn::traits<P>::normalizes_across_replicas } -> std::convertible_to<bool>;
    { bn::traits<P>::forward_collectives } -> std::convertible_to<int>;
    { bn::traits<P>::backward_collectives } -> std::convertible_to<int>;
};

} // namespace lockstep

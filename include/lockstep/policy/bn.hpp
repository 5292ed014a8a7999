// lockstep/policy/bn.hpp: BNStatPolicy tags (bn::local, bn::global, bn::group<G>,
// bn::running_only, bn::tower<K>, bn::ghost<C>), the bn_stat_policy concept and traits.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstddef>
#include <string>
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

/// Compile-time facts about a BNStatPolicy; specialised for every tag. `name()` is the policy's
/// name, what checkpoints record and the construction-time agreement check compares. Besides the
/// flags and collective counts: `group_size`, the replicas that share statistics (0: all of them),
/// and `running_replica`, the one replica whose statistics drive the running averages (-1: the
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
    static std::string name() { return "bn::local"; }
};
template <>
struct traits<global> {
    static constexpr bool normalizes_across_replicas = true;
    static constexpr bool shares_running_statistics = true;
    static constexpr int forward_collectives = 1;
    static constexpr int backward_collectives = 1;
    static constexpr int group_size = 0;
    static constexpr int running_replica = -1;
    static std::string name() { return "bn::global"; }
};
template <int G>
struct traits<group<G>> {
    static constexpr bool normalizes_across_replicas = true;
    static constexpr bool shares_running_statistics = false; // shared within a group only
    static constexpr int forward_collectives = 1;            // plus one split on first use
    static constexpr int backward_collectives = 1;
    static constexpr int group_size = G;
    static constexpr int running_replica = -1;
    static std::string name() { return "bn::group<" + std::to_string(G) + ">"; }
};
template <>
struct traits<running_only> {
    static constexpr bool normalizes_across_replicas = false;
    static constexpr bool shares_running_statistics = true;
    static constexpr int forward_collectives = 1;
    static constexpr int backward_collectives = 0;
    static constexpr int group_size = 0;
    static constexpr int running_replica = -1;
    static std::string name() { return "bn::running_only"; }
};
template <int K>
struct traits<tower<K>> {
    static constexpr bool normalizes_across_replicas = false;
    static constexpr bool shares_running_statistics = true;
    static constexpr int forward_collectives = 1;
    static constexpr int backward_collectives = 0;
    static constexpr int group_size = 0;
    static constexpr int running_replica = K;
    static std::string name() { return "bn::tower<" + std::to_string(K) + ">"; }
};

// --- bn::ghost ------------------------------------------------------------------------------

/// Ghost batch norm (Hoffer et al. 2017) for reduce::reproducible<ChunkSamples>: each call of
/// the layer (one chunk of ChunkSamples samples) is normalized with its own statistics, with no
/// communication in forward or backward; the running statistics are updated from every chunk of
/// the step in global chunk order at the end of the step (one all_gather), so they are the same
/// on every replica and for every replica count. Outside a trainer's step it behaves as
/// bn::local. requires: ChunkSamples >= 1; the trainer uses reduce::reproducible<ChunkSamples>.
template <std::size_t ChunkSamples>
struct ghost {
    static_assert(ChunkSamples >= 1, "bn::ghost<ChunkSamples> needs chunks of at least 1 sample.");
    /// Samples per normalized chunk.
    static constexpr std::size_t chunk_samples = ChunkSamples;
};

template <std::size_t C>
struct traits<ghost<C>> {
    static constexpr bool normalizes_across_replicas = false;
    static constexpr bool shares_running_statistics = true; // gathered at the end of the step
    static constexpr int forward_collectives = 0;
    static constexpr int backward_collectives = 0;
    static constexpr int group_size = 0;
    static constexpr int running_replica = -1;
    static std::string name() { return "bn::ghost<" + std::to_string(C) + ">"; }
};

/// The chunk size of a bn::ghost<C> policy (C), 0 for every other policy.
template <class P>
inline constexpr std::size_t ghost_chunk = 0;
template <std::size_t C>
inline constexpr std::size_t ghost_chunk<ghost<C>> = C;

/// True for bn::ghost<C>.
template <class P>
inline constexpr bool is_ghost = ghost_chunk<P> != 0;

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
    { bn::traits<P>::name() } -> std::convertible_to<std::string>;
    { bn::traits<P>::normalizes_across_replicas } -> std::convertible_to<bool>;
    { bn::traits<P>::forward_collectives } -> std::convertible_to<int>;
    { bn::traits<P>::backward_collectives } -> std::convertible_to<int>;
};

} // namespace lockstep

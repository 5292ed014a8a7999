// lockstep/policy/compat.hpp: the compile-time compatibility rules between SyncPolicy,
// ReducePolicy, the communicator and the network's BN policies. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace lockstep {

namespace detail {
template <class Network>
concept has_bn_policies_member = requires {
    typename Network::bn_policies;
};
} // namespace detail

/// The BNStatPolicies a network's batch-norm layers use, as a std::tuple of bn:: tags, so the
/// trainer can reject combinations that cannot work. Default: `typename Network::bn_policies`
/// when the network declares that member alias, else std::tuple<> (no batch norm). Specialise
/// it for a network type you cannot change. A layer whose policy is not listed (by name, so
/// bn::group<2> for bn::global or bn::tower<1> for bn::tower<0> count as missing) is refused at
/// its first training call with a trainer's context (nn::policy_declaration::check). Example:
///   struct my_net { using bn_policies = std::tuple<bn::global>; ... };
template <class Network>
struct network_bn_policies {
    using type = std::tuple<>;
};
template <detail::has_bn_policies_member Network>
struct network_bn_policies<Network> {
    using type = typename Network::bn_policies;
};
template <class Network>
using network_bn_policies_t = typename network_bn_policies<Network>::type;

/// BN policy names joined, "bn::global, bn::local" ("none" for no policy).
inline std::string joined_bn_policy_names(const std::vector<std::string>& names) {
    std::string s;
    for (const std::string& n : names)
        s += (s.empty() ? "" : ", ") + n;
    return s.empty() ? "none" : s;
}

/// The names of a tuple of BN policies: list() one by one, what a layer's policy is checked
/// against; get() joined, what checkpoints record and the construction-time agreement check
/// compares.
template <class Tuple>
struct bn_policy_names;
template <class... P>
struct bn_policy_names<std::tuple<P...>> {
    static std::vector<std::string> list() { return {bn::traits<P>::name()...}; }
    static std::string get() { return joined_bn_policy_names(list()); }
};

// The sentences of the rules that involve a BN policy. Macros, because static_assert takes only
// a string literal: the compile-time checks below and the run-time check of a layer's first call
// in a step (bn_rule_broken, for a policy missing from the network's bn_policies) print the
// same sentence.
#define LOCKSTEP_COMPAT_BN_NEEDS_SYNCHRONOUS                                                       \
    "bn::global and bn::group compute batch statistics across replicas inside forward and "        \
    "backward, so every replica must run the same step at the same time: they need "               \
    "sync::synchronous. With sync::asynchronous, sync::bounded_staleness or sync::local_sgd use "  \
    "bn::local (or bn::running_only / bn::tower with local SGD)."
#define LOCKSTEP_COMPAT_BN_ASYNC_COLLECTIVE                                                        \
    "Asynchronous workers run forward at their own pace, so a BN policy that calls a collective "  \
    "in forward (bn::running_only, bn::tower) would pair different steps of different workers: "   \
    "use bn::local with sync::asynchronous and sync::bounded_staleness (the server keeps the "     \
    "running statistics)."
#define LOCKSTEP_COMPAT_REPRODUCIBLE_NEEDS_GHOST                                                   \
    "reduce::reproducible needs every batch-norm layer to normalize each chunk on its own: "       \
    "bn::global, bn::group, bn::local, bn::running_only and bn::tower depend on how samples are "  \
    "split over replicas; use bn::ghost<ChunkSamples> (the reducer's chunk size) in every layer."
#define LOCKSTEP_COMPAT_GHOST_NEEDS_REPRODUCIBLE                                                   \
    "bn::ghost<ChunkSamples> normalizes the chunks that reduce::reproducible cuts and gathers "    \
    "their statistics at the end of its step: train it with reduce::reproducible<ChunkSamples> "   \
    "(or use bn::local / bn::global with other reducers)."
#define LOCKSTEP_COMPAT_GHOST_CHUNK                                                                \
    "bn::ghost<C> and reduce::reproducible<C> must use the same chunk size C: each ghost batch "   \
    "is one chunk of the reducer."

/// What the compatibility rules ask of a trainer's SyncPolicy and ReducePolicy, as values.
struct trainer_policy_facts {
    bool asynchronous = false;
    bool local_sgd = false;
    std::size_t chunk_samples = 0; ///< reduce::reproducible's chunk, 0 for other reducers
};
template <sync_policy SyncPolicy, reduce_policy ReducePolicy>
constexpr trainer_policy_facts trainer_facts_of() {
    return {is_asynchronous_v<SyncPolicy>, is_local_sgd_v<SyncPolicy>, ReducePolicy::chunk_samples};
}

/// What the compatibility rules ask of one BN policy (bn::traits), as values.
struct bn_policy_facts {
    bool needs_synchronous = false;
    bool communicates = false;
    std::size_t ghost_chunk = 0; ///< bn::ghost<C>'s C, 0 for other policies
    friend constexpr bool operator==(const bn_policy_facts&, const bn_policy_facts&) = default;
};
template <class P>
constexpr bn_policy_facts bn_facts_of() {
    return {bn::needs_synchronous<P>, bn::communicates<P>, bn::ghost_chunk<P>};
}

/// The sentence of the first rule a layer of BN policy `b` breaks in a trainer of `t`, or null.
/// The compile-time check (check_compatible) applies the same rules to every policy of the
/// network's bn_policies.
constexpr const char* bn_rule_broken(const trainer_policy_facts& t, const bn_policy_facts& b) {
    const bool reproducible = t.chunk_samples > 0;
    if ((t.asynchronous || t.local_sgd) && b.needs_synchronous)
        return LOCKSTEP_COMPAT_BN_NEEDS_SYNCHRONOUS;
    if (t.asynchronous && b.communicates)
        return LOCKSTEP_COMPAT_BN_ASYNC_COLLECTIVE;
    if (reproducible && b.ghost_chunk == 0)
        return LOCKSTEP_COMPAT_REPRODUCIBLE_NEEDS_GHOST;
    if (b.ghost_chunk != 0 && !reproducible)
        return LOCKSTEP_COMPAT_GHOST_NEEDS_REPRODUCIBLE;
    if (reproducible && b.ghost_chunk != t.chunk_samples)
        return LOCKSTEP_COMPAT_GHOST_CHUNK;
    return nullptr;
}

namespace detail {
template <class Tuple>
struct any_bn_needs_synchronous;
template <class... P>
struct any_bn_needs_synchronous<std::tuple<P...>>
    : std::bool_constant<(bn::needs_synchronous<P> || ...)> {};
template <class Tuple>
struct any_bn_communicates;
template <class... P>
struct any_bn_communicates<std::tuple<P...>> : std::bool_constant<(bn::communicates<P> || ...)> {};

// reduce::reproducible and bn::ghost: the BN policies of a network that are not ghost, that
// are ghost, and whose ghost chunk differs from C.
template <class Tuple>
struct bn_ghost_facts;
template <class... P>
struct bn_ghost_facts<std::tuple<P...>> {
    static constexpr bool any_ghost = (bn::is_ghost<P> || ...);
    static constexpr bool all_ghost = (bn::is_ghost<P> && ...);
    template <std::size_t C>
    static constexpr bool all_chunk = ((bn::ghost_chunk<P> == C) && ...);
};
} // namespace detail

/// Checks, at compile time, that SyncPolicy x ReducePolicy x Communicator x the BN policies
/// (a std::tuple of bn:: tags) can train together; every rule fails with a sentence that says
/// what is wrong and what to use instead. data_parallel instantiates it; call it yourself to
/// check a combination early. ensures: true when it compiles.
template <sync_policy SyncPolicy, reduce_policy ReducePolicy, communicator Communicator,
          class BNPolicies = std::tuple<>>
constexpr bool check_compatible() {
    constexpr bool async = is_asynchronous_v<SyncPolicy>;
    constexpr bool local = is_local_sgd_v<SyncPolicy>;
    static_assert(!(async || local) || !detail::any_bn_needs_synchronous<BNPolicies>::value,
                  LOCKSTEP_COMPAT_BN_NEEDS_SYNCHRONOUS);
    static_assert(!async || !detail::any_bn_communicates<BNPolicies>::value,
                  LOCKSTEP_COMPAT_BN_ASYNC_COLLECTIVE);
    static_assert(!async || point_to_point_communicator<Communicator>,
                  "sync::asynchronous and sync::bounded_staleness need point-to-point messages "
                  "with receive-from-any-source (the parameter server answers whichever worker "
                  "pushes first); this communicator has none (NCCL has no any-source receive): "
                  "run the asynchronous server over the thread_group, MPI or hierarchical_group "
                  "communicator.");
    static_assert(!async || ReducePolicy::update_root < 0,
                  "sync::asynchronous already is a parameter server (the server rank applies "
                  "each worker's gradient as it arrives); reduce::parameter_server<Root> is the "
                  "synchronous form of that layout. Use reduce::parameter_server<Root> with "
                  "sync::synchronous, or sync::asynchronous with reduce::per_tensor or "
                  "reduce::bucketed.");
    static_assert(!local || !ReducePolicy::rounds_on_wire,
                  "sync::local_sgd averages WEIGHTS, and reduce::compressed would round them to "
                  "16 bits on the wire, losing the model's precision: use reduce::per_tensor or "
                  "reduce::bucketed with sync::local_sgd.");
    // --- reduce::reproducible and bn::ghost ---
    constexpr bool reproducible = ReducePolicy::chunk_samples > 0;
    using ghost_facts = detail::bn_ghost_facts<BNPolicies>;
    static_assert(!reproducible || !(async || local),
                  "reduce::reproducible makes the weights independent of the replica count by "
                  "summing every chunk's gradient exactly before one update; asynchronous "
                  "workers and local SGD apply updates that depend on the replica count: use "
                  "reduce::reproducible with sync::synchronous.");
    static_assert(!reproducible || ghost_facts::all_ghost,
                  LOCKSTEP_COMPAT_REPRODUCIBLE_NEEDS_GHOST);
    static_assert(!ghost_facts::any_ghost || reproducible,
                  LOCKSTEP_COMPAT_GHOST_NEEDS_REPRODUCIBLE);
    static_assert(!reproducible || !ghost_facts::all_ghost ||
                      ghost_facts::template all_chunk<ReducePolicy::chunk_samples>,
                  LOCKSTEP_COMPAT_GHOST_CHUNK);
    static_assert(!(async || local) || !ReducePolicy::shards_optimizer_state,
                  "reduce::sharded splits the optimizer state over replicas that reduce every "
                  "step's gradient and update together: it needs sync::synchronous. "
                  "sync::asynchronous and sync::bounded_staleness update on the server, and "
                  "sync::local_sgd has no gradient reduction to shard (each replica updates "
                  "alone): use reduce::bucketed with them.");
    return true;
}

} // namespace lockstep

// lockstep/train/detail/gradient_collective.hpp: the gradient_collective concept, what one
// ReducePolicy does in a synchronous step (as CUTLASS's CollectiveMainloop carries its dispatch
// policy), and collective<Policy, T, Communicator>, its one type per policy.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// The collective of ReducePolicy `Policy` for a trainer of value type T over a Communicator:
/// one specialisation per policy, in a file named after it (bucketed_collective.hpp for
/// reduce::per_tensor and reduce::bucketed; parameter_server_collective.hpp,
/// compressed_collective.hpp, sharded_collective.hpp, reproducible_collective.hpp). It owns its
/// reducer, its policy's stages and its policy's state; the step driver of the SyncPolicy
/// (step_driver.hpp) composes it with the policy-free stages (step_stages.hpp), which it
/// receives as an argument. Constructed as
/// `collective(comm, tensors, overlap, params)`: it plans its pieces over the registry layout
/// `tensors` and refuses settings of `params` it cannot run (lockstep::error naming them);
/// with `overlap.enabled` it reduces pieces on a comm_stream (collective: every replica passes
/// the same overlap).
template <class Policy, class T, class Communicator>
class collective;

/// Whether `collective<Policy, T, Communicator>` is defined (a specialisation visible where the
/// trainer is instantiated): data_parallel's static_assert turns a missing one into a sentence.
template <class Policy, class T, class Communicator>
inline constexpr bool has_collective_v = requires {
    sizeof(collective<Policy, T, Communicator>);
};

/// Whether a collective reduces its pieces on a comm_stream, and at which priority the stream's
/// communication thread runs (detail::use_overlap decides both).
struct overlap_setting {
    bool enabled = false;
    comm_priority priority = comm_priority::normal;
};

/// A step function that accepts any network and context (unevaluated: it names the call the
/// concept checks).
struct any_step_fn {
    template <class Network, class Context>
    double operator()(Network&, shard_range, Context&) const;
};

/// What a synchronous step asks of a collective `C` over the step's stages `Stages`, in the order
/// the driver calls it (step_driver.hpp):
/// - `gradient(s, global, fn)`: begins the step (s.begin), runs forward and backward over this
///   replica's samples of the global batch (fn once per micro-batch, or per chunk where the
///   policy cuts the batch itself) and reduces the gradient while backward runs; returns the
///   loss fn reported on the host. ensures: the gradient the policy updates from is formed
///   (reduced on every replica, on reduced_here() replicas, or over this replica's shard), and
///   this replica's row is ready for s.report.
/// - `reduced_here(rank)`: whether replica `rank` holds the reduced gradient (the gradient hook
///   runs there).
/// - `agree(s)`: checks the reduced gradient (its non-finite count, first index and squared norm)
///   and sums the step's status over replicas (s.sum_status): every replica then holds what the
///   skip decision reads.
/// - `update(s)`: clips and updates what this replica updates (s.clip, s.update: unless the
///   step is skipped, which the kernels read) and makes the values equal on every replica.
/// - plan(): the reduction pieces in launch order (the stages check NaN/inf per piece);
///   collectives(): collectives issued so far; overlaps(): whether pieces go on a comm_stream;
///   drain(): after a failed step, waits for the pieces in flight and drops their errors.
/// - status_doubles: the doubles per replica the collective keeps in the step's status (summed
///   with it: step_view::collective), 0 when none.
template <class C, class Stages>
concept gradient_collective = requires(C& c, const C& cc, Stages& s, std::size_t global,
                                       any_step_fn& fn, int rank) {
    { cc.plan() } -> std::same_as<const std::vector<bucket>&>;
    { cc.collectives() } -> std::convertible_to<std::size_t>;
    { cc.overlaps() } -> std::convertible_to<bool>;
    { c.drain() }
    noexcept;
    { C::status_doubles } -> std::convertible_to<std::size_t>;
    { c.gradient(s, global, fn) } -> std::same_as<double>;
    { cc.reduced_here(rank) } -> std::convertible_to<bool>;
    c.agree(s);
    c.update(s);
};

/// A collective that can average values over replicas (what sync::local_sgd<K> needs of it):
/// `average(values)`: values = the mean over replicas on every replica (collective).
template <class C, class T>
concept averaging_collective = requires(C& c, std::span<T> values) {
    c.average(values);
};

/// The update of a collective after which every replica holds the reduced gradient: clipped and
/// updated on every replica alike, so the values stay equal.
template <class Stages>
void update_every_element(Stages& s) {
    const auto all = s.core().optimizer_shard(); // every element
    s.clip(all);
    s.update(all);
}

} // namespace lockstep::detail

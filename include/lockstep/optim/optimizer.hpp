// lockstep/optim/optimizer.hpp: the optimizer concept, tensor segments, state views, all_finite.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/system/system.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <thrust/functional.h>
#include <thrust/transform_reduce.h>

namespace lockstep {

/// One tensor inside a flat parameter buffer: elements [offset, offset + size).
/// Optimizers take the buffer's layout as a list of segments, sorted by offset and not
/// overlapping; elements outside every segment (alignment padding) are never touched.
/// SGD and Adam use segments only for `decay`; LARS and LAMB compute one trust ratio per segment.
struct tensor_segment {
    std::size_t offset = 0;
    std::size_t size = 0;
    bool decay = true; ///< apply weight decay (false is usual for biases and BN gamma/beta)
    bool adapt = true; ///< LARS/LAMB: scale by the trust ratio (false: ratio 1, plain update)
};

/// One named state buffer of an optimizer (e.g. "momentum", "exp_avg", "exp_avg_sq"), a span
/// over the optimizer's System memory.
template <class T>
struct state_slot {
    std::string_view name;
    std::span<T> data;
};

/// An optimizer's checkpointable state: its step count (updates applied so far; skipped steps do
/// not count) and its buffers, in a fixed order. A view: the slots stay valid as long as the
/// optimizer lives; `step` is the count when the view was taken.
template <class T>
struct state_view {
    std::int64_t step = 0;
    std::vector<state_slot<T>> slots;
};

/// What the trainer may call on an optimizer O (sgd, adam, adamw, lars, lamb):
/// - `O(n, params, system, segments)`: state for a flat buffer of n parameters, zero moments;
/// - `o.step(w, g, skip)`: one fused update of w (n elements, System memory) from g (same size),
///   unless *skip != 0 when the step's kernels run: skip points to one int in System memory (a
///   device flag on a GPU, read by the kernels, never by the host) or is null (never skip). A
///   skipped step changes nothing: not w, not the state buffers, not the step count. step()
///   never synchronises with the device, never reads device memory on the host and never
///   allocates, so a step can be captured in a CUDA graph;
/// - `o.step(w, g)`: the same as `o.step(w, g, nullptr)`;
/// - `o.lr()` / `o.set_lr(x)`: the learning rate the next step uses (schedules set it, on the
///   host, before step());
/// - `o.step_count()`: the applied steps (bias corrections use this count); on a device system
///   a synchronising read, not meant for use inside a step;
/// - `o.size()`, `o.params()`, `o.system()` (system_type models execution_system);
/// - `o.state()` (views for checkpoints) and `o.load_state(view)` (restore; throws
///   lockstep::error with errc::checkpoint when names or sizes differ).
template <class O>
concept optimizer = requires(O& o, const O& co, std::span<typename O::value_type> w,
                             std::span<const typename O::value_type> g, const int* skip, double lr,
                             const state_view<const typename O::value_type>& saved) {
    typename O::params_type;
    typename O::system_type;
    requires execution_system<typename O::system_type>;
    requires std::constructible_from<O, std::size_t, typename O::params_type,
                                     typename O::system_type, std::span<const tensor_segment>>;
    o.step(w, g);
    o.step(w, g, skip);
    o.set_lr(lr);
    { co.lr() } -> std::convertible_to<double>;
    { co.step_count() } -> std::convertible_to<std::int64_t>;
    { co.size() } -> std::convertible_to<std::size_t>;
    { co.params() } -> std::convertible_to<const typename O::params_type&>;
    { o.state() } -> std::same_as<state_view<typename O::value_type>>;
    { co.state() } -> std::same_as<state_view<const typename O::value_type>>;
    o.load_state(saved);
};

/// True when every element of x (in sys's memory) is finite: a host-side check for callers
/// outside a trainer (the result comes back to the host, so on a device it synchronises; the
/// trainer instead counts non-finite values on the device and passes optimizers a skip flag).
/// Runs with sys's policy (kernels::with_policy_for: on the host system a span of fewer than
/// kernels::host_serial_below elements is checked on the calling thread; same result, a
/// logical and). ensures: true for an empty span.
template <class T, execution_system System>
bool all_finite(std::span<const T> x, const System& sys) {
    return kernels::with_policy_for(sys, x.size(), [&](auto policy) {
        return thrust::transform_reduce(policy, x.data(), x.data() + x.size(),
                                        kernels::is_finite_fn{}, true, thrust::logical_and<bool>{});
    });
}

} // namespace lockstep

// lockstep/core/step_status.hpp: the layout of a training step's device-resident status and the
// scope through which layers of the user's network report into it.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace lockstep {

/// The slots of a synchronous step's status: `slots` doubles in the replica's system memory.
/// The first `reduced` slots are summed over replicas by one all_reduce at the end of the step
/// (together with the per-replica rows before them, see replica_slot); the rest are this
/// replica's own. Decisions (skip the update, the gradient factor) are taken on the device from
/// these values; the host reads them once, at the end of the step, and only if asked.
namespace status_slot {
inline constexpr std::size_t loss = 0;            ///< loss the step function reported
inline constexpr std::size_t non_finite = 1;      ///< NaN/inf gradient elements before reduction
inline constexpr std::size_t layer_errors = 2;    ///< layers that found invalid statistics
inline constexpr std::size_t loss_non_finite = 3; ///< replicas whose loss is NaN/inf
inline constexpr std::size_t skip_requests = 4;   ///< requests to skip the step (not errors)
inline constexpr std::size_t reduced = 5;         ///< slots [0, reduced) are all_reduced (sum)
inline constexpr std::size_t error_code = 5;      ///< first layer error: a layer_error value
inline constexpr std::size_t error_layer = 6;     ///< its layer, in forward order from 0
inline constexpr std::size_t error_value = 7;     ///< its detail (a replica, or -1)
inline constexpr std::size_t skip = 8;            ///< 1 when the update is skipped (set on device)
inline constexpr std::size_t reduced_non_finite = 9; ///< NaN/inf elements of the reduced gradient
inline constexpr std::size_t reduced_first = 10;     ///< 1 + flat index of its first one (0: none)
inline constexpr std::size_t grad_norm2 = 11;        ///< squared 2-norm of the gradient (as held)
inline constexpr std::size_t grad_unscale = 12; ///< factor the held gradient needs (1 by default)
inline constexpr std::size_t grad_factor = 13;  ///< factor applied to the gradient (on device)
inline constexpr std::size_t mismatch = 14;     ///< 1 when replicas disagree on a step setting
inline constexpr std::size_t slots = 15;
} // namespace status_slot

/// A synchronous step's status buffer starts with one row of `slots` doubles per replica, then
/// the status_slot block: row r is written by replica r only (zero elsewhere), so the status
/// all_reduce (a sum over the rows and status_slot [0, reduced)) gives every replica every
/// replica's row without another collective.
namespace replica_slot {
inline constexpr std::size_t non_finite = 0;       ///< NaN/inf elements of its local gradient
inline constexpr std::size_t first_non_finite = 1; ///< 1 + flat index of the first (0: none)
inline constexpr std::size_t loss_non_finite = 2;  ///< 1 when its loss is NaN/inf
inline constexpr std::size_t global_batch = 3;     ///< the global_batch it passed to step()
inline constexpr std::size_t lr = 4;               ///< the learning rate of its step
inline constexpr std::size_t slots = 5;
} // namespace replica_slot

/// The layer errors found on the device (values of status_slot::error_code).
enum class layer_error { none = 0, peer_invalid_input = 1, single_value = 2 };

namespace detail {

/// Where layers report errors they find on the device during a training step: the device
/// pointer to the step's status (status_slot layout), and the number of layers that reported so
/// far (a layer's id in forward order). Set by the trainer for the duration of a step on the
/// replica's thread; null outside steps (a layer then checks its own status at once).
/// `skip` is the step's skip flag in the same memory (set on the device by the trainer's skip
/// decision; an int, 1: skipped) and `commits` the list where layers that change state during
/// the forward pass (batch-norm running statistics) register a commit hook, once per step
/// (`step_id` changes every step): the trainer calls every hook after the skip decision, on the
/// replica's thread and stream, so a layer can restore its state on the device when the step is
/// skipped. Both may be null (no trainer decision follows: nothing to register).
struct step_commit_hook {
    void* object = nullptr;
    void (*commit)(void* object, const int* skip) = nullptr;
};
struct status_sink {
    double* status = nullptr;
    int layers = 0;
    const int* skip = nullptr;
    std::vector<step_commit_hook>* commits = nullptr;
    std::uint64_t step_id = 0;
};

/// A process-wide counter of steps, for status_sink::step_id (never 0).
inline std::uint64_t next_step_id() noexcept {
    static std::atomic<std::uint64_t> id{0};
    return id.fetch_add(1, std::memory_order_relaxed) + 1;
}

inline status_sink*& current_status_sink() noexcept {
    thread_local status_sink* sink = nullptr;
    return sink;
}

/// Installs a sink on the calling thread for the scope's lifetime (restores the previous one).
class status_scope {
public:
    explicit status_scope(status_sink& sink) : previous_(current_status_sink()) {
        current_status_sink() = &sink;
    }
    status_scope(const status_scope&) = delete;
    status_scope& operator=(const status_scope&) = delete;
    ~status_scope() { current_status_sink() = previous_; }

private:
    status_sink* previous_;
};

} // namespace detail
} // namespace lockstep

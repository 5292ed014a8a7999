// lockstep/core/step_status.hpp: the layout of a training step's device-resident status and the
// scope through which layers of the user's network report into it.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

namespace lockstep {

/// The slots of a synchronous step's status: `slots` doubles in the replica's system memory.
/// The first `reduced` slots are summed over replicas by one all_reduce at the end of the step;
/// the rest describe the first layer error this replica saw. Decisions (skip the update) are
/// taken on the device from these values; the host reads them once, at the end of the step,
/// and only if asked.
namespace status_slot {
inline constexpr std::size_t loss = 0;         ///< loss the step function reported
inline constexpr std::size_t non_finite = 1;   ///< NaN/inf elements of the gradient
inline constexpr std::size_t layer_errors = 2; ///< layers that found invalid statistics
inline constexpr std::size_t reduced = 3;      ///< slots [0, reduced) are all_reduced (sum)
inline constexpr std::size_t error_code = 3;   ///< first layer error: a layer_error value
inline constexpr std::size_t error_layer = 4;  ///< its layer, in forward order from 0
inline constexpr std::size_t error_value = 5;  ///< its detail (a replica, or -1)
inline constexpr std::size_t skip = 6;         ///< 1 when the update is skipped (set on device)
inline constexpr std::size_t slots = 7;
} // namespace status_slot

/// The layer errors found on the device (values of status_slot::error_code).
enum class layer_error { none = 0, peer_invalid_input = 1, single_value = 2 };

namespace detail {

/// Where layers report errors they find on the device during a training step: the device
/// pointer to the step's status (status_slot layout), and the number of layers that reported so
/// far (a layer's id in forward order). Set by the trainer for the duration of a step on the
/// replica's thread; null outside steps (a layer then checks its own status at once).
struct status_sink {
    double* status = nullptr;
    int layers = 0;
};

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

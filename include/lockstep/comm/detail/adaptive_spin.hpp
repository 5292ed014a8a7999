// lockstep/comm/detail/adaptive_spin.hpp: how long a waiter spins before it sleeps, learned from
// how long its recent waits took. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>

namespace lockstep::detail {

/// One waiter's estimate of how long its waits of one kind take, and the spin it implies.
/// Replicas reach a collective apart by about as much as their work before it differs, and that
/// is steady from step to step: a replica that arrives 20 us early every time should spin about
/// that long instead of sleeping and paying a wake-up (about 15 us on a small VM, and MPI makes
/// no progress while a process sleeps). typical() is a moving average (weight 1/8) of the waits
/// that ended within `longest`; a longer wait (a peer descheduled, or busy with other work)
/// halves it instead, so a waiter whose peers keep it waiting long falls back to its floor and
/// sleeps rather than burn a core another process may need.
class wait_estimate {
public:
    std::chrono::nanoseconds typical() const noexcept { return typical_; }

    /// Records a wait that took `waited`.
    void record(std::chrono::nanoseconds waited, std::chrono::nanoseconds longest) noexcept {
        if (waited > longest)
            typical_ /= 2;
        else
            typical_ += (waited - typical_) / 8;
    }

    /// How long the next wait spins: twice typical(), at least `floor`, at most `cap`.
    std::chrono::nanoseconds spin(std::chrono::nanoseconds floor,
                                  std::chrono::nanoseconds cap) const noexcept {
        return std::clamp<std::chrono::nanoseconds>(2 * typical_, floor, std::max(floor, cap));
    }

private:
    std::chrono::nanoseconds typical_{0};
};

} // namespace lockstep::detail

// lockstep/train/detail/duty_pacer.hpp: duty_pacer, which keeps a background thread (a
// checkpoint writer) busy for at most a share of its time.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <chrono>
#include <thread>

namespace lockstep::detail {

/// Keeps the thread that calls it busy for at most `share` of its time: each call sleeps
/// (1 - share) / share times the time since the previous call returned.
class duty_pacer {
public:
    explicit duty_pacer(double share) : share_(share) {}
    void operator()() const {
        if (share_ >= 1)
            return;
        const auto busy = std::chrono::steady_clock::now() - since_;
        std::this_thread::sleep_for(busy * ((1 - share_) / share_));
        since_ = std::chrono::steady_clock::now();
    }

private:
    double share_;
    mutable std::chrono::steady_clock::time_point since_ = std::chrono::steady_clock::now();
};

} // namespace lockstep::detail

// tests/support/replica_loss.hpp: loss_injector, fault injection for the shrink tests: one
// replica of a thread_group is lost in a named step at a named point (it throws, or stalls
// past the timeout), through thread_group_params::on_collective. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/collective_event.hpp"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace lockstep_test {

/// What the lost replica's thread throws: its function catches it and returns (the thread ends).
struct replica_killed : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// Where in a data_parallel step (counted from its fence barrier, "data_parallel.fence") the
/// replica is lost.
enum class loss_point {
    fence,    ///< entering the step's fence: the others are in the fence or the previous step
    exchange, ///< entering the first collective after the fence (the gradient exchange)
    checks,   ///< entering the step's last collective (the status all_reduce with the checks)
    /// after the others arrived at the step's last collective: the lowest surviving replica
    /// completes it (and the step), every other survivor fails in it
    after_checks_on_some,
    stall ///< entering the first collective after the fence, it stalls until the run shrank
};

/// The loss: replica `replica` (thread_group index) in step `step` (0-based) at `point`;
/// `collectives` is how many collectives one step issues, fence included (learnt from an
/// undisturbed run with count()).
struct replica_loss {
    int replica = 0;
    std::int64_t step = 0;
    loss_point point = loss_point::exchange;
    std::size_t collectives = 0;
};

/// Watches every collective of a thread_group (hook()): counts each replica's steps by their
/// fences and, when one is given, makes the replica of `loss` fail there. Only the first
/// generation is watched (after the shrink the steps are computed again).
class loss_injector {
public:
    /// `replicas`: the thread_group's size; no loss: only counts.
    explicit loss_injector(int replicas, std::optional<replica_loss> loss = std::nullopt)
        : loss_(loss), at_(static_cast<std::size_t>(replicas)) {}

    /// The thread_group_params::on_collective hook (it refers to this injector).
    std::function<void(const lockstep::collective_event&)> hook() {
        return [this](const lockstep::collective_event& e) { observe(e); };
    }

    /// The collectives of the last step replica 0 entered (fence included), for replica_loss.
    std::size_t per_step() const {
        std::lock_guard lock(mutex_);
        return last_step_collectives_;
    }

    /// Marks the lost replica's thread ended (its function caught replica_killed).
    void mark_dead() { dead_.store(true); }
    /// Tells a stalled replica the others have shrunk.
    void release() { released_.store(true); }
    bool fired() const { return fired_.load(); }

private:
    struct position {
        std::int64_t step = -1; ///< -1 before the first fence (construction's collectives)
        std::size_t index = 0;  ///< collectives entered in this step, the fence being 0
    };

    void observe(const lockstep::collective_event& e) {
        using m = lockstep::collective_event::moment;
        if (e.generation != 0 || !e.label.empty())
            return;
        position& p = at_[static_cast<std::size_t>(e.replica)];
        if (e.when == m::entered) {
            if (e.tag == "data_parallel.fence") {
                if (e.replica == 0 && p.step >= 0) {
                    std::lock_guard lock(mutex_);
                    last_step_collectives_ = p.index + 1;
                }
                ++p.step;
                p.index = 0;
            } else if (p.step >= 0) {
                ++p.index;
            }
            if (loss_ && e.replica == completer() && p.step == loss_->step + 1)
                completed_.store(true); // it completed the target step
        }
        if (!loss_ || p.step != loss_->step)
            return;
        const replica_loss& l = *loss_;
        const std::size_t last = l.collectives - 1;
        const bool victim = e.replica == l.replica;
        switch (l.point) {
        case loss_point::fence:
            if (victim && e.when == m::entered && p.index == 0)
                kill();
            break;
        case loss_point::exchange:
            if (victim && e.when == m::entered && p.index == 1)
                kill();
            break;
        case loss_point::checks:
            if (victim && e.when == m::entered && p.index == last)
                kill();
            break;
        case loss_point::stall:
            if (victim && e.when == m::entered && p.index == 1) {
                fired_.store(true);
                while (!released_.load())
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
            break;
        case loss_point::after_checks_on_some:
            if (e.when != m::arrived || p.index != last)
                break;
            if (victim) {
                wait_for(completed_); // the completer is past the collective
                kill();
            } else if (e.replica != completer()) {
                wait_for(dead_); // fails in it: the victim left it meanwhile
            }
            break;
        }
    }

    int completer() const { return loss_->replica == 0 ? 1 : 0; }

    void kill() {
        fired_.store(true);
        throw replica_killed("replica " + std::to_string(loss_->replica) + " killed in step " +
                             std::to_string(loss_->step));
    }

    static void wait_for(const std::atomic<bool>& flag) {
        while (!flag.load())
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }

    std::optional<replica_loss> loss_;
    std::vector<position> at_; ///< by replica; each written by its own thread only
    mutable std::mutex mutex_;
    std::size_t last_step_collectives_ = 0;
    std::atomic<bool> completed_{false};
    std::atomic<bool> dead_{false};
    std::atomic<bool> released_{false};
    std::atomic<bool> fired_{false};
};

} // namespace lockstep_test

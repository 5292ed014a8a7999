// lockstep/train/detail/trainer_presence.hpp: trainer_presence, the trainers alive on one
// communicator object, so that a trainer with on_replica_failure = shrink is the only one there.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <mutex>
#include <unordered_map>
#include <utility>

namespace lockstep::detail {

/// One trainer's presence on a communicator object (held by replica_core): counted while it
/// lives. A shrink changes the communicator object under every trainer built on it, and only
/// the trainer whose step found the loss recovers (rolls back and rebuilds its parts for the
/// new size); another trainer's next step would meet a group of another size. So a trainer with
/// on_replica_failure = shrink is refused on a communicator that holds a live trainer, and any
/// trainer on one that holds a live shrinking trainer: errc::unsupported naming this replica.
/// Trainers are constructed collectively, in the same order on every replica, so every replica
/// refuses the same one. Move-only; thread-safe (thread replicas construct theirs
/// concurrently, each on its own communicator object).
class trainer_presence {
public:
    trainer_presence(const void* comm, bool shrinks, int rank) : comm_(comm), shrinks_(shrinks) {
        const std::lock_guard<std::mutex> lock(guard());
        count& c = table()[comm_];
        const bool refused = shrinks_ ? c.live > 0 : c.shrinking > 0;
        LOCKSTEP_REQUIRE(!refused, errc::unsupported, rank, "data_parallel",
                         shrinks_ ? "on_replica_failure = shrink with another trainer alive on "
                                    "this communicator ("
                                  : "a trainer on a communicator whose trainer has "
                                    "on_replica_failure = shrink (",
                         c.live,
                         " live): a shrink changes the communicator under every trainer on it "
                         "and only the one whose step found the loss recovers; destroy the other "
                         "trainer first, or build one of them on a communicator of its own "
                         "(comm.split(0, comm.rank()))");
        ++c.live;
        if (shrinks_)
            ++c.shrinking;
    }
    trainer_presence(trainer_presence&& o) noexcept
        : comm_(std::exchange(o.comm_, nullptr)), shrinks_(o.shrinks_) {}
    trainer_presence& operator=(trainer_presence&& o) noexcept {
        if (this != &o) {
            leave();
            comm_ = std::exchange(o.comm_, nullptr);
            shrinks_ = o.shrinks_;
        }
        return *this;
    }
    trainer_presence(const trainer_presence&) = delete;
    trainer_presence& operator=(const trainer_presence&) = delete;
    ~trainer_presence() { leave(); }

private:
    struct count {
        int live = 0;
        int shrinking = 0;
    };
    static std::mutex& guard() {
        static std::mutex m;
        return m;
    }
    static std::unordered_map<const void*, count>& table() {
        static std::unordered_map<const void*, count> t;
        return t;
    }
    void leave() noexcept {
        if (comm_ == nullptr)
            return;
        const std::lock_guard<std::mutex> lock(guard());
        const auto it = table().find(comm_);
        if (it == table().end())
            return;
        --it->second.live;
        if (shrinks_)
            --it->second.shrinking;
        if (it->second.live == 0)
            table().erase(it);
        comm_ = nullptr;
    }

    const void* comm_;
    bool shrinks_;
};

} // namespace lockstep::detail

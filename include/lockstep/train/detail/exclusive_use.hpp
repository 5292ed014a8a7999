// lockstep/train/detail/exclusive_use.hpp: exclusive_use, a trainer's guard against a step
// entered again while one runs (from the step function, the gradient hook, or another thread).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <mutex>
#include <thread>

namespace lockstep::detail {

/// The one training call (a step, a counted replay, an asynchronous train()) in progress on a
/// trainer. A second one would zero, reduce and apply the buffers the first still uses, and
/// take sequence numbers of the same communicator, leaving the weights wrong or the replicas
/// apart without a word: enter() refuses it. Calls that only read or finish (read_result,
/// finish, a synchronous trainer's saves) may run inside a step on its own thread, but not on
/// another thread meanwhile (check_thread); calls that need every replica between training calls
/// (loads, the asynchronous trainers' saves) are refused inside one too (check_between).
class exclusive_use {
public:
    /// Leaves the call entered (its destructor), however it ends.
    class [[nodiscard]] scope {
    public:
        scope(const scope&) = delete;
        scope& operator=(const scope&) = delete;
        ~scope() { use_.leave(); }

    private:
        friend class exclusive_use;
        explicit scope(exclusive_use& u) : use_(u) {}
        exclusive_use& use_;
    };

    /// Enters `op` on replica `rank`. Throws lockstep::error (errc::invalid_argument) naming
    /// both calls when one is in progress: from inside it on this thread (the step function,
    /// the gradient hook, on_apply) or on another thread.
    scope enter(int rank, const char* op) {
        const std::lock_guard lock(mutex_);
        if (inside_ != nullptr)
            refuse(rank, op);
        inside_ = op;
        owner_ = std::this_thread::get_id();
        return scope(*this);
    }

    /// Throws as enter() when a call is in progress on another thread; nothing otherwise.
    void check_thread(int rank, const char* op) const {
        const std::lock_guard lock(mutex_);
        if (inside_ != nullptr && owner_ != std::this_thread::get_id())
            refuse(rank, op);
    }

    /// Throws as enter() when a call is in progress on any thread: for calls that must come
    /// between training calls (`why`: what would go wrong inside one).
    void check_between(int rank, const char* op, const char* why) const {
        const std::lock_guard lock(mutex_);
        if (inside_ == nullptr)
            return;
        if (owner_ != std::this_thread::get_id())
            refuse(rank, op);
        fail(errc::invalid_argument, rank, op, "called while ", inside_,
             " of this trainer runs on the same thread (from the step function, the gradient "
             "hook or on_apply): ",
             why, "; call it between training calls");
    }

private:
    [[noreturn]] void refuse(int rank, const char* op) const {
        if (owner_ == std::this_thread::get_id())
            fail(errc::invalid_argument, rank, op, "called while ", inside_,
                 " of this trainer runs on the same thread (from the step function, the "
                 "gradient hook or on_apply): it would reuse the buffers of the call in "
                 "progress; call it between steps");
        fail(errc::invalid_argument, rank, op,
             "called on a second thread while another thread is "
             "inside ",
             inside_,
             " of this trainer: a trainer and its communicator are used by one "
             "thread at a time (the replica's)");
    }
    void leave() noexcept {
        const std::lock_guard lock(mutex_);
        inside_ = nullptr;
    }

    mutable std::mutex mutex_;
    const char* inside_ = nullptr; ///< the call in progress (a string literal), or none
    std::thread::id owner_;        ///< the thread inside it
};

} // namespace lockstep::detail

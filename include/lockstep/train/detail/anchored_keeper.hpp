// lockstep/train/detail/anchored_keeper.hpp: where one replica keeps its chunk gradients of a
// reduce::reproducible step until the exchange (every chunk but the last, which stays in the
// gradient). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/detail/anchored_host.hpp"
#include "lockstep/system/buffer.hpp"

#include <cstddef>
#include <span>

namespace lockstep::detail {

/// One replica's chunks of a step, n values each: begin(); per chunk take() in parts, then add().
/// A kept chunk goes to a slot: this keeper's store, or slots the caller gives (the gathered
/// exchange keeps them in its send region, and copies the last chunk there too). The passes are
/// the system's (kernels::anchored_keep; host_system's float tiles by argument-dependent lookup).
template <class T, class System>
class anchored_keeper {
public:
    anchored_keeper(std::size_t n, int rank, const System& sys) : n_(n), rank_(rank), sys_(sys) {}

    /// Starts a step of `calls` >= 1 chunks, kept at `slots` ((calls - 1) * n values, calls * n
    /// with copy_last) or, when null, in this keeper's store.
    void begin(std::size_t calls, T* slots, bool copy_last) {
        calls_ = calls;
        added_ = kept_ = 0;
        copy_last_ = copy_last;
        if (slots == nullptr && store_.size() < (calls - 1) * n_)
            store_ = buffer<T, System>((calls - 1) * n_, sys_);
        slots_ = slots != nullptr ? slots : store_.data();
    }
    std::size_t calls() const noexcept { return calls_; }
    /// Elements [first, first + count) of the chunk being computed are final in g (n values):
    /// of a kept chunk, copied to its slot and left zero in g (the next chunk accumulates there)
    /// in one pass that the backward may still find in the caches (a device keeps the whole
    /// chunk in one launch once it is taken); every element exactly once, in any order. The
    /// last chunk stays in g.
    void take(std::span<T> g, std::size_t first, std::size_t count) {
        if (!keeps_current())
            return;
        LOCKSTEP_REQUIRE(first <= n_ && count <= n_ - first && count <= n_ - kept_, errc::internal,
                         rank_, "reduce::reproducible.take", "elements [", first, ", ",
                         first + count, ") of chunk ", added_, " of ", calls_, " (", kept_, " of ",
                         n_, " kept)");
        kept_ += count;
        if (System::is_host)
            pass(g.data(), slot(added_), g.data(), first, first + count);
        else if (kept_ == n_ && count > 0)
            pass(g.data(), slot(added_), g.data(), 0, n_);
    }
    /// Ends the chunk being computed, whose gradient is in g: a kept chunk must have been taken
    /// whole; the last one stays in g (copy_last: also copied to its slot).
    void add(std::span<const T> g) {
        if (keeps_current())
            LOCKSTEP_REQUIRE(kept_ == n_, errc::internal, rank_, "reduce::reproducible.add",
                             "chunk ", added_, " of ", calls_, " ended with ", kept_, " of its ",
                             n_, " elements kept");
        else if (copy_last_)
            pass(g.data(), slot(added_), nullptr, 0, n_);
        kept_ = 0;
        ++added_;
    }
    /// The chunks (the last one at `last`) as the anchored functors read them.
    kernels::anchored_chunks<T> chunks(const T* last) const noexcept {
        return {slots_, last, calls_, n_};
    }

private:
    bool keeps_current() const noexcept { return added_ + 1 < calls_; }
    T* slot(std::size_t c) noexcept { return slots_ + c * n_; }
    void pass(const T* src, T* dst, T* clear, std::size_t first, std::size_t end) {
        using kernels::anchored_keep; // host_system's overload found by argument-dependent lookup
        anchored_keep(sys_, src, dst, clear, first, end, n_);
    }

    std::size_t n_;
    int rank_;
    System sys_;
    std::size_t calls_ = 1;
    std::size_t added_ = 0;
    std::size_t kept_ = 0; ///< elements of the current chunk kept
    bool copy_last_ = false;
    T* slots_ = nullptr;
    buffer<T, System> store_; ///< the slots when the caller gives none
};

} // namespace lockstep::detail

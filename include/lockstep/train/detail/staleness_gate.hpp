// lockstep/train/detail/staleness_gate.hpp: the parameter server's admission rule, which keeps
// every applied gradient at most S versions old. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace lockstep::detail {

/// Bookkeeping of a parameter server with workers 0..workers-1: the server version V (the
/// number of gradients applied), which workers are OUTSTANDING (hold parameters of version v_w
/// and will push one gradient computed on them) and the admission rule that bounds staleness.
///
/// Staleness of a gradient = V when it is applied - v_w (the version it was computed on).
///
/// Invariant I (kept for max_staleness = S):
///     for every outstanding w:  (V - v_w) + (|O| - 1) <= S
/// where O is the set of outstanding workers.
///
/// Proof that I holds and bounds staleness:
/// - Initially O is empty: I holds vacuously.
/// - admit(x) hands x the parameters of version V (v_x = V) and is allowed only when I holds
///   for O + {x} (checked by can_admit: (V - min over O+{x} of v_w) + |O + {x}| - 1 <= S).
/// - apply(y) for an outstanding y: V grows by one and y leaves O, so for every other
///   outstanding w the left side of I changes by +1 - 1 = 0: I still holds. Nothing else
///   changes V or O.
/// - So when y's gradient is applied, I held just before: V - v_y <= S - (|O| - 1) <= S.
/// Hence no gradient older than S versions is ever applied. A fast worker that would break I
/// is simply not handed new parameters until a slow worker's gradient has arrived (that apply
/// keeps I, and the slow worker leaving O frees the room); it waits in a FIFO queue.
/// Liveness: with O empty, can_admit(x) reduces to 0 <= S, so some worker can always run and
/// every outstanding worker eventually pushes; the server never deadlocks.
/// For S = max (sync::asynchronous) every admission is allowed.
class staleness_gate {
public:
    static constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();

    staleness_gate(int workers, std::size_t max_staleness)
        : max_staleness_(max_staleness), version_of_(static_cast<std::size_t>(workers), none) {}

    /// The server version (gradients applied so far).
    std::uint64_t version() const noexcept { return version_; }
    /// Number of outstanding workers.
    int outstanding() const noexcept { return outstanding_; }
    /// True when worker w holds parameters and owes a gradient.
    bool is_outstanding(int w) const noexcept { return version_of_[idx(w)] != none; }
    /// The version worker w computes on. requires: is_outstanding(w).
    std::uint64_t version_of(int w) const noexcept { return version_of_[idx(w)]; }

    /// True when handing worker x the current parameters keeps invariant I.
    /// requires: !is_outstanding(x).
    bool can_admit(int /*x*/) const noexcept {
        if (max_staleness_ == std::numeric_limits<std::size_t>::max())
            return true;
        std::uint64_t oldest = version_; // x itself would compute on version_
        for (const std::uint64_t v : version_of_)
            if (v != none && v < oldest)
                oldest = v;
        const std::uint64_t lhs = (version_ - oldest) + static_cast<std::uint64_t>(outstanding_);
        return lhs <= max_staleness_;
    }

    /// Worker x now computes on the current version. requires: can_admit(x).
    /// ensures: version_of(x) == version().
    void admit(int x) noexcept {
        version_of_[idx(x)] = version_;
        ++outstanding_;
    }

    /// Worker y's gradient is applied now. requires: is_outstanding(y).
    /// ensures: returns the staleness (old version() - version_of(y)), the version grew by one
    /// and y is no longer outstanding.
    std::uint64_t apply(int y) noexcept {
        const std::uint64_t s = version_ - version_of_[idx(y)];
        version_of_[idx(y)] = none;
        --outstanding_;
        ++version_;
        return s;
    }

    /// Worker y's push carried no gradient (it failed, or the run is being aborted): y leaves O
    /// without changing the version (I keeps holding: only |O| shrinks).
    void release(int y) noexcept {
        version_of_[idx(y)] = none;
        --outstanding_;
    }

private:
    static std::size_t idx(int w) noexcept { return static_cast<std::size_t>(w); }

    std::size_t max_staleness_;
    std::uint64_t version_ = 0;
    int outstanding_ = 0;
    std::vector<std::uint64_t> version_of_;
};

} // namespace lockstep::detail

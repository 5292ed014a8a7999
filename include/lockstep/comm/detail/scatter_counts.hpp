// lockstep/comm/detail/scatter_counts.hpp: the per-rank counts of a reduce_scatter: where each
// rank's slice starts, their sum, and how messages and signatures describe them.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/detail/fnv1a.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace lockstep::detail {

/// What a reduce_scatter's counts say for one rank.
struct scatter_layout {
    std::size_t offset = 0;  ///< where the rank's slice starts in send (sum of earlier counts)
    std::size_t mine = 0;    ///< the rank's count (0 when rank is not an index of counts)
    std::size_t total = 0;   ///< the sum of all counts (meaningless when overflow)
    std::size_t largest = 0; ///< the largest count
    bool overflow = false;   ///< the sum does not fit in std::size_t
    bool equal = true;       ///< every count is the same (the block form applies)
};

/// The layout of `counts` seen from `rank`. requires: counts.data() valid for counts.size().
inline scatter_layout scatter_layout_of(std::span<const std::size_t> counts, int rank) noexcept {
    scatter_layout l;
    for (std::size_t r = 0; r < counts.size(); ++r) {
        const std::size_t c = counts[r];
        if (static_cast<std::size_t>(rank) == r && rank >= 0) {
            l.offset = l.total;
            l.mine = c;
        }
        l.overflow = l.overflow || __builtin_add_overflow(l.total, c, &l.total);
        l.largest = c > l.largest ? c : l.largest;
        l.equal = l.equal && c == counts[0];
    }
    return l;
}

/// "{3, 0, 5}" (at most 8 entries, then ", ... (N in all)") for messages.
inline std::string describe_counts(std::span<const std::size_t> counts) {
    std::string s = "{";
    const std::size_t shown = counts.size() < 8 ? counts.size() : 8;
    for (std::size_t r = 0; r < shown; ++r)
        s += (r == 0 ? "" : ", ") + std::to_string(counts[r]);
    if (shown < counts.size())
        s += ", ... (" + std::to_string(counts.size()) + " in all)";
    return s + "}";
}

/// A 62-bit FNV-1a hash of the counts (number included), for a signature field compared by
/// min/max: replicas with different counts get different values except with negligible
/// probability; the value is positive, so negating it cannot overflow.
inline std::int64_t counts_hash(std::span<const std::size_t> counts) noexcept {
    std::uint64_t h = fnv1a_u64(counts.size(), fnv1a_basis);
    for (const std::size_t c : counts)
        h = fnv1a_u64(c, h);
    return static_cast<std::int64_t>(h >> 2) | 1;
}

} // namespace lockstep::detail

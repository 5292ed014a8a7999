// lockstep/train/shard.hpp: shard_range and shard(), the contiguous split of a global batch over
// replicas. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <cstddef>
#include <cstdint>

namespace lockstep {

/// The samples [begin, end) of one step's global batch that this replica (or this micro-batch on
/// this replica) processes. Positions are indices into the global batch of the step, 0-based.
/// - global_size: the number of samples of the whole global batch of the step (all replicas,
///   all micro-batches).
/// - scale: what to multiply the SUM of per-sample losses of this range by. Synchronous
///   training: 1 / global_size, so the gradients lockstep sums over replicas (and over
///   micro-batches) are the gradient of the MEAN loss over the global batch, whatever the split.
///   sync::local_sgd: 1 / (this replica's sample count in the step), each replica minimizing
///   its own mean loss. 0 for an empty range.
/// - sample_offset: the run-wide index of position 0 of this step's global batch (the sum of the
///   previous steps' global batch sizes); global sample index of position i = sample_offset + i.
///   Key per-sample random numbers (dropout) with it: they then do not depend on the split.
struct shard_range {
    std::size_t begin = 0;
    std::size_t end = 0;
    std::size_t global_size = 0;
    double scale = 0.0;
    std::uint64_t sample_offset = 0;

    /// Number of samples in the range (may be 0).
    constexpr std::size_t size() const noexcept { return end - begin; }
    constexpr bool empty() const noexcept { return end == begin; }
    /// The run-wide sample index of global-batch position i (for counter-based RNG streams).
    constexpr std::uint64_t sample_index(std::size_t i) const noexcept { return sample_offset + i; }
};

/// The contiguous part of [first, last) replica `rank` of `size` replicas gets: the first
/// (last - first) % size replicas get one sample more than the others, so counts differ by at
/// most one and a replica gets an empty range when there are fewer samples than replicas.
/// requires: first <= last, 0 <= rank < size. ensures: the ranges of ranks 0..size-1 are
/// disjoint, in rank order and cover [first, last).
inline shard_range shard(std::size_t first, std::size_t last, int rank, int size) {
    LOCKSTEP_REQUIRE(size >= 1, errc::invalid_argument, rank, "shard", "size = ", size,
                     ": a batch is split over at least one replica (size is the number of "
                     "replicas, e.g. comm.size())");
    LOCKSTEP_REQUIRE(rank >= 0 && rank < size, errc::invalid_argument, rank, "shard", "rank ", rank,
                     " is not a replica of ", size, " (requires 0 <= rank < size)");
    LOCKSTEP_REQUIRE(first <= last, errc::invalid_argument, rank, "shard", "range [", first, ", ",
                     last, ") is reversed");
    const std::size_t n = last - first;
    const auto s = static_cast<std::size_t>(size);
    const auto r = static_cast<std::size_t>(rank);
    const std::size_t base = n / s;
    const std::size_t extra = n % s;
    shard_range out;
    out.begin = first + r * base + (r < extra ? r : extra);
    out.end = out.begin + base + (r < extra ? 1 : 0);
    out.global_size = n;
    out.scale = n == 0 ? 0.0 : 1.0 / static_cast<double>(n);
    return out;
}

/// Positions [global * m / count, global * (m + 1) / count) of a global batch of `global`
/// samples: micro-batch m of `count`, computed without overflow for any global (global * m
/// would overflow std::size_t from global = 2^62 and count = 4 on). requires: 1 <= count <=
/// 2^32, m < count. ensures: the ranges of m = 0..count-1 are disjoint, in order and cover
/// [0, global).
inline shard_range micro_batch(std::size_t global, std::size_t m, std::size_t count) {
    LOCKSTEP_REQUIRE(count >= 1 && m < count && count <= (std::size_t{1} << 32),
                     errc::invalid_argument, -1, "micro_batch", "micro-batch ", m, " of ", count,
                     " (requires 0 <= m < count, 1 <= count <= 2^32)");
    // global * k / count = q k + (r k) / count with global = q count + r: r k < count^2 <= 2^64.
    const std::size_t q = global / count, rem = global % count;
    const auto at = [&](std::size_t k) { return q * k + rem * k / count; };
    shard_range out;
    out.begin = at(m);
    out.end = at(m + 1);
    out.global_size = global;
    out.scale = global == 0 ? 0.0 : 1.0 / static_cast<double>(global);
    return out;
}

/// The run-wide offset of the step after one whose global batch of `global` samples starts at
/// `offset` (sample_offset + global). ensures: the sum, or throws lockstep::error
/// (errc::invalid_argument) naming the replica and both values when it would overflow the
/// 64-bit sample index (which keys per-sample random streams and must never wrap).
inline std::uint64_t next_sample_offset(std::uint64_t offset, std::size_t global, int replica) {
    std::uint64_t r = 0;
    LOCKSTEP_REQUIRE(!__builtin_add_overflow(offset, static_cast<std::uint64_t>(global), &r),
                     errc::invalid_argument, replica, "data_parallel.step", "global batch of ",
                     global, " samples after ", offset,
                     " samples overflows the 64-bit sample index (max ", UINT64_MAX, ")");
    return r;
}

/// The part of a global batch of `global_size` samples replica `rank` of `size` gets (see the
/// overload above); scale = 1 / global_size (0 for an empty global batch).
inline shard_range shard(std::size_t global_size, int rank, int size) {
    return shard(0, global_size, rank, size);
}

} // namespace lockstep

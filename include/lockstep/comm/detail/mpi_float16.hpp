// lockstep/comm/detail/mpi_float16.hpp: the exchange plan and the rank-order fold with which
// mpi_communicator reduces half and bfloat16. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <span>
#include <vector>

// MPI has neither a 16-bit float type nor a reduction with a fixed rank order (a user MPI_Op
// may be applied in any order and association). So a 16-bit reduce-scatter is an exchange,
// MPI_Ialltoallv of the raw 16-bit slices: rank r receives every rank's slice r and folds
// them itself in rank order, in float, rounding once (shm::reduce_block, as the thread group
// does). all_reduce and reduce follow it with MPI_Iallgatherv / MPI_Igatherv of the folded
// slices. Every element is folded once, by its owner, so every replica gets the same bits.
namespace lockstep::detail {

/// int counts and displacements (in elements) of the MPI_Ialltoallv and the gathers of a
/// 16-bit reduction, from per-rank counts. requires: every count and every displacement (in
/// particular size * the largest count) fits in an int; the caller checks float16_fits.
struct float16_plan {
    std::vector<int> send_counts, send_displs; ///< slice r of send goes to rank r
    std::vector<int> recv_counts, recv_displs; ///< counts[rank] from every rank, in rank order
    std::vector<int> counts, displs;           ///< the folded slices, for the gathers
    std::size_t mine = 0;                      ///< counts[rank]
};

/// Whether a 16-bit reduction over `counts` can be described with int counts and offsets.
inline bool float16_fits(std::span<const std::size_t> counts) noexcept {
    constexpr std::size_t int_max = 2147483647;
    std::size_t total = 0, largest = 0;
    for (const std::size_t c : counts) {
        if (c > int_max - total)
            return false;
        total += c;
        largest = c > largest ? c : largest;
    }
    return counts.empty() || largest <= int_max / counts.size();
}

/// The plan for `rank` of counts.size() ranks. requires: float16_fits(counts).
inline float16_plan float16_plan_of(std::span<const std::size_t> counts, int rank) {
    const std::size_t n = counts.size();
    float16_plan p;
    p.mine = counts[static_cast<std::size_t>(rank)];
    p.send_counts.resize(n);
    p.send_displs.resize(n);
    p.recv_counts.assign(n, static_cast<int>(p.mine));
    p.recv_displs.resize(n);
    std::size_t at = 0;
    for (std::size_t r = 0; r < n; ++r) {
        p.send_counts[r] = static_cast<int>(counts[r]);
        p.send_displs[r] = static_cast<int>(at);
        p.recv_displs[r] = static_cast<int>(r * p.mine);
        at += counts[r];
    }
    p.counts = p.send_counts;
    p.displs = p.send_displs;
    return p;
}

/// count elements split as evenly as possible over `ranks` (the first count % ranks get one
/// more): the slices an all_reduce or reduce folds.
inline std::vector<std::size_t> even_counts(std::size_t count, int ranks) {
    const auto n = static_cast<std::size_t>(ranks);
    std::vector<std::size_t> c(n, count / n);
    for (std::size_t r = 0; r < count % n; ++r)
        ++c[r];
    return c;
}

/// out[i] = op over j in rank order of gathered[j * mine + i], folded in float and rounded once.
template <class W>
void fold_float16(const host_system& sys, const W* gathered, int ranks, std::size_t mine, W* out,
                  reduce_op op) {
    std::vector<const W*> sources(static_cast<std::size_t>(ranks));
    for (int j = 0; j < ranks; ++j)
        sources[static_cast<std::size_t>(j)] = gathered + static_cast<std::size_t>(j) * mine;
    shm::reduce_range(sys, sources.data(), ranks, out, 0, mine, op);
}

} // namespace lockstep::detail

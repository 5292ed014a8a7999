// lockstep/comm/combine.hpp: combine_in_place, a caller's element-wise function of arrays of one
// process computed tile by tile on the host's threads and stored to every destination (the data
// pass of thread_communicator::all_combine, and of reduce::reproducible's host sums).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/shm_reduce.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>

namespace lockstep {
namespace detail {

/// Elements per tile of all_combine's pass: 16 KiB of T (at least one element).
template <class T>
inline constexpr std::size_t combine_tile = sizeof(T) >= 16384 ? 1 : 16384 / sizeof(T);

/// Task t: combine(sources, n_sources, first, m, tile) for the m <= combine_tile elements
/// [first, first + m) of [begin, end), first = begin + t * combine_tile, into a buffer on the
/// stack (distinct from every source), then stored to every destination at first. Every
/// source of a tile is read before any destination of it is written, so a destination may be
/// a source (an in-place call).
template <class T, class Combine>
struct combine_tile_fn {
    const T* const* sources;
    std::size_t n_sources;
    T* const* dsts;
    std::size_t n_dsts;
    std::size_t begin;
    std::size_t end;
    const Combine* combine;
    void operator()(std::size_t t) const {
        const std::size_t first = begin + t * combine_tile<T>;
        const std::size_t m = std::min(combine_tile<T>, end - first);
        alignas(64) T tile[combine_tile<T>];
        (*combine)(sources, n_sources, first, m, static_cast<T*>(tile));
        for (std::size_t k = 0; k < n_dsts; ++k)
            std::memcpy(dsts[k] + first, tile, m * sizeof(T));
    }
};

} // namespace detail

/// dsts[k][i] = the result of combine over sources for every i in [begin, end), each tile of
/// elements formed in a buffer on the stack by combine(sources, n, first, m, out) (the functor
/// combine_communicator's all_combine takes) and then stored to every destination, on sys's
/// threads. A destination may be one of the sources.
template <class T, class Combine>
void combine_in_place(const host_system& sys, std::span<const T* const> sources,
                      std::span<T* const> dsts, std::size_t begin, std::size_t end,
                      const Combine& combine) {
    if (end <= begin)
        return;
    const std::size_t tiles = (end - begin + detail::combine_tile<T> - 1) / detail::combine_tile<T>;
    detail::shm::for_each_tile(sys, tiles,
                               detail::combine_tile_fn<T, Combine>{sources.data(), sources.size(),
                                                                   dsts.data(), dsts.size(), begin,
                                                                   end, &combine});
}

} // namespace lockstep

// lockstep/comm/combine.hpp: combine_in_place, a caller's element-wise function of arrays of one
// process computed tile by tile on the host (the data pass of thread_communicator::all_combine).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/shm_combine.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <span>

namespace lockstep {

/// dsts[k][i] = the result of combine over sources for every i in [begin, end), each tile of
/// elements formed in a buffer on the stack by combine(sources, n, first, m, out) (the functor
/// combine_communicator's all_combine takes) and then stored to every destination, on sys's
/// threads. A destination may be one of the sources.
template <class T, class Combine>
void combine_in_place(const host_system& sys, std::span<const T* const> sources,
                      std::span<T* const> dsts, std::size_t begin, std::size_t end,
                      const Combine& combine) {
    detail::shm::combine_to_all(sys, sources.data(), sources.size(), dsts.data(), dsts.size(),
                                begin, end, combine);
}

} // namespace lockstep

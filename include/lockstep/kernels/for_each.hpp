// lockstep/kernels/for_each.hpp: for_each_index, "run f(i) for every i in [0, n) on this system",
// the one launch helper of every layer. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/system/host_system.hpp"
#include "lockstep/system/system.hpp"

#include <cstddef>
#include <limits>
#include <type_traits>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>

namespace lockstep::kernels {

/// Host passes that touch fewer elements than this run on the calling thread: an OpenMP
/// parallel region costs more than it saves there (and much more when the cores are
/// oversubscribed).
inline constexpr std::size_t host_serial_below = 32768;

/// The OpenMP threads of a host loop over `elements` elements: 1 below host_serial_below,
/// else sys.threads().
inline int threads_for(const host_system& sys, std::size_t elements) noexcept {
    return elements < host_serial_below ? 1 : sys.threads();
}

/// f(policy) with the Thrust policy for a pass over `elements` elements on sys, for the Thrust
/// algorithms (fill, copy, transform, reductions) that for_each_index does not cover: on the host
/// system, below host_serial_below elements (or with one thread), the serial CPP policy, so the
/// pass runs on the calling thread and leaves the thread's OpenMP budget (an ICV the user's own
/// OpenMP code inherits) as it was; otherwise f(sys.policy()). Returns what f returns (the same
/// type for both policies).
template <execution_system System, class F>
decltype(auto) with_policy_for(const System& sys, std::size_t elements, F&& f) {
    if constexpr (std::is_same_v<System, host_system>) {
        if (threads_for(sys, elements) == 1)
            return f(thrust::cpp::par);
    }
    return f(sys.policy());
}

/// Runs f(i) for every i in [0, n) on sys: thrust::for_each with sys.policy() (one thread per
/// index on a device). The calls must be independent of each other, so the result does not
/// depend on how they are scheduled. On the host system the calls run as a plain loop on the
/// calling thread when the system has one thread, when n <= 1, or when `elements` (a hint: the
/// elements the whole pass touches; default: many) is below host_serial_below.
template <execution_system System, class F>
void for_each_index(const System& sys, std::size_t n, F f,
                    std::size_t elements = std::numeric_limits<std::size_t>::max()) {
    if (n == 0)
        return;
    if constexpr (std::is_same_v<System, host_system>) {
        if (n == 1 || threads_for(sys, elements) == 1) {
            for (std::size_t i = 0; i < n; ++i)
                f(i);
            return;
        }
    }
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(n), f);
}

} // namespace lockstep::kernels

// lockstep/system/system.hpp: the execution_system concept (where memory lives and kernels run)
// and how kernels find a system's own fast paths. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstddef>
#include <type_traits>

namespace lockstep {

/// What every component taking a System (buffer, the kernels, the optimizers, communicators'
/// system_type, the trainers) relies on. host_system and cuda_system model it; a user type that
/// does plugs into every kernel through its generic Thrust path without editing lockstep.
/// Named execution_system, not system: `system` is the member function by which buffers,
/// optimizers and communicators return theirs, and would hide the concept inside those classes.
///
/// Semantics, for S and a value s of S:
/// - `S::is_host`: a constant expression; true iff the host may dereference S's memory (then
///   buffers offer operator[] and host loops may read the memory directly).
/// - `S::alignment`: a constant expression, a power of two; every non-null allocate() result is
///   aligned to it.
/// - `s.policy()`: the Thrust execution policy s's kernels run with (calling it may set
///   per-thread state, e.g. the OpenMP thread budget or the current CUDA device). Kernels are
///   ordered with each other in the order they are issued on s.
/// - `s.synchronize()`: returns once every kernel issued on s has finished.
/// - `s.allocate(bytes)`: memory of S for `bytes` bytes (null for 0), or throws; usable by s's
///   kernels at once. `s.deallocate(p, bytes)` frees it, never throws (runs in destructors).
/// - a copyable value: copies are interchangeable, the system is not owned (the memory and
///   streams it names are), and `a == b` iff a and b run kernels in the same order on the same
///   memory.
///
/// Kernels state their preconditions once, then call a per-system operation unqualified
/// (e.g. `bn_normalize(sys, ...)`): lockstep::kernels holds the generic Thrust version for
/// any execution_system, and argument-dependent lookup on the system's type adds the overloads
/// taking `const S&` that S's associated namespaces declare (host_system's in namespace
/// lockstep::host, associated through its base host::adl_tag, so no other lockstep type finds
/// them; cuda_system's in namespace lockstep::gpu through its base gpu::adl_tag, its copies and
/// is_capturing being hidden friends). Overload resolution prefers the exact system
/// type, so a system with no fast path runs the generic one.
template <class S>
concept execution_system = std::copyable<S> && std::equality_comparable<S> &&
    requires(const S& s, std::size_t bytes, void* p) {
    typename std::bool_constant<S::is_host>;
    typename std::integral_constant<std::size_t, S::alignment>;
    s.policy();
    s.synchronize();
    { s.allocate(bytes) } -> std::same_as<void*>;
    { s.deallocate(p, bytes) }
    noexcept;
} &&(S::alignment > 0 && (S::alignment & (S::alignment - 1)) == 0);

namespace detail {
/// True while s's work is being captured into a graph instead of run (a CUDA stream capture):
/// what the system's own `is_capturing(s)` says, found by argument-dependent lookup
/// (cuda_system has one); false for a system without one (the host system runs work at once).
template <execution_system S>
bool capturing(const S& s) {
    if constexpr (requires { is_capturing(s); })
        return static_cast<bool>(is_capturing(s));
    else
        return false;
}
} // namespace detail

} // namespace lockstep

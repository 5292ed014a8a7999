// lockstep/train/detail/parameter_loads.hpp: parameter_loads, the process-wide count of loads that
// overwrote a trainer's parameters between steps, which compute_copy keys its cast on.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <atomic>
#include <cstdint>

namespace lockstep::detail {

/// Incremented by every checkpoint load once it has written a trainer's parameters
/// (ckpt::restore). A step number alone does not identify the parameters: a load can bring a
/// trainer back to a step it already computed with other weights (another run's checkpoint), so
/// compute_copy::refresh casts again when this count changed since its last cast. Process-wide
/// (a compute_copy does not know its trainer): a load anywhere costs every copy one extra cast.
/// The thread that loads reads its own increment (relaxed order suffices for that).
inline std::atomic<std::uint64_t> parameter_loads{0};

} // namespace lockstep::detail

// lockstep/comm/mpi_unavailable.hpp: what the MPI names mean in a build without lockstep::mpi:
// constructing any of them stops compiling with a sentence naming the CMake target to link
// (other uses, such as a member, are ordinary compile errors).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if !LOCKSTEP_HAS_MPI
namespace lockstep {
namespace detail {
template <class...>
inline constexpr bool mpi_missing = false;
} // namespace detail

/// Stands for lockstep::mpi_communicator where the build has no MPI (LOCKSTEP_HAS_MPI is 0):
/// constructing it is a compile error that names the target providing the real one.
class mpi_communicator {
public:
    template <class... Args>
    explicit mpi_communicator(Args&&...) {
        static_assert(detail::mpi_missing<Args...>,
                      "lockstep::mpi_communicator needs MPI: link your target with lockstep::mpi "
                      "(find_package(lockstep CONFIG COMPONENTS mpi), then "
                      "target_link_libraries(<target> PRIVATE lockstep::mpi)), which finds MPI, "
                      "provides <mpi.h> and defines LOCKSTEP_HAS_MPI.");
    }
};

/// Stands for lockstep::mpi_environment without MPI, as mpi_communicator above.
class mpi_environment {
public:
    template <class... Args>
    explicit mpi_environment(Args&&...) {
        static_assert(detail::mpi_missing<Args...>,
                      "lockstep::mpi_environment needs MPI: link your target with lockstep::mpi "
                      "(find_package(lockstep CONFIG COMPONENTS mpi), then "
                      "target_link_libraries(<target> PRIVATE lockstep::mpi)), which finds MPI, "
                      "provides <mpi.h> and defines LOCKSTEP_HAS_MPI.");
    }
};

/// Stands for lockstep::hierarchical_group without MPI, as mpi_communicator above.
class hierarchical_group {
public:
    template <class... Args>
    explicit hierarchical_group(Args&&...) {
        static_assert(detail::mpi_missing<Args...>,
                      "lockstep::hierarchical_group needs MPI: link your target with "
                      "lockstep::mpi (find_package(lockstep CONFIG COMPONENTS mpi), then "
                      "target_link_libraries(<target> PRIVATE lockstep::mpi)), which finds MPI, "
                      "provides <mpi.h> and defines LOCKSTEP_HAS_MPI.");
    }
};
} // namespace lockstep
#endif

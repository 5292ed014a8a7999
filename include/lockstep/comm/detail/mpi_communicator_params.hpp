// lockstep/comm/detail/mpi_communicator_params.hpp: mpi_communicator_params, the runtime
// options of mpi_communicator, and mpi_failure_action. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/timeout.hpp"

#include <chrono>

namespace lockstep {

/// What an mpi_communicator does once a wait timed out or an MPI call failed inside an
/// operation (the communicator is broken either way).
enum class mpi_failure_action {
    abort,      ///< print the error to stderr and end the job (MPI_Abort on MPI_COMM_WORLD, with
                ///< status exit_status(e): 75 for a timeout, which tools/lockstep-run relaunches)
    throw_error ///< throw the error; the caller must end the job (e.g. abort(e))
};

/// Runtime options of mpi_communicator.
struct mpi_communicator_params {
    bool verify = true; ///< exchange a signature before each collective (see mpi_communicator)
    /// How long one MPI operation may wait for the peers (default: LOCKSTEP_TIMEOUT seconds
    /// when set, else 300 s). requires: > 0.
    std::chrono::milliseconds timeout = default_timeout(std::chrono::seconds(300));
    /// What happens after a timeout or an MPI failure inside an operation.
    mpi_failure_action on_failure = mpi_failure_action::abort;
    /// With verification: whether collectives without a collective_tag name compare their call
    /// sites, so two calls of the same collective and shape issued in another order (or one
    /// skipped) are an error instead of a wrong value (see collective_tag). Every replica must
    /// use the same value. Default: default_check_call_sites(), i.e. LOCKSTEP_CHECK_CALL_SITES
    /// (1 on, 0 off); unset, on in builds without NDEBUG and off with NDEBUG.
    bool check_call_sites = default_check_call_sites();
};

} // namespace lockstep

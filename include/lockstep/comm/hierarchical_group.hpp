// lockstep/comm/hierarchical_group.hpp: hierarchical_group, thread replicas inside every MPI
// process composed into one hierarchical_communicator. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/core/error.hpp"

#include <mpi.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

namespace lockstep {

/// Runtime options of hierarchical_group.
struct hierarchical_group_params {
    thread_group_params threads = {}; ///< the replica threads inside each process
    mpi_communicator_params mpi = {}; ///< each local rank's inter-process communicator
    /// A replica whose function throws (or that fails in a collective) ends the whole job with
    /// MPI_Abort after printing the error, so no process is left waiting for it (true), or
    /// run() rethrows it in this process only (false: the other processes find out when their
    /// MPI operations time out).
    bool abort_on_failure = true;
};

/// Every process of an MPI communicator runs `threads` replicas as threads; together they form
/// one group of size() = processes x threads replicas, with global rank = process rank x
/// threads + thread index. Each replica gets a hierarchical_communicator whose intra-node part
/// is a thread_communicator over its process's threads and whose inter-node part is an
/// mpi_communicator over the threads of the same index in every process:
///
///     lockstep::mpi_environment env(argc, argv, {.requested = MPI_THREAD_MULTIPLE,
///                                                .required = MPI_THREAD_MULTIPLE});
///     lockstep::hierarchical_group group(MPI_COMM_WORLD, 2);
///     group.run([&](lockstep::hierarchical_group::communicator_type& comm) { ... });
///
/// The threads of a process call MPI at the same time, each on its own communicator, so MPI
/// must provide MPI_THREAD_MULTIPLE (the constructor throws errc::unsupported otherwise).
class hierarchical_group {
public:
    using communicator_type = hierarchical_communicator<thread_communicator, mpi_communicator>;
    using params = hierarchical_group_params;

    /// Collective over comm: makes one duplicate of comm per thread index.
    /// requires: MPI initialised with MPI_THREAD_MULTIPLE; threads >= 1 and equal in every
    /// process (the first run() checks it).
    hierarchical_group(MPI_Comm comm, int threads, params p = {})
        : threads_(threads, p.threads), params_(p) {
        int level = MPI_THREAD_SINGLE;
        LOCKSTEP_MPI_CHECK(MPI_Query_thread(&level));
        LOCKSTEP_REQUIRE(level == MPI_THREAD_MULTIPLE, errc::unsupported, -1, "hierarchical_group",
                         "MPI provides thread level ", level, ", this needs MPI_THREAD_MULTIPLE (",
                         MPI_THREAD_MULTIPLE,
                         "): initialise MPI with mpi_environment(argc, argv, "
                         "{.requested = MPI_THREAD_MULTIPLE, .required = MPI_THREAD_MULTIPLE})");
        inter_.reserve(static_cast<std::size_t>(threads));
        for (int l = 0; l < threads; ++l)
            inter_.emplace_back(comm, p.mpi);
    }

    /// Replicas per process.
    int threads() const noexcept { return threads_.size(); }
    /// Processes.
    int processes() const noexcept { return inter_.empty() ? 0 : inter_.front().size(); }

    /// Calls f(comm) on threads() new threads of this process, each with its replica's
    /// communicator, and joins them. Every process calls run() with the same number of threads.
    /// ensures: returns when every replica of this process has returned; a failure of any
    /// replica ends the job (params::abort_on_failure) or is rethrown here.
    template <class F>
    requires std::invocable<F&, communicator_type&>
    void run(F&& f) {
        threads_.run([&](thread_communicator& intra) { replica_main(f, intra); });
    }

private:
    // One replica: its communicator from this thread's handle and its local rank's MPI
    // communicator, which returns to the group for the next run().
    template <class F>
    void replica_main(F& f, thread_communicator& intra) {
        const auto l = static_cast<std::size_t>(intra.rank());
        try {
            communicator_type comm(std::move(intra), std::move(inter_[l]));
            std::invoke(f, comm);
            inter_[l] = std::move(comm.inter());
        } catch (const std::exception& e) {
            if (params_.abort_on_failure && !echoes_peer(e))
                abort_job(e, static_cast<int>(l));
            throw;
        }
    }

    // A peer_failure only echoes another replica's failure: that replica aborts the job with
    // the root cause, so this one just leaves.
    static bool echoes_peer(const std::exception& e) {
        const auto* le = dynamic_cast<const lockstep::error*>(&e);
        return le != nullptr && le->code() == errc::peer_failure;
    }
    [[noreturn]] void abort_job(const std::exception& e, int thread) const {
        int rank = -1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        std::fprintf(stderr, "lockstep: hierarchical_group process %d thread %d aborting: %s\n",
                     rank, thread, e.what());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
        std::abort();
    }

    thread_group threads_;
    params params_;
    std::vector<mpi_communicator> inter_;
};

} // namespace lockstep

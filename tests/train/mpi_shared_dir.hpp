// tests/train/mpi_shared_dir.hpp: a scratch directory that every MPI rank of a checkpoint test
// uses. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/mpi_communicator.hpp"

#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace lockstep_test {

/// A directory every rank uses: rank 0's name (`tag`, its pid, a count), broadcast; created and
/// removed by rank 0, with a barrier on each side.
struct mpi_shared_dir {
    std::filesystem::path path;
    int rank = 0;
    mpi_shared_dir(lockstep::mpi_communicator& world, const std::string& tag) : rank(world.rank()) {
        int id = ::getpid();
        MPI_Bcast(&id, 1, MPI_INT, 0, MPI_COMM_WORLD);
        static int n = 0;
        path = std::filesystem::temp_directory_path() /
               (tag + std::to_string(id) + "_" + std::to_string(n++));
        if (rank == 0) {
            std::filesystem::remove_all(path);
            std::filesystem::create_directories(path);
        }
        MPI_Barrier(MPI_COMM_WORLD);
    }
    mpi_shared_dir(const mpi_shared_dir&) = delete;
    mpi_shared_dir& operator=(const mpi_shared_dir&) = delete;
    ~mpi_shared_dir() {
        MPI_Barrier(MPI_COMM_WORLD);
        std::error_code ec;
        if (rank == 0)
            std::filesystem::remove_all(path, ec);
    }
};

} // namespace lockstep_test

// examples/digits/digits_comm.hpp: the communicator a family translation unit is compiled for
// (CMake compiles each family once per communicator: DIGITS_COMMUNICATOR is
// lockstep::thread_communicator or lockstep::mpi_communicator). SPDX-License-Identifier: Apache-2.0
#pragma once

#include <lockstep/comm/thread_group.hpp>
#if LOCKSTEP_HAS_MPI
#include <lockstep/comm/mpi_communicator.hpp>
#endif

#ifndef DIGITS_COMMUNICATOR
#define DIGITS_COMMUNICATOR lockstep::thread_communicator
#endif

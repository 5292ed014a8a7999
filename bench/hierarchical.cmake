# bench_hierarchical: flat MPI all_reduce against hierarchical_communicator over the same 4
# processes (`mpiexec -n 4`), on shared memory and over a simulated 10 Gb/s inter-node link.
# SPDX-License-Identifier: Apache-2.0
if(TARGET lockstep::mpi)
  add_executable(bench_hierarchical "${CMAKE_CURRENT_LIST_DIR}/hierarchical.cpp")
  target_link_libraries(bench_hierarchical PRIVATE ${LOCKSTEP_HOST_TARGET} lockstep::mpi)
else()
  message(STATUS "bench_hierarchical: needs MPI (lockstep::mpi); not built")
endif()

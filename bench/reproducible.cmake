# bench_reproducible: reduce::reproducible<C> beside reduce::bucketed<> on ResNet-50's gradient
# list, 2 thread replicas; bench_reproducible_mpi under `mpiexec -n 2`.
# SPDX-License-Identifier: Apache-2.0
add_executable(bench_reproducible "${CMAKE_CURRENT_LIST_DIR}/reproducible.cpp")
target_link_libraries(bench_reproducible PRIVATE ${LOCKSTEP_HOST_TARGET})
if(TARGET lockstep::mpi)
  add_executable(bench_reproducible_mpi "${CMAKE_CURRENT_LIST_DIR}/reproducible.cpp")
  target_link_libraries(bench_reproducible_mpi PRIVATE ${LOCKSTEP_HOST_TARGET} lockstep::mpi)
  target_compile_definitions(bench_reproducible_mpi PRIVATE LOCKSTEP_BENCH_MPI=1)
endif()

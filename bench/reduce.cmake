# bench_reduce: every ReducePolicy vs one flat all_reduce on a ResNet-50 parameter list; thread
# group (bench_reduce [reps] [replicas]) and MPI (mpiexec -n 2 bench_reduce_mpi [reps]).
# SPDX-License-Identifier: Apache-2.0
add_executable(bench_reduce "${CMAKE_CURRENT_LIST_DIR}/reduce.cpp")
target_link_libraries(bench_reduce PRIVATE ${LOCKSTEP_HOST_TARGET})
if(TARGET lockstep::mpi)
  add_executable(bench_reduce_mpi "${CMAKE_CURRENT_LIST_DIR}/reduce.cpp")
  target_link_libraries(bench_reduce_mpi PRIVATE ${LOCKSTEP_HOST_TARGET} lockstep::mpi)
  target_compile_definitions(bench_reduce_mpi PRIVATE LOCKSTEP_BENCH_MPI=1)
endif()

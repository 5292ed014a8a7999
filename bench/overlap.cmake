# bench_overlap: ResNet-50-shaped training with overlap on/off over a simulated 10 Gb/s link and
# the thread group (plus PyTorch DDP via torch_ddp_overlap.py); bench_overlap_mpi under
# `mpiexec -n 2`. SPDX-License-Identifier: Apache-2.0
add_executable(bench_overlap "${CMAKE_CURRENT_LIST_DIR}/overlap.cpp")
target_link_libraries(bench_overlap PRIVATE ${LOCKSTEP_HOST_TARGET})
target_compile_definitions(bench_overlap PRIVATE LOCKSTEP_BENCH_DIR="${CMAKE_CURRENT_LIST_DIR}")
if(TARGET lockstep::mpi)
  add_executable(bench_overlap_mpi "${CMAKE_CURRENT_LIST_DIR}/overlap.cpp")
  target_link_libraries(bench_overlap_mpi PRIVATE ${LOCKSTEP_HOST_TARGET} lockstep::mpi)
  target_compile_definitions(bench_overlap_mpi PRIVATE LOCKSTEP_BENCH_MPI=1
                                                       LOCKSTEP_BENCH_DIR="${CMAKE_CURRENT_LIST_DIR}")
endif()

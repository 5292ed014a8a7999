# bench_allreduce: all_reduce from 4 B to 256 MiB on thread_group (beside memcpy, STREAM copy
# and the traffic bound) and, under `mpiexec -n 2`, on mpi_communicator beside raw
# MPI_Allreduce. SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_allreduce "${CMAKE_CURRENT_LIST_DIR}/allreduce.cpp" MPI_ONLY)
if(TARGET bench_allreduce)
  # Keep the STREAM copy loop a loop (GCC would call memcpy, whose non-temporal stores the
  # all_reduce cannot use).
  target_compile_options(bench_allreduce PRIVATE
    $<$<CXX_COMPILER_ID:GNU>:-fno-tree-loop-distribute-patterns>)
endif()

# bench_reduce: every ReducePolicy vs one flat all_reduce on a ResNet-50 parameter list; thread
# group (bench_reduce [reps] [replicas]) and MPI (mpiexec -n 2 bench_reduce_mpi [reps]).
# SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_reduce "${CMAKE_CURRENT_LIST_DIR}/reduce.cpp" MPI_TWIN)

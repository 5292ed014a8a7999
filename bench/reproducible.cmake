# bench_reproducible: reduce::reproducible<C> beside reduce::bucketed<> on ResNet-50's gradient
# list, 2 thread replicas; bench_reproducible_mpi under `mpiexec -n 2`.
# SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_reproducible "${CMAKE_CURRENT_LIST_DIR}/reproducible.cpp" MPI_TWIN)

# bench_bn_step: training steps of ResNet-50's 53 batch-norm layers with bn::global beside
# bn::local, 2 thread replicas; bench_bn_step_mpi under `mpiexec -n 2`.
# SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_bn_step "${CMAKE_CURRENT_LIST_DIR}/bn_step.cpp" MPI_TWIN)

# bench_overlap: ResNet-50-shaped training with overlap on/off over a simulated 10 Gb/s link and
# the thread group (plus PyTorch DDP via torch_ddp_overlap.py); bench_overlap_mpi under
# `mpiexec -n 2`. SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_overlap "${CMAKE_CURRENT_LIST_DIR}/overlap.cpp" MPI_TWIN
                   DEFINITIONS LOCKSTEP_BENCH_DIR="${CMAKE_CURRENT_LIST_DIR}")

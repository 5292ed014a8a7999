# bench_hierarchical: flat MPI all_reduce against hierarchical_communicator over the same 4
# processes (`mpiexec -n 4`), on shared memory and over a simulated 10 Gb/s inter-node link.
# SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_hierarchical "${CMAKE_CURRENT_LIST_DIR}/hierarchical.cpp" MPI_ONLY)

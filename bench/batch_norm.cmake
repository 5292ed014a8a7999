# bench_batch_norm: host batch norm against oneDNN (if found) and the STREAM-copy traffic bound.
# SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_batch_norm "${CMAKE_CURRENT_LIST_DIR}/batch_norm.cpp")
find_path(LOCKSTEP_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
find_library(LOCKSTEP_DNNL_LIBRARY dnnl)
if(LOCKSTEP_DNNL_INCLUDE_DIR AND LOCKSTEP_DNNL_LIBRARY)
  target_include_directories(bench_batch_norm PRIVATE "${LOCKSTEP_DNNL_INCLUDE_DIR}")
  target_link_libraries(bench_batch_norm PRIVATE "${LOCKSTEP_DNNL_LIBRARY}")
  target_compile_definitions(bench_batch_norm PRIVATE LOCKSTEP_BENCH_HAS_DNNL=1)
else()
  message(STATUS "bench_batch_norm: oneDNN not found; comparing with the traffic bound only")
endif()
# oneDNN generates code for this machine's ISA at run time; compile lockstep's loops for it too.
option(LOCKSTEP_BENCH_NATIVE "Compile the batch-norm benchmark with -march=native" ON)
if(LOCKSTEP_BENCH_NATIVE AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(bench_batch_norm PRIVATE -march=native)
endif()

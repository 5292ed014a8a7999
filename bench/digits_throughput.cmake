# bench/digits_throughput.cmake: `cmake --build <dir> --target bench_digits_throughput` runs
# bench/digits_throughput.sh (examples/digits with 1 and 2 replicas next to PyTorch DDP on gloo).
# SPDX-License-Identifier: Apache-2.0
if(TARGET digits)
  add_custom_target(bench_digits_throughput
    COMMAND "${CMAKE_CURRENT_LIST_DIR}/digits_throughput.sh" "$<TARGET_FILE:digits>"
    DEPENDS digits
    USES_TERMINAL VERBATIM)
endif()

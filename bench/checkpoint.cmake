# bench_checkpoint: a blocking save's stall beside a background save's snapshot stall and the
# steps during its write, on a ResNet-50-shaped network (thread group).
# SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_checkpoint "${CMAKE_CURRENT_LIST_DIR}/checkpoint.cpp")

# bench_shrink: the cost of train_params::on_replica_failure = shrink per step (its fence and its
# host copy of the step's state) beside the same trainer without it (thread group).
# SPDX-License-Identifier: Apache-2.0
lockstep_add_bench(bench_shrink "${CMAKE_CURRENT_LIST_DIR}/shrink.cpp")

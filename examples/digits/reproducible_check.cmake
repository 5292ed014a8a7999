# examples/digits/reproducible_check.cmake: the digits demo with --reduce reproducible --bn ghost
# ends with bitwise the same weights (FNV-1a hash) on every replica count, over MPI and after
# losing a thread replica with --shrink (the run must print that it lost replica 1).
# Usage: cmake -DDIGITS=<digits> -DFLOOR=<accuracy %> [-DLAUNCHER=mpiexec|-n|2]
#        -P reproducible_check.cmake   (LAUNCHER: '|'-separated command prefix of the --mpi run)
# SPDX-License-Identifier: Apache-2.0
string(REPLACE "|" ";" launcher "${LAUNCHER}")
# 2 epochs of global batch 100: 100 = 6 x 16 + 4 (a short last chunk) and 100 does not divide
# the 1438 training samples (steps straddle the epochs).
set(common --reduce reproducible --bn ghost --epochs 2 --batch 100 --quiet)

# run_digits(<label> <prefix...> -- <options...>): the run's hash in ${label}_hash; fails when
# the run fails or its test accuracy is below FLOOR; its output in ${label}_text.
function(run_digits label)
  set(prefix)
  set(opts)
  set(in_opts FALSE)
  foreach(a IN LISTS ARGN)
    if(a STREQUAL "--")
      set(in_opts TRUE)
    elseif(in_opts)
      list(APPEND opts "${a}")
    else()
      list(APPEND prefix "${a}")
    endif()
  endforeach()
  execute_process(COMMAND ${prefix} "${DIGITS}" ${common} ${opts} OUTPUT_VARIABLE text
                  ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${label}: digits ${opts} failed (${rc}):\n${text}\n${err}")
  endif()
  string(REGEX MATCH "FNV-1a ([0-9a-f]+)" _ "${text}")
  set(hash "${CMAKE_MATCH_1}")
  string(REGEX MATCH "test accuracy: ([0-9.]+)" _ "${text}")
  set(acc "${CMAKE_MATCH_1}")
  if(hash STREQUAL "" OR acc STREQUAL "")
    message(FATAL_ERROR "${label}: digits printed no weights hash or accuracy:\n${text}\n${err}")
  endif()
  if(acc LESS FLOOR)
    message(FATAL_ERROR "${label}: test accuracy ${acc} % is below ${FLOOR} %:\n${text}")
  endif()
  message(STATUS "${label}: ${hash}, test accuracy ${acc} %")
  set(${label}_hash "${hash}" PARENT_SCOPE)
  set(${label}_text "${text}" PARENT_SCOPE)
endfunction()

# check_same(<reference label> <labels...>): every run has the reference run's hash.
function(check_same ref)
  foreach(l IN LISTS ARGN)
    if(NOT "${${l}_hash}" STREQUAL "${${ref}_hash}")
      message(FATAL_ERROR "${l} ends with weights ${${l}_hash}, ${ref} with ${${ref}_hash}: "
                          "not reproducible across replica counts")
    endif()
  endforeach()
endfunction()

# SGD (the default optimizer) on 1, 2, 3 and 5 thread replicas, and over MPI.
set(sgd_runs)
foreach(n IN ITEMS 1 2 3 5)
  run_digits(sgd_${n} -- --replicas ${n})
  list(APPEND sgd_runs sgd_${n})
endforeach()
if(launcher)
  run_digits(sgd_mpi ${launcher} -- --mpi)
  list(APPEND sgd_runs sgd_mpi)
endif()
check_same(${sgd_runs})

# Replica 1 of 3 lost before step 12 (its thread ends): with --shrink the 2 others compute the
# step again and finish with the same weights.
run_digits(sgd_shrink -- --replicas 3 --shrink --lose-at 12:1)
if(NOT sgd_shrink_text MATCHES "lost replica 1:")
  message(FATAL_ERROR "sgd_shrink: no 'lost replica 1:' line, the run lost no replica:\n"
                      "${sgd_shrink_text}")
endif()
check_same(sgd_1 sgd_shrink)

# AdamW and LAMB (their updates take per-tensor norms and moments) on fewer replica counts.
run_digits(adamw_1 -- --replicas 1 --optim adamw)
run_digits(adamw_3 -- --replicas 3 --optim adamw)
check_same(adamw_1 adamw_3)
run_digits(lamb_2 -- --replicas 2 --optim lamb)
run_digits(lamb_5 -- --replicas 5 --optim lamb)
check_same(lamb_2 lamb_5)

# Different optimizers must give different weights, or the hashes prove nothing.
if(sgd_1_hash STREQUAL adamw_1_hash OR adamw_1_hash STREQUAL lamb_2_hash)
  message(FATAL_ERROR "different optimizers ended with the same weights hash")
endif()

# examples/digits/resume_check.cmake: the digits demo stopped after STOP steps with --save and
# continued in a new process with --resume ends with bitwise the weights (FNV-1a hash), last loss
# and test accuracy of the uninterrupted run. RESUME_ARGS are added to the resumed run's options
# (e.g. "--replicas 3": a checkpoint saved by another replica count); with FLOOR the resumed run
# must instead reach at least FLOOR % test accuracy and end unlike the interrupted run (for
# policies whose results depend on the replica count). Either way the checkpoint resumed with
# --steps STOP (no step to run) must print the interrupted run's weights hash and test accuracy,
# which a resume that loads nothing does not, and --steps STOP-1 must be refused.
# Usage: cmake -DDIGITS=<digits> -DWORK=<dir> "-DARGS=<digits options>" -DSTOP=<n>
#        ["-DRESUME_ARGS=<options>"] [-DFLOOR=<percent>] [-DLAUNCHER=mpiexec|-n|2]
#        -P resume_check.cmake   (LAUNCHER: '|'-separated command prefix)
# SPDX-License-Identifier: Apache-2.0
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
separate_arguments(args UNIX_COMMAND "${ARGS}")
string(REPLACE "|" ";" launcher "${LAUNCHER}")

function(run_digits out)
  execute_process(COMMAND ${launcher} "${DIGITS}" ${args} --quiet ${ARGN} OUTPUT_VARIABLE text
                  ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "digits ${ARGS} ${ARGN} failed (${rc}):\n${text}\n${err}")
  endif()
  message(STATUS "digits ${ARGS} ${ARGN}:\n${text}")
  string(REGEX MATCH "FNV-1a ([0-9a-f]+)" _ "${text}")
  set(hash "${CMAKE_MATCH_1}")
  string(REGEX MATCH "last loss ([0-9.]+)" _ "${text}")
  set(loss "${CMAKE_MATCH_1}")
  if(text MATCHES "train: no step to run")
    set(loss none) # the run made no step: it prints no loss
  endif()
  string(REGEX MATCH "test accuracy: ([0-9.]+)" _ "${text}")
  set(acc "${CMAKE_MATCH_1}")
  if(hash STREQUAL "" OR loss STREQUAL "" OR acc STREQUAL "")
    message(FATAL_ERROR "digits printed no weights hash, loss or accuracy:\n${text}")
  endif()
  set(${out} "${hash} loss ${loss} accuracy ${acc}" PARENT_SCOPE)
  set(${out}_weights "${hash} accuracy ${acc}" PARENT_SCOPE)
  set(${out}_text "${text}" PARENT_SCOPE)
endfunction()

run_digits(full)
run_digits(first --steps ${STOP} --save "${WORK}/digits.ckpt")
separate_arguments(resume_args UNIX_COMMAND "${RESUME_ARGS}")
run_digits(resumed --resume "${WORK}/digits.ckpt" ${resume_args})
if(DEFINED FLOOR)
  string(REGEX MATCH "accuracy ([0-9.]+)" _ "${resumed}")
  if(CMAKE_MATCH_1 LESS FLOOR OR resumed STREQUAL first)
    message(FATAL_ERROR "resumed run: ${resumed} (at least ${FLOOR} % accuracy expected, and "
                        "not the interrupted run's ${first})")
  endif()
elseif(NOT resumed STREQUAL full)
  message(FATAL_ERROR "resumed run: ${resumed}\nuninterrupted run: ${full}")
endif()
# Resumed with --steps STOP, the run has no step to run and ends with the checkpoint's weights:
# the interrupted run's hash and accuracy (at another replica count too: loading restores the
# parameters bit for bit). A resume that loaded nothing would train STOP steps from the start.
run_digits(reloaded --resume "${WORK}/digits.ckpt" ${resume_args} --steps ${STOP})
if(NOT reloaded_text MATCHES "no step to run \\(resumed after step ${STOP}\\)"
   OR NOT reloaded_weights STREQUAL first_weights)
  message(FATAL_ERROR "resumed with --steps ${STOP}: ${reloaded_weights} (the interrupted run's "
                      "${first_weights} after no step to run expected):\n${reloaded_text}")
endif()
# --steps below the checkpoint's step is refused, naming both. Under mpiexec every rank refuses
# it and ends the job with MPI_Abort, which can tear the job down before Hydra forwards the
# message (as test_mpi_abort notes): there an empty stderr with a failed status passes too.
math(EXPR below "${STOP} - 1")
execute_process(COMMAND ${launcher} "${DIGITS}" ${args} --quiet --resume "${WORK}/digits.ckpt"
                        ${resume_args} --steps ${below}
                OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
set(refused FALSE)
if(err MATCHES "--steps ${below} is below the checkpoint's step ${STOP}")
  set(refused TRUE)
elseif(launcher AND NOT err MATCHES "[^ \t\r\n]")
  set(refused TRUE)
endif()
if(rc EQUAL 0 OR NOT refused)
  message(FATAL_ERROR "resumed with --steps ${below} (${rc}): not refused as below the "
                      "checkpoint's step ${STOP}:\n${text}\n${err}")
endif()
# The interrupted run must not already be the final one, or the comparison proves nothing.
if(first STREQUAL full)
  message(FATAL_ERROR "the run stopped after ${STOP} steps already ends like the full run")
endif()
file(REMOVE_RECURSE "${WORK}")

# examples/digits/relaunch_check.cmake: tools/lockstep-run runs the digits demo over 3 MPI
# processes with --reduce reproducible --bn ghost, a checkpoint every 5 steps, and replica 1
# SIGKILLed before step 12 of the first launch; the launcher relaunches 2 processes, which resume
# from the checkpoint of step 10 and end with bitwise the weights (FNV-1a hash) of an undisturbed
# run (3 thread replicas: the policy's weights do not depend on the replica count).
# Usage: cmake -DDIGITS=<digits> -DPYTHON=<python3> -DRUN=<tools/lockstep-run>
#        -DMPIEXEC=<mpiexec> -DWORK=<dir> -P relaunch_check.cmake
# SPDX-License-Identifier: Apache-2.0
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(common --reduce reproducible --bn ghost --optim adamw --epochs 2 --batch 100 --quiet)

execute_process(COMMAND "${DIGITS}" ${common} --replicas 3 OUTPUT_VARIABLE text
                ERROR_VARIABLE err RESULT_VARIABLE rc)
string(REGEX MATCH "FNV-1a ([0-9a-f]+)" _ "${text}")
set(undisturbed "${CMAKE_MATCH_1}")
if(NOT rc EQUAL 0 OR undisturbed STREQUAL "")
  message(FATAL_ERROR "the undisturbed run failed (${rc}) or printed no hash:\n${text}\n${err}")
endif()

execute_process(COMMAND "${PYTHON}" "${RUN}" -n 3 --min 2 --max-restarts 2 --backoff 0.1
                        --mpiexec "${MPIEXEC}" -- "${DIGITS}" --mpi ${common}
                        --checkpoint "${WORK}/digits.ckpt" --checkpoint-every 5 --kill-at 12:1
                OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
message(STATUS "lockstep-run:\n${text}\n${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "lockstep-run failed (${rc})")
endif()
foreach(expected "launch 0 lost rank 1 \\(SIGKILL\\)" "launch 1 succeeded with 2 rank\\(s\\)")
  if(NOT err MATCHES "${expected}")
    message(FATAL_ERROR "lockstep-run's log lacks '${expected}'")
  endif()
endforeach()
# The relaunch resumed from step 10 (19 of 29 steps, 1900 samples), not from the start.
if(NOT text MATCHES "2 replicas \\(MPI processes\\)" OR NOT text MATCHES " 1900 samples ")
  message(FATAL_ERROR "the relaunched job did not resume 2 processes from step 10")
endif()
string(REGEX MATCH "FNV-1a ([0-9a-f]+)" _ "${text}")
if(NOT CMAKE_MATCH_1 STREQUAL undisturbed)
  message(FATAL_ERROR "the relaunched job ends with weights ${CMAKE_MATCH_1}, the undisturbed "
                      "run with ${undisturbed}")
endif()
file(REMOVE_RECURSE "${WORK}")

# examples/digits/relaunch_check.cmake: tools/lockstep-run runs the digits demo over 3 MPI
# processes with --reduce reproducible --bn ghost, a checkpoint every 5 steps, and replica 1
# SIGKILLed (then: hung; then: SIGKILLed with the saves in the background) before step 12 of the
# first launch; the launcher relaunches 2 (then: 3; then: 2) processes, which resume from the
# newest committed checkpoint (step 10's; in the background, step 10's or 5's) and end with
# bitwise the weights (FNV-1a hash) of an undisturbed run (3 thread replicas: the policy's weights
# do not depend on the replica count).
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

# relaunch(<options> <ranks of the relaunch> <samples> <expected log lines...>): the job under
# lockstep-run with the fault (and options), relaunched with <ranks> processes that resume from
# the newest committed checkpoint (<samples>: a regex of the samples the relaunch trains; 1900:
# 19 of 29 steps, from step 10) and end with the undisturbed weights.
function(relaunch fault ranks samples)
  file(REMOVE_RECURSE "${WORK}/digits.ckpt")
  execute_process(COMMAND "${PYTHON}" "${RUN}" -n 3 --min 2 --max-restarts 2 --backoff 0.1
                          --mpiexec "${MPIEXEC}" -- "${DIGITS}" --mpi ${common}
                          --checkpoint "${WORK}/digits.ckpt" --checkpoint-every 5 ${fault}
                  OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
  message(STATUS "lockstep-run ... ${fault}:\n${text}\n${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "lockstep-run ... ${fault} failed (${rc})")
  endif()
  foreach(expected IN LISTS ARGN)
    if(NOT err MATCHES "${expected}")
      message(FATAL_ERROR "lockstep-run ... ${fault}: its log lacks '${expected}'")
    endif()
  endforeach()
  if(NOT text MATCHES "${ranks} replicas \\(MPI processes\\)" OR
     NOT text MATCHES " ${samples} samples ")
    message(FATAL_ERROR "${fault}: the relaunched job did not resume ${ranks} processes "
                        "training ${samples} samples")
  endif()
  string(REGEX MATCH "FNV-1a ([0-9a-f]+)" _ "${text}")
  if(NOT CMAKE_MATCH_1 STREQUAL undisturbed)
    message(FATAL_ERROR "${fault}: the relaunched job ends with weights ${CMAKE_MATCH_1}, the "
                        "undisturbed run with ${undisturbed}")
  endif()
endfunction()

# Replica 1 SIGKILLed before step 12: lost, the job relaunched on the 2 survivors.
relaunch("--kill-at;12:1" 2 1900 "launch 0 lost rank 1 \\(SIGKILL\\)"
         "launch 1 succeeded with 2 rank\\(s\\)")
# Replica 1 hung before step 12: the others time out (LOCKSTEP_TIMEOUT=2) and end the job with
# status 75 (lockstep::exit_status), which lockstep-run relaunches with as many processes.
set(ENV{LOCKSTEP_TIMEOUT} 2)
relaunch("--stall-at;12:1" 3 1900 "launch 0 ended with status 75"
         "launch 1 succeeded with 3 rank\\(s\\)")
# The same SIGKILL with the saves in the background (--checkpoint-async): the relaunch resumes
# from the newest committed one (step 10's once a step before 12 reported its commit, else step
# 5's: 2400 samples) and still ends with the undisturbed weights.
unset(ENV{LOCKSTEP_TIMEOUT})
relaunch("--kill-at;12:1;--checkpoint-async" 2 "(1900|2400)" "launch 0 lost rank 1 \\(SIGKILL\\)"
         "launch 1 succeeded with 2 rank\\(s\\)")
file(REMOVE_RECURSE "${WORK}")

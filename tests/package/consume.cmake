# consume.cmake: one package test step, run as `cmake -P` from CTest (tests/package).
#   STEP=install      cmake --install LOCKSTEP_BINARY_DIR into a fresh PREFIX
#   STEP=consume      configure, build and run the consumer project CONSUMER_DIR (consumer/ or
#                     cuda_consumer/; its program is named consumer) in a fresh WORK_DIR
#                     (MODE package|subdirectory|fetchcontent); with EXPECT_ERROR=<regex> the
#                     configure step must fail with a message matching it instead. A program
#                     that exits with 77 (it could not run here) makes the step a skip: exit 77
#                     (CMake 3.29 or newer) and a line "lockstep package test skipped: ...".
# SPDX-License-Identifier: Apache-2.0
cmake_minimum_required(VERSION 3.24)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(step_rc "${rc}" PARENT_SCOPE)
  set(step_log "${out}${err}" PARENT_SCOPE)
  message("---- ${what}: exit ${rc}\n${out}${err}")
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  run_step("install" "${CMAKE_COMMAND}" --install "${LOCKSTEP_BINARY_DIR}" --prefix "${PREFIX}")
  if(NOT step_rc EQUAL 0)
    message(FATAL_ERROR "cmake --install failed")
  endif()
  foreach(f include/lockstep/core/config.hpp share/cmake/lockstep/lockstepConfig.cmake
            share/cmake/lockstep/lockstepConfigVersion.cmake
            share/cmake/lockstep/lockstep-targets.cmake
            share/cmake/lockstep/lockstep-cccl.cmake)
    if(NOT EXISTS "${PREFIX}/${f}")
      message(FATAL_ERROR "the install lacks ${f}")
    endif()
  endforeach()
  return()
endif()

# Lists arrive comma-separated (a ';' would split the -D argument on CTest's command line).
set(COMPONENTS_CSV "${COMPONENTS}")
string(REPLACE "," ";" COMPONENTS "${COMPONENTS}")
string(REPLACE "," ";" EXTRA_ARGS "${EXTRA_ARGS}")
file(REMOVE_RECURSE "${WORK_DIR}")
# Without CXX_COMPILER the consumer gets the machine's default compilers (the CUDA consumers).
set(compiler "")
if(CXX_COMPILER)
  set(compiler "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
set(configure "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}" -G "${GENERATOR}"
    ${compiler} -DCMAKE_BUILD_TYPE=Release
    "-DLOCKSTEP_CONSUME=${MODE}" "-DLOCKSTEP_SOURCE_DIR=${LOCKSTEP_SOURCE_DIR}"
    "-DCONSUMER_COMPONENTS=${COMPONENTS_CSV}" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
    ${EXTRA_ARGS})
if(MODE STREQUAL "package")
  # Only the fresh install may satisfy find_package, never the source or build tree.
  list(APPEND configure "-DCMAKE_PREFIX_PATH=${PREFIX}")
endif()
run_step("configure (${MODE}, components ${COMPONENTS})" ${configure})

if(DEFINED EXPECT_ERROR)
  if(step_rc EQUAL 0)
    message(FATAL_ERROR "configure succeeded but should have failed with: ${EXPECT_ERROR}")
  endif()
  # CMake wraps long messages: compare with all whitespace runs folded to one space.
  string(REGEX REPLACE "[ \t\r\n]+" " " flat_log "${step_log}")
  if(NOT flat_log MATCHES "${EXPECT_ERROR}")
    message(FATAL_ERROR "configure failed, but without the expected message: ${EXPECT_ERROR}")
  endif()
  message("configure failed as expected (${EXPECT_ERROR})")
  return()
endif()
if(NOT step_rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer failed")
endif()
if(MODE STREQUAL "package")
  file(STRINGS "${WORK_DIR}/CMakeCache.txt" found_dir REGEX "^lockstep_DIR:")
  file(REAL_PATH "${PREFIX}" real_prefix)
  string(FIND "${found_dir}" "${real_prefix}/" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "find_package found lockstep outside the install prefix: ${found_dir}")
  endif()
endif()

run_step("build" "${CMAKE_COMMAND}" --build "${WORK_DIR}" --parallel 2)
if(NOT step_rc EQUAL 0)
  message(FATAL_ERROR "building the consumer failed")
endif()

run_step("run consumer" "${WORK_DIR}/consumer")
if(step_rc EQUAL 77)
  # Built and linked, but it could not run here (the CUDA consumer without a device): skipped,
  # never passed. `cmake -P` can exit with 77 from CMake 3.29 on; before, the test's
  # SKIP_REGULAR_EXPRESSION (tests/package/CMakeLists.txt) matches this line.
  message("lockstep package test skipped: the consumer program exited with 77 (not run here)")
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.29)
    cmake_language(EXIT 77)
  endif()
  return()
endif()
if(NOT step_rc EQUAL 0)
  message(FATAL_ERROR "the consumer program failed")
endif()
if(COMPONENTS MATCHES "mpi")
  run_step("run consumer_mpi on 2 ranks" "${MPIEXEC}" -n 2 "${WORK_DIR}/consumer_mpi")
  if(NOT step_rc EQUAL 0)
    message(FATAL_ERROR "the MPI consumer program failed")
  endif()
endif()

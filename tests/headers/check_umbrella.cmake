# check_umbrella.cmake: fails when a public header of include/lockstep (any .hpp or .cuh outside
# detail/) is not included by the umbrella header lockstep/lockstep.hpp, so a new header cannot
# be forgotten there. Usage: cmake -DLOCKSTEP_INCLUDE_DIR=<dir> -P check_umbrella.cmake
# SPDX-License-Identifier: Apache-2.0
cmake_minimum_required(VERSION 3.25)

file(GLOB_RECURSE headers RELATIVE "${LOCKSTEP_INCLUDE_DIR}"
     "${LOCKSTEP_INCLUDE_DIR}/lockstep/*.hpp" "${LOCKSTEP_INCLUDE_DIR}/lockstep/*.cuh")
list(FILTER headers EXCLUDE REGEX "/detail/")
list(REMOVE_ITEM headers "lockstep/lockstep.hpp")
list(LENGTH headers n)
if(n EQUAL 0)
  message(FATAL_ERROR "no public headers under ${LOCKSTEP_INCLUDE_DIR}/lockstep (pass an absolute path)")
endif()
file(STRINGS "${LOCKSTEP_INCLUDE_DIR}/lockstep/lockstep.hpp" lines
     REGEX "^#include \"lockstep/[^\"]+\"$")
set(included)
foreach(line IN LISTS lines)
  string(REGEX REPLACE "^#include \"([^\"]+)\"$" "\\1" h "${line}")
  list(APPEND included "${h}")
endforeach()
set(missing "")
foreach(h IN LISTS headers)
  if(NOT h IN_LIST included)
    string(APPEND missing "  ${h}\n")
  endif()
endforeach()
if(NOT missing STREQUAL "")
  message(FATAL_ERROR "lockstep/lockstep.hpp does not include these public headers (add them, "
                      "guarded by the backend's LOCKSTEP_HAS_* macro where they need one):\n"
                      "${missing}")
endif()
message(STATUS "umbrella: all ${n} public headers included by lockstep/lockstep.hpp")

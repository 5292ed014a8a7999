# check_layers.cmake: fails when a header of include/lockstep includes a header of a HIGHER layer
# (DESIGN.md: arrows point down) or of a peer layer it must not know (kernels/ <-> comm/).
# Usage: cmake -DLOCKSTEP_INCLUDE_DIR=<dir> -P check_layers.cmake
# SPDX-License-Identifier: Apache-2.0

# The rank of each layer folder; a header may include its own layer and lower ranks only.
set(rank_core 0)
set(rank_system 1)
set(rank_kernels 2)
set(rank_comm 2)
set(rank_policy 3)
set(rank_nn 4)
set(rank_optim 4)
set(rank_train 5)

file(GLOB_RECURSE headers RELATIVE "${LOCKSTEP_INCLUDE_DIR}/lockstep"
     "${LOCKSTEP_INCLUDE_DIR}/lockstep/*.hpp" "${LOCKSTEP_INCLUDE_DIR}/lockstep/*.cuh")
set(violations "")
set(checked 0)
foreach(h IN LISTS headers)
  string(REGEX MATCH "^[^/]+" from "${h}")
  if(h STREQUAL "lockstep.hpp")
    continue() # the umbrella header includes everything by design
  endif()
  if(NOT DEFINED rank_${from})
    string(APPEND violations "  ${h}: folder '${from}' is not a layer of DESIGN.md\n")
    continue()
  endif()
  file(STRINGS "${LOCKSTEP_INCLUDE_DIR}/lockstep/${h}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]lockstep/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE ".*[\"<]lockstep/([^/\">]+)/.*" "\\1" to "${line}")
    math(EXPR checked "${checked} + 1")
    if(NOT DEFINED rank_${to})
      string(APPEND violations "  ${h}: includes '${to}/', which is not a layer\n")
    elseif(rank_${to} GREATER rank_${from})
      string(APPEND violations "  ${h} (layer ${from}) includes ${to}/ (a higher layer)\n")
    elseif(rank_${to} EQUAL rank_${from} AND NOT to STREQUAL from)
      string(APPEND violations "  ${h} (layer ${from}) includes its peer layer ${to}/\n")
    endif()
  endforeach()
endforeach()
list(LENGTH headers n)
if(NOT violations STREQUAL "")
  message(FATAL_ERROR "layering violations (arrows must point down):\n${violations}")
endif()
message(STATUS "layering: ${n} headers, ${checked} lockstep includes, all point down")

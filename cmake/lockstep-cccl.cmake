# lockstep-cccl.cmake: finds CCCL 3 (Thrust, CUB, libcu++), whose headers are all the host build
# needs, and the CUDA toolkit when one exists. Used by lockstep-targets.cmake and scripts/deps.
# Input: LOCKSTEP_CCCL_HINTS (optional CCCL CMake package folders, searched after the toolkit).
# Output: CCCL_FOUND, CCCL_DIR, CCCL_VERSION; CUDAToolkit_FOUND.
# SPDX-License-Identifier: Apache-2.0

# The first CCCL CMake package found wins, in this order:
#   1. CCCL_DIR, CCCL_ROOT or CMAKE_PREFIX_PATH: a CCCL the user names (find_package's own order);
#   2. the CUDA toolkit's copy (FindCUDAToolkit: CUDAToolkit_ROOT, CUDA_PATH, nvcc on PATH,
#      /usr/local/cuda);
#   3. LOCKSTEP_CCCL_HINTS: the nvidia-cuda-cccl wheel scripts/deps unpacks into .deps/ of the
#      source tree and, in an installed lockstepConfig.cmake, the CCCL lockstep was built with.
# CCCL 3.0 is the oldest version lockstep is tested with; CCCL's version file accepts 3.x only.
set(CCCL_ENABLE_DEFAULT_THRUST_TARGET OFF CACHE BOOL "lockstep passes explicit Thrust policies")
find_package(CUDAToolkit QUIET)
set(_lockstep_cccl_hints)
if(CUDAToolkit_FOUND)
  list(APPEND _lockstep_cccl_hints "${CUDAToolkit_LIBRARY_DIR}/cmake"
       "${CUDAToolkit_TARGET_DIR}/lib/cmake" "${CUDAToolkit_TARGET_DIR}/lib64/cmake")
endif()
list(APPEND _lockstep_cccl_hints ${LOCKSTEP_CCCL_HINTS})
find_package(CCCL 3.0 CONFIG QUIET HINTS ${_lockstep_cccl_hints})
unset(_lockstep_cccl_hints)

# What to tell a user whose machine has no CCCL (scripts/deps prints it too).
set(LOCKSTEP_CCCL_NOT_FOUND_MESSAGE
    "lockstep needs CCCL 3 (Thrust, CUB and libcu++ headers) and found none. Either install the "
    "CUDA toolkit (13.x ships CCCL 3), or point CCCL_DIR at a CCCL 3 CMake package (the folder "
    "holding cccl-config.cmake), or run `bash scripts/deps` in lockstep's source tree: without a "
    "toolkit it unpacks the nvidia-cuda-cccl wheel from PyPI (headers only) into .deps/.")
string(JOIN "" LOCKSTEP_CCCL_NOT_FOUND_MESSAGE ${LOCKSTEP_CCCL_NOT_FOUND_MESSAGE})

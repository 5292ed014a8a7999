# lockstep-targets.cmake: defines lockstep::lockstep and its backend components. Used by the
# source tree and by the installed lockstepConfig.cmake alike, so both define the same targets.
# Input: LOCKSTEP_INCLUDE_DIR, LOCKSTEP_CCCL_HINTS (lockstep-cccl.cmake). Output: no target when
# CCCL_FOUND is false, else LOCKSTEP_<comp>_FOUND for openmp, cuda, nccl, mpi.
# SPDX-License-Identifier: Apache-2.0

if(TARGET lockstep::lockstep)
  return()
endif()

# CCCL's headers (from the CUDA toolkit, a CCCL package or the nvidia-cuda-cccl wheel) are all
# the host build needs; lockstep-cccl.cmake says where they are looked for.
include("${CMAKE_CURRENT_LIST_DIR}/lockstep-cccl.cmake")
if(NOT CCCL_FOUND)
  # The caller (CMakeLists.txt or lockstepConfig.cmake) reports LOCKSTEP_CCCL_NOT_FOUND_MESSAGE.
  return()
endif()
find_package(Threads REQUIRED)

add_library(lockstep::lockstep INTERFACE IMPORTED GLOBAL)
target_include_directories(lockstep::lockstep INTERFACE "${LOCKSTEP_INCLUDE_DIR}")
target_compile_features(lockstep::lockstep INTERFACE cxx_std_20)
target_link_libraries(lockstep::lockstep INTERFACE Thrust::Thrust CCCL::libcudacxx Threads::Threads)

# openmp: the host system on Thrust's OpenMP backend (without it: the serial CPP backend).
find_package(OpenMP QUIET COMPONENTS CXX)
set(LOCKSTEP_openmp_FOUND FALSE)
if(OpenMP_CXX_FOUND)
  add_library(lockstep::openmp INTERFACE IMPORTED GLOBAL)
  target_link_libraries(lockstep::openmp INTERFACE lockstep::lockstep OpenMP::OpenMP_CXX)
  target_compile_definitions(lockstep::openmp INTERFACE LOCKSTEP_HAS_OPENMP=1)
  # nvcc compiles host code with the host compiler, which needs the OpenMP flag too, or Thrust's
  # OpenMP system refuses to compile in .cu files (OpenMP::OpenMP_CXX carries it for C++ only).
  # That compiler need not be the C++ one (nvcc's default is GCC, whatever CMAKE_CXX_COMPILER
  # says): Clang's -fopenmp=libomp becomes the plain -fopenmp that GCC and Clang both take.
  # GCC's objects then call the GNU entry points, which LLVM's runtime provides too.
  foreach(_lockstep_flag IN LISTS OpenMP_CXX_FLAGS)
    string(REGEX REPLACE "^-fopenmp=.*$" "-fopenmp" _lockstep_flag "${_lockstep_flag}")
    target_compile_options(lockstep::openmp INTERFACE
      "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${_lockstep_flag}>")
  endforeach()
  set(LOCKSTEP_openmp_FOUND TRUE)
endif()

# cuda: the CUDA system (device memory, Thrust CUDA on a stream, CUB fast paths). Translation
# units that use it are compiled by nvcc; the host build never needs it.
set(LOCKSTEP_cuda_FOUND FALSE)
if(CUDAToolkit_FOUND)
  add_library(lockstep::cuda INTERFACE IMPORTED GLOBAL)
  target_link_libraries(lockstep::cuda INTERFACE lockstep::lockstep CCCL::CUB CUDA::cudart)
  target_compile_options(lockstep::cuda INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  # lockstep is C++20 in .cu files too, whether the consumer enables CUDA before or after
  # find_package and whatever CMAKE_CUDA_STANDARD it sets. CMake >= 3.26 knows nvcc's C++20
  # (cuda_std_20 raises a lower CUDA_STANDARD); older CMake has no CUDA20 flag for nvcc, so the
  # flag itself is passed. It comes after CMake's own -std, and nvcc keeps the last -std (with
  # a warning when a target asked for another standard).
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.26)
    target_compile_features(lockstep::cuda INTERFACE cuda_std_20)
  else()
    target_compile_options(lockstep::cuda INTERFACE $<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-std=c++20>)
  endif()
  set(LOCKSTEP_cuda_FOUND TRUE)
endif()

# nccl: NCCL ships without a CMake config; look beside the CUDA toolkit and in the usual places.
set(LOCKSTEP_nccl_FOUND FALSE)
if(CUDAToolkit_FOUND)
  find_path(LOCKSTEP_NCCL_INCLUDE_DIR nccl.h
    HINTS ${NCCL_ROOT} ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(LOCKSTEP_NCCL_LIBRARY nccl
    HINTS ${NCCL_ROOT} ENV NCCL_ROOT ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  # 2.26 orders the kernels of two communicators of one GPU (NCCL_LAUNCH_ORDER_IMPLICIT), which
  # a replica's communicator and its comm_stream's split need to be free of deadlock.
  set(_lockstep_nccl_new_enough FALSE)
  if(LOCKSTEP_NCCL_INCLUDE_DIR)
    file(STRINGS "${LOCKSTEP_NCCL_INCLUDE_DIR}/nccl.h" _lockstep_nccl_defines
      REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
    foreach(_part MAJOR MINOR PATCH)
      string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _ "${_lockstep_nccl_defines}")
      set(_lockstep_nccl_${_part} "${CMAKE_MATCH_1}")
    endforeach()
    set(_lockstep_nccl_version "${_lockstep_nccl_MAJOR}.${_lockstep_nccl_MINOR}.${_lockstep_nccl_PATCH}")
    if(_lockstep_nccl_version VERSION_GREATER_EQUAL 2.26)
      set(_lockstep_nccl_new_enough TRUE)
    else()
      message(WARNING "lockstep: NCCL ${_lockstep_nccl_version} (${LOCKSTEP_NCCL_INCLUDE_DIR}/nccl.h) "
        "is older than 2.26, which lockstep::nccl needs (NCCL_LAUNCH_ORDER_IMPLICIT); the nccl "
        "component is not available. Point NCCL_ROOT at NCCL 2.26 or newer.")
    endif()
  endif()
  if(_lockstep_nccl_new_enough AND LOCKSTEP_NCCL_LIBRARY)
    add_library(lockstep::nccl INTERFACE IMPORTED GLOBAL)
    target_include_directories(lockstep::nccl INTERFACE "${LOCKSTEP_NCCL_INCLUDE_DIR}")
    # dl: ncclCommRevoke and ncclCommShrink are looked up at run time (comm/detail/nccl_shrink.hpp).
    target_link_libraries(lockstep::nccl INTERFACE lockstep::cuda "${LOCKSTEP_NCCL_LIBRARY}"
                                                   ${CMAKE_DL_LIBS})
    target_compile_definitions(lockstep::nccl INTERFACE LOCKSTEP_HAS_NCCL=1)
    set(LOCKSTEP_nccl_FOUND TRUE)
  endif()
endif()

# mpi: one replica per process across nodes (MPICH or Open MPI).
find_package(MPI QUIET COMPONENTS CXX)
set(LOCKSTEP_mpi_FOUND FALSE)
if(MPI_CXX_FOUND)
  add_library(lockstep::mpi INTERFACE IMPORTED GLOBAL)
  target_link_libraries(lockstep::mpi INTERFACE lockstep::lockstep MPI::MPI_CXX)
  target_compile_definitions(lockstep::mpi INTERFACE LOCKSTEP_HAS_MPI=1)
  set(LOCKSTEP_mpi_FOUND TRUE)
endif()

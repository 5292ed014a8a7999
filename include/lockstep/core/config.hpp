// lockstep/core/config.hpp: compile-time configuration, host/device macro, feature detection.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#define LOCKSTEP_VERSION_MAJOR 0
#define LOCKSTEP_VERSION_MINOR 1
#define LOCKSTEP_VERSION_PATCH 0
/// Version as one integer: major * 10000 + minor * 100 + patch.
#define LOCKSTEP_VERSION                                                                           \
    (LOCKSTEP_VERSION_MAJOR * 10000 + LOCKSTEP_VERSION_MINOR * 100 + LOCKSTEP_VERSION_PATCH)

// The headers compile with the user's flags. -ffast-math (GCC, Clang: __FAST_MATH__) and GCC's
// -fassociative-math (__ASSOCIATIVE_MATH__) let the compiler reorder float sums that lockstep
// performs in a stated order (the thread group's rank-order folds, for one), so such a build
// stops here unless the user defines LOCKSTEP_ALLOW_FAST_MATH (docs/faq.md says what then holds).
#if (defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__)) && !defined(LOCKSTEP_ALLOW_FAST_MATH)
#error "lockstep: -ffast-math (or -fassociative-math) lets the compiler reorder the float sums \
lockstep promises in a stated order; compile the files that include lockstep without it \
(-fno-fast-math; GCC: also -fno-associative-math), or define LOCKSTEP_ALLOW_FAST_MATH to accept \
sums in an order the compiler picks (docs/faq.md)"
#endif

// Functions that run on both the host and the device (the shared arithmetic functors).
#if defined(__CUDACC__) || defined(__HIPCC__)
#define LOCKSTEP_HOST_DEVICE __host__ __device__
#define LOCKSTEP_DEVICE_COMPILER 1
#else
#define LOCKSTEP_HOST_DEVICE
#define LOCKSTEP_DEVICE_COMPILER 0
#endif

// LOCKSTEP_HAS_CUDA: the CUDA system is usable (nvcc compiles this translation unit). The build
// may force it to 0 with -DLOCKSTEP_HAS_CUDA=0.
#ifndef LOCKSTEP_HAS_CUDA
#if defined(__CUDACC__)
#define LOCKSTEP_HAS_CUDA 1
#else
#define LOCKSTEP_HAS_CUDA 0
#endif
#endif

// LOCKSTEP_HAS_NCCL / LOCKSTEP_HAS_MPI are set by the CMake component targets (lockstep::nccl,
// lockstep::mpi); a user without CMake defines them next to the include paths.
#ifndef LOCKSTEP_HAS_NCCL
#define LOCKSTEP_HAS_NCCL 0
#endif
#if LOCKSTEP_HAS_NCCL && !LOCKSTEP_HAS_CUDA
#error "LOCKSTEP_HAS_NCCL needs the CUDA system: compile this translation unit with nvcc."
#endif
#ifndef LOCKSTEP_HAS_MPI
#define LOCKSTEP_HAS_MPI 0
#endif

// LOCKSTEP_HAS_OPENMP: the host system runs Thrust's OpenMP backend (else the serial CPP one).
#ifndef LOCKSTEP_HAS_OPENMP
#if defined(_OPENMP)
#define LOCKSTEP_HAS_OPENMP 1
#else
#define LOCKSTEP_HAS_OPENMP 0
#endif
#endif

// Thrust's default device system matters only for code that does not pass an execution policy
// (lockstep always passes one). In a host-only translation unit it must not be CUDA.
#if !LOCKSTEP_HAS_CUDA && !defined(THRUST_DEVICE_SYSTEM)
#if LOCKSTEP_HAS_OPENMP
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_OMP
#else
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif
#endif

namespace lockstep {
/// The library version as {major, minor, patch}.
struct version_info {
    int major, minor, patch;
};
inline constexpr version_info version{LOCKSTEP_VERSION_MAJOR, LOCKSTEP_VERSION_MINOR,
                                      LOCKSTEP_VERSION_PATCH};
} // namespace lockstep

// lockstep/lockstep.hpp: the umbrella header: every public header this build's backends allow.
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Every header of include/lockstep outside detail/ is listed here (tests/headers checks it).
// Headers that need a backend are included only when the build has it, by the feature macros of
// core/config.hpp: CUDA (LOCKSTEP_HAS_CUDA: nvcc compiles this unit), MPI (LOCKSTEP_HAS_MPI:
// linked with lockstep::mpi, which also provides <mpi.h>) and NCCL (LOCKSTEP_HAS_NCCL). A host
// compiler without MPI therefore gets every header except cuda_system.hpp, bn_cuda.cuh,
// mpi_environment.hpp, mpi_communicator.hpp, hierarchical_group.hpp, gpu_group.hpp,
// nccl_communicator.hpp, nccl_group.hpp and gpu_hierarchical_group.hpp; without MPI,
// mpi_unavailable.hpp makes constructing an mpi_communicator, mpi_environment or
// hierarchical_group a compile error that names the target to link (lockstep::mpi).
#include "lockstep/core/config.hpp"

#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/core/leading_zeros.hpp"
#include "lockstep/core/span_overlap.hpp"
#include "lockstep/kernels/float16_arrays.hpp"

#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/system/system.hpp"
#if LOCKSTEP_HAS_CUDA
#include "lockstep/system/cuda_system.hpp"
#endif

#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/bn_statistics.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/exact_sum.hpp"
#include "lockstep/kernels/float16_convert.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/kernels/philox.hpp"
#include "lockstep/kernels/segmented.hpp"
#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/bn_cuda.cuh"
#endif

#include "lockstep/comm/collective_event.hpp"
#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/combine.hpp"
#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/file_coordinator.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/comm/simulated_link.hpp"
#include "lockstep/comm/thread_communicator.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/comm/timeout.hpp"
#if LOCKSTEP_HAS_MPI
#include "lockstep/comm/hierarchical_group.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#else
#include "lockstep/comm/mpi_unavailable.hpp"
#endif
#if LOCKSTEP_HAS_NCCL
#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/comm/nccl_group.hpp"
#endif
#if LOCKSTEP_HAS_NCCL && LOCKSTEP_HAS_MPI
#include "lockstep/comm/gpu_hierarchical_group.hpp"
#endif

#include "lockstep/policy/bn.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"

#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/batch_norm_params.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/nn/layout.hpp"
#include "lockstep/nn/policy_declaration.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/optim/sgd.hpp"

#include "lockstep/train/async_checkpoint.hpp"
#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/checkpoint.hpp"
#include "lockstep/train/compute_copy.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/loss_scaler.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/parameter_server.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/rng.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/step_state.hpp"
#include "lockstep/train/straggler_report.hpp"
#include "lockstep/train/train_params.hpp"

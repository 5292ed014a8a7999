// lockstep/lockstep.hpp: the umbrella header: every public header this build's backends allow.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/float16.hpp"

#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#if LOCKSTEP_HAS_CUDA
#include "lockstep/system/cuda_system.hpp"
#endif

#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/kernels/philox.hpp"

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/thread_group.hpp"
#if LOCKSTEP_HAS_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#endif
#if LOCKSTEP_HAS_NCCL
#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#endif

#include "lockstep/policy/bn.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"

#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/layout.hpp"

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/optim/sgd.hpp"

#include "lockstep/train/asynchronous.hpp"
#include "lockstep/train/compute_copy.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/loss_scaler.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/rng.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

// lockstep/kernels/detail/bn_cuda_kernels.cuh: the CUDA batch-norm kernels (moments, normalize,
// backward sums, fused dx) for planes (NCHW) and rows (NHWC, N x C). SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/detail/bn_cuda_elementwise.cuh"
#include "lockstep/kernels/detail/bn_cuda_reductions.cuh"

// Two shapes cover every layout, as on the host:
// - planes (inner > 1): a warp takes an item of 8 vectors per lane of one channel's values
//   (reductions) or of the tensor (elementwise) and walks it run by run with a row pointer;
//   16-byte vectors between an unaligned head and tail. Small planes (cuda_small_plane: runs
//   too short for a warp of vectors) are walked flat instead: consecutive threads take
//   consecutive values, one per lane, across run boundaries.
// - rows (inner == 1): consecutive threads take consecutive channel vectors of a row (coalesced),
//   tx indexes channel vectors, ty rows; a thread keeps its channels' state across rows.
// Reductions write one partial per (channel, partition) block; the last block of a channel (or
// channel tile) to arrive folds them in double with exact integer counts, in a fixed order that
// depends on the partition count (and tile) alone: contiguous partition ranges per thread, then
// a pairwise tree (ordered_fold for planes, channel_fold for rows, whose threads split each
// channel of the tile).

#endif

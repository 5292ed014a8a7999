// lockstep/kernels/detail/bn_cuda_kernels.cuh: the CUDA batch-norm kernels (moments, normalize,
// backward sums, fused dx) for planes (NCHW) and rows (NHWC, N x C). SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/detail/bn_cuda_elementwise.cuh"
#include "lockstep/kernels/detail/bn_cuda_reductions.cuh"
#include "lockstep/kernels/detail/bn_cuda_tiles.cuh"

// Two shapes cover every layout, as on the host, and a third the reductions of odd planes:
// - planes (inner > 1): the tensor is walked in units of V values (16-byte vectors where every
//   pointer is aligned and, for the reductions, a plane is whole vectors, so every unit lies in
//   one plane, or no tile fits and the reductions take the vectors inside each plane and its
//   edges by value (plane_vectors), or, for the elementwise kernels, the tensor is whole vectors
//   and a plane at least two vectors' worth, so a unit straddles at most two planes; 8-byte ones
//   of 16-bit values likewise, else single values); consecutive threads take consecutive units of
//   one channel's partition (reductions, flat_channel) or of the tensor (elementwise, tensor_walk),
//   a few units in flight per thread, offsets stepped without a division per unit.
// - tiles (the reductions where planes hold no whole vectors, e.g. 7x7): a block takes a tile of
//   channels whose planes of one sample are whole 16-byte vectors, each thread one vector position
//   of the tile in every few samples, so each lane keeps one channel (bn_cuda_tiles.cuh).
// - rows (inner == 1): consecutive threads take consecutive channel vectors of a row (coalesced),
//   tx indexes channel vectors, ty rows; a thread keeps its channels' state across rows.
// Reductions write one partial per (channel, partition) block; the last block of a channel (or
// tile) to arrive folds them in double with exact integer counts, in a fixed order that
// depends on the partition count (and tile) alone: contiguous partition ranges per thread, then
// a pairwise tree (ordered_fold for planes and tiles, channel_fold for rows, whose threads split
// each channel of the tile).

#endif

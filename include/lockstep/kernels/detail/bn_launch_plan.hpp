// lockstep/kernels/detail/bn_launch_plan.hpp: which CUDA batch-norm kernel a call launches and
// on what grid, decided once per call on the host from the geometry, the value size and the data
// pointers' alignment (kernels/bn_cuda.cuh launches what the plan says). Host code only, so the
// choice is tested without a GPU. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/channel_geometry.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace lockstep::kernels::cuda_path {

/// Threads per block of every batch-norm kernel.
inline constexpr int block_threads = 256;

namespace detail {

/// Units (values, or vectors of them) per thread of the elementwise planes kernels.
inline constexpr std::size_t flat_values = 8;
/// Units one block of an elementwise planes kernel covers (contiguous, from block index x this).
inline constexpr std::size_t block_units = std::size_t{block_threads} * flat_values;

/// The planes (plane q holds channel q % channels) that the `span` tensor offsets from `begin`
/// touch: `count` planes from `first` (none when begin is past the tensor). The normalize kernels'
/// blocks keep one table entry per plane they touch.
struct block_planes {
    std::size_t first = 0;
    std::size_t count = 0;
    LOCKSTEP_HOST_DEVICE block_planes(const channel_geometry& g, std::size_t begin,
                                      std::size_t span) {
        const std::size_t size = g.size();
        if (begin >= size || span == 0)
            return;
        first = begin / g.inner;
        const std::size_t end = begin + span < size ? begin + span : size;
        count = (end - 1) / g.inner - first + 1;
    }
};

/// Entries of the planes normalize kernel's table: a block covers block_units vectors of planes
/// of at least 2 vectors' worth of values (plan_bn_launch), so it touches at most block_units /
/// 2 planes and the two it starts and ends in.
inline constexpr std::size_t planes_block_entries = block_units / 2 + 2;

/// How a kernel maps the tensor onto its threads (kernels/detail/bn_cuda_kernels.cuh):
enum class bn_mapping {
    planes, ///< inner > 1: consecutive threads take consecutive units of a channel or the tensor
    rows,   ///< inner == 1: threads along the channels (tx) and the rows
    tiles,  ///< inner > 1, a reduction over planes of no whole vectors: tiles of channels
};

/// The channel tiles of an NCHW reduction whose planes are not whole vectors of v values (7x7,
/// 3x3, ...): the `channels` = v / gcd(inner, v) planes of one sample that a tile holds are
/// contiguous and whole vectors, `vectors` = channels inner / v of them; a block reads `rows`
/// = block_threads / vectors samples' tiles at once, thread t the vector t % vectors of sample
/// t / vectors (threads from rows vectors on idle), so each lane of a thread's vectors always
/// holds the same channel.
struct tile_shape {
    unsigned channels = 0;
    unsigned vectors = 0;
    unsigned rows = 0;
};

/// The tile shape of planes of `inner` values read in vectors of v (v a power of two).
inline tile_shape channel_tile(std::size_t inner, std::size_t v) {
    const std::size_t ct = kernels::detail::tile_channels(inner, v);
    const std::size_t vectors = ct * inner / v;
    tile_shape t;
    t.channels = static_cast<unsigned>(ct);
    t.vectors = static_cast<unsigned>(std::min<std::size_t>(vectors, std::size_t{1} << 30));
    t.rows = vectors <= block_threads ? static_cast<unsigned>(block_threads / vectors) : 0;
    return t;
}

/// One launch: the mapping, the values each access reads (width: 1, a 16-byte vector's 16 / value
/// bytes, or for 2-byte values an 8-byte vector's 4), the grid, for rows the threads along the
/// channels, for a reduction its partitions (of a channel's units for planes, of the rows for
/// rows, of the samples for tiles), for tiles their shape, and for planes whether they are no
/// whole vectors (edges: the reductions read the values outside the vectors one at a time).
struct bn_launch {
    bn_mapping mapping = bn_mapping::planes;
    unsigned width = 1;
    unsigned grid_x = 1;
    unsigned grid_y = 1;
    unsigned tx = 0;
    std::size_t parts = 0;
    tile_shape tile{};
    bool edges = false;
};

/// A 1-D grid of `blocks` (at least 1). requires: blocks < 2^31 (else lockstep::error).
inline unsigned grid_1d(std::size_t blocks) {
    LOCKSTEP_REQUIRE(blocks < (std::size_t(1) << 31), errc::invalid_argument, -1,
                     "kernels::cuda_path", "a grid of ", blocks, " blocks");
    return static_cast<unsigned>(blocks == 0 ? 1 : blocks);
}

/// Threads per block along the channels in the rows kernels: enough for the channel vectors,
/// at most a warp (a power of two, so block_threads / tx rows fit a block evenly).
inline unsigned rows_tx(std::size_t channel_vectors) {
    unsigned tx = 32;
    while (tx > 1 && tx / 2 >= channel_vectors)
        tx /= 2;
    return tx;
}

/// Grid size along rows of the elementwise rows kernels: about 4 rows per thread.
inline unsigned rows_grid_y(std::size_t rows, unsigned tx) {
    const std::size_t per_block = std::size_t(block_threads / tx) * 4;
    const std::size_t y = (rows + per_block - 1) / per_block;
    return static_cast<unsigned>(y == 0 ? 1 : std::min<std::size_t>(y, 65535));
}

/// The launch of one batch-norm kernel over g, whose data (the tensors it reads and writes, of
/// `value_bytes` bytes a value) lie at `data`:
/// - planes where inner > 1, else rows;
/// - width: planes read the widest vector every pointer is aligned to, 16 bytes or 8 for 2-byte
///   values (a vector of at least 4 values), else one value, where for a reduction its values
///   divide a plane at least twice (so every vector lies in one plane) and for an elementwise
///   kernel they divide the tensor and a plane holds at least two vectors' worth (so a vector
///   straddles at most two planes); rows read 16-byte vectors where the pointers are aligned to
///   them and the channels are whole vectors, else one value;
/// - a reduction whose planes take no vector takes tiles instead where the pointers are aligned
///   to 16 bytes, the channels are whole tiles (channel_tile) and a tile's vectors fit a block;
///   else, aligned to 16 bytes, with channels x inner whole vectors and planes of at least two
///   vectors' worth, the 16-byte vectors inside each plane and its edges one value at a time
///   (plane_vectors; the planes mapping);
/// - a reduction (parts >= 1, cuda_partitions) has one block per (channel, partition) (planes),
///   per (channel tile, partition) (rows: grid_y = parts) or per (tile, partition of the
///   samples) (tiles: cuda_tile_partitions of them, in the plan's parts); an elementwise kernel
///   (parts == 0) covers the values, block_units accesses a block (planes, with at least
///   min_blocks blocks) or about 4 rows a thread (rows).
inline bn_launch plan_bn_launch(const channel_geometry& g, std::size_t value_bytes,
                                std::size_t parts, std::size_t min_blocks,
                                std::initializer_list<const void*> data) {
    const std::size_t v = 16 / value_bytes;
    const auto aligned = [&](std::size_t bytes) {
        return std::all_of(data.begin(), data.end(), [&](const void* p) {
            return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
        });
    };
    bn_launch l;
    if (g.inner > 1) {
        l.mapping = bn_mapping::planes;
        for (const std::size_t w : {v, v / 2 >= 4 ? v / 2 : v}) {
            // a reduction's vectors lie in one plane; an elementwise kernel's may straddle two
            const bool fits = parts > 0 ? g.inner % w == 0 && g.inner / w >= 2
                                        : g.size() % w == 0 && g.inner >= 2 * w;
            if (l.width == 1 && aligned(w * value_bytes) && fits)
                l.width = static_cast<unsigned>(w);
        }
        if (parts > 0 && l.width == 1 && aligned(16)) { // a reduction over odd planes
            const tile_shape t = channel_tile(g.inner, v);
            if (g.channels % t.channels == 0 && t.rows > 0) {
                l.mapping = bn_mapping::tiles;
                l.width = static_cast<unsigned>(v);
                l.tile = t;
                l.parts = kernels::detail::cuda_tile_partitions(g, value_bytes);
                l.grid_x = grid_1d(g.channels / t.channels * l.parts);
                return l;
            }
            // no tile: the vectors inside each plane, its edges one value at a time
            if (g.channels * g.inner % v == 0 && g.inner >= 2 * v) {
                l.width = static_cast<unsigned>(v);
                l.edges = true;
            }
        }
        l.parts = parts;
        const std::size_t units = g.size() / l.width;
        l.grid_x =
            grid_1d(parts > 0 ? g.channels * parts
                              : std::max((units + block_units - 1) / block_units, min_blocks));
        return l;
    }
    l.mapping = bn_mapping::rows;
    l.parts = parts;
    l.width = g.channels % v == 0 && aligned(16) ? static_cast<unsigned>(v) : 1;
    const std::size_t vectors = g.channels / l.width;
    l.tx = rows_tx(vectors);
    l.grid_x = grid_1d((vectors + l.tx - 1) / l.tx);
    l.grid_y = parts > 0 ? static_cast<unsigned>(parts) : rows_grid_y(g.outer, l.tx);
    return l;
}

} // namespace detail
} // namespace lockstep::kernels::cuda_path

// Tests of the CUDA batch-norm launch plan (kernels/detail/bn_launch_plan.hpp) and the kernels'
// steps (kernels/detail/bn_steps.hpp), on the host: the mapping, vectors and grid of every
// launcher's choice, on shapes of docs/gpu_batch_norm.md's grid table (its figures computed by
// hand from the kernels' geometry) and on the alignment cases; the steps against divisions.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/detail/bn_launch_plan.hpp"
#include "lockstep/kernels/detail/bn_steps.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <vector>

using lockstep::error;
using lockstep::kernels::channel_geometry;
using lockstep::kernels::detail::cuda_partitions;
namespace cp = lockstep::kernels::cuda_path::detail;
using cp::bn_mapping;

namespace {

/// A device address with the given offset from a 16-byte boundary (never dereferenced).
const void* at(std::uintptr_t offset) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): an address the plan only takes the offset of
    return reinterpret_cast<const void*>(std::uintptr_t{0x10000} + offset);
}

channel_geometry nchw(std::size_t n, std::size_t c, std::size_t hw) {
    return {n, c, hw};
}
channel_geometry nhwc(std::size_t n, std::size_t c, std::size_t hw) {
    return {n * hw, c, 1};
}

} // namespace

TEST_CASE("the planes mapping: a block per (channel, partition), vectors of whole planes",
          "[kernels][bn]") {
    // 32x64x56x56 float NCHW: 13 partitions, 832 reduction blocks, 784 elementwise (docs).
    const channel_geometry g = nchw(32, 64, 3136);
    const std::size_t parts = cuda_partitions(g, 4);
    REQUIRE(parts == 13);
    const cp::bn_launch k1 = cp::plan_bn_launch(g, 4, parts, 0, {at(0)});
    CHECK(k1.mapping == bn_mapping::planes);
    CHECK(k1.width == 4);
    CHECK(!k1.edges);
    CHECK(k1.grid_x == 832);
    CHECK(k1.grid_y == 1);
    const cp::bn_launch k3 = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(0)});
    CHECK(k3.width == 4);
    CHECK(k3.grid_x == 784); // 6,422,528 values / (2048 units x 4)
    // Any pointer off a 16-byte boundary: one value per access, 2048 values a block.
    const cp::bn_launch k3s = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(4)});
    CHECK(k3s.width == 1);
    CHECK(k3s.grid_x == 3136);
    CHECK(cp::plan_bn_launch(g, 4, parts, 0, {at(8), at(8)}).width == 1);
    CHECK(cp::plan_bn_launch(g, 2, cuda_partitions(g, 2), 0, {at(2)}).width == 1);
    // 16-bit values: 8 a vector, or 4 (an 8-byte vector) where the pointers are 8-byte aligned.
    CHECK(cp::plan_bn_launch(g, 2, 0, 0, {at(0), at(0)}).width == 8);
    CHECK(cp::plan_bn_launch(g, 2, 0, 0, {at(0), at(8)}).width == 4);
    // The fused dx kernel asks for a thread per channel: at least min_blocks blocks.
    CHECK(cp::plan_bn_launch(nchw(1, 8, 256), 4, 0, 1000, {at(0), at(0), at(0)}).grid_x == 1000);
}

TEST_CASE("a reduction reads planes that are not whole vectors, at least two, in channel tiles "
          "or one value at a time; an elementwise kernel in vectors that straddle planes",
          "[kernels][bn]") {
    // 256x64x14x14 NCHW: float planes are 49 vectors (448 and 392 blocks), half planes 24.5
    // 16-byte vectors and 49 8-byte ones (the reductions read 8-byte ones, the elementwise
    // kernels 16-byte ones across planes: 196 blocks), 7x7 planes are odd (docs).
    const channel_geometry g = nchw(256, 64, 196);
    const std::size_t parts = cuda_partitions(g, 4);
    REQUIRE(parts == 7);
    const cp::bn_launch k1 = cp::plan_bn_launch(g, 4, parts, 0, {at(0)});
    CHECK(k1.mapping == bn_mapping::planes);
    CHECK(k1.width == 4);
    CHECK(k1.grid_x == 448);
    const cp::bn_launch k3 = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(0)});
    CHECK(k3.width == 4);
    CHECK(k3.grid_x == 392); // 3,211,264 values / (2048 units x 4)
    CHECK(cp::plan_bn_launch(g, 2, cuda_partitions(g, 2), 0, {at(0)}).width == 4);
    const cp::bn_launch h3 = cp::plan_bn_launch(g, 2, 0, 0, {at(0), at(0)});
    CHECK(h3.width == 8);
    CHECK(h3.grid_x == 196);
    CHECK(cp::plan_bn_launch(g, 2, 0, 0, {at(0), at(4)}).width == 1);
    // 7x7: the normalize and dx kernels take 16-byte vectors over the tensor (49 values a plane,
    // so a vector's lanes lie in at most two planes); a tensor that is not whole vectors, or a
    // plane under two vectors' worth, one value at a time.
    const cp::bn_launch s3 = cp::plan_bn_launch(nchw(256, 2048, 49), 4, 0, 0, {at(0), at(0)});
    CHECK(s3.width == 4);
    CHECK(s3.grid_x == 3136); // 25,690,112 values / (2048 vectors x 4)
    CHECK(cp::plan_bn_launch(nchw(256, 2048, 49), 2, 0, 0, {at(0), at(0)}).width == 8);
    CHECK(cp::plan_bn_launch(nchw(256, 2048, 49), 2, 0, 0, {at(0), at(8)}).width == 4);
    CHECK(cp::plan_bn_launch(nchw(3, 5, 49), 4, 0, 0, {at(0), at(0)}).width == 1); // 735 values
    CHECK(cp::plan_bn_launch(nchw(8, 4, 7), 4, 0, 0, {at(0), at(0)}).width == 1);  // 7 < 8
    CHECK(cp::plan_bn_launch(nchw(8, 4, 9), 4, 0, 0, {at(0), at(0)}).width == 4);
    CHECK(cp::plan_bn_launch(nchw(64, 256, 784), 2, 4, 0, {at(0)}).width == 8); // 28x28 half
    // A plane of one vector is no planes vector (that would be the rows layout) but a tile of one
    // channel; 8-byte vectors only for 16-bit values (float's would hold 2).
    CHECK(cp::plan_bn_launch(nchw(8, 4, 4), 4, 1, 0, {at(0)}).mapping == bn_mapping::tiles);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 4), 4, 1, 0, {at(0)}).tile.channels == 1);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 8), 4, 1, 0, {at(0)}).width == 4);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 6), 4, 1, 0, {at(0)}).tile.channels == 2);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 8), 2, 1, 0, {at(0)}).width == 4);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 8), 2, 1, 0, {at(0)}).mapping == bn_mapping::planes);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 4), 2, 1, 0, {at(0)}).tile.channels == 2);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 4), 8, 1, 0, {at(0)}).width == 2); // double: 2 vectors
    CHECK(cp::plan_bn_launch(nchw(8, 4, 4), 8, 1, 0, {at(0)}).mapping == bn_mapping::planes);
    // Few values over many channels: the channel blocks of the fused dx kernel.
    const cp::bn_launch k5 = cp::plan_bn_launch(nchw(1, 2048, 4), 4, 0, 8, {at(0), at(0), at(0)});
    CHECK(k5.mapping == bn_mapping::planes);
    CHECK(k5.grid_x == 8);
}

TEST_CASE("the tiles mapping: reductions over planes of no whole vectors read tiles of channels "
          "whose planes are, where the data is aligned and the channels whole tiles",
          "[kernels][bn]") {
    using lockstep::kernels::detail::cuda_tile_partitions;
    // 256x2048x7x7 NCHW (docs): a tile is 4 float channels (196 values, 49 vectors), 8 half ones
    // (392 values, 49 vectors) or 2 double ones; 5 samples' tiles a block round (245 threads);
    // 7 partitions of the samples (about 28 KiB a block).
    const channel_geometry g = nchw(256, 2048, 49);
    for (const auto& [bytes, channels, blocks] :
         {std::tuple{4, 4u, 3584u}, std::tuple{2, 8u, 1792u}, std::tuple{8, 2u, 7168u}}) {
        CAPTURE(bytes);
        const std::size_t value_bytes = static_cast<std::size_t>(bytes);
        const cp::bn_launch k1 =
            cp::plan_bn_launch(g, value_bytes, cuda_partitions(g, value_bytes), 0, {at(0)});
        CHECK(k1.mapping == bn_mapping::tiles);
        CHECK(k1.width == 16 / value_bytes);
        CHECK(k1.tile.channels == channels);
        CHECK(k1.tile.vectors == 49);
        CHECK(k1.tile.rows == 5);
        CHECK(k1.parts == 7);
        CHECK(cuda_tile_partitions(g, value_bytes) == 7);
        CHECK(k1.grid_x == blocks);
        // off a 16-byte boundary: the planes mapping, one value at a time
        const cp::bn_launch s1 =
            cp::plan_bn_launch(g, value_bytes, cuda_partitions(g, value_bytes), 0, {at(8)});
        CHECK(s1.mapping == bn_mapping::planes);
        CHECK(s1.width == 1);
        CHECK(s1.parts == cuda_partitions(g, value_bytes));
    }
    // The workspace holds the tiles' partials (8192 channels: more than the generic path's)
    const channel_geometry wide = nchw(256, 8192, 49);
    CHECK(cuda_tile_partitions(wide, 4) == 7);
    CHECK(lockstep::kernels::bn_workspace_bytes<float>(wide) >=
          lockstep::kernels::detail::counter_bytes(wide) +
              std::size_t{2} * 8192 * 7 * sizeof(float));
    // channels that are no whole tiles take single values where their planes start at different
    // lanes (2050 x 49 values: no whole vectors); 3x3 float: 9 vectors, 28 samples a round
    CHECK(cp::plan_bn_launch(nchw(64, 2050, 49), 4, 1, 0, {at(0)}).width == 1);
    const cp::bn_launch t9 = cp::plan_bn_launch(nchw(64, 8, 9), 4, 1, 0, {at(0)});
    CHECK(t9.tile.vectors == 9);
    CHECK(t9.tile.rows == 28);
    // an elementwise kernel never takes tiles
    CHECK(cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(0)}).mapping == bn_mapping::planes);
}

TEST_CASE("a reduction over planes too wide for a tile reads the vectors inside each plane",
          "[kernels][bn]") {
    // 32x288x35x35 (gpu_bench_odd) and 17x17: a float tile would be 1225 or 289 vectors, more
    // than a block's threads; every plane of a channel starts at the same lane (C x HW is whole
    // vectors), so the planes mapping reads 16-byte vectors and each plane's edges by value.
    for (const channel_geometry g : {nchw(32, 288, 1225), nchw(64, 16, 289)}) {
        CAPTURE(g.inner);
        for (const std::size_t bytes : {std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
            const cp::bn_launch k1 = cp::plan_bn_launch(g, bytes, 5, 0, {at(0), at(0)});
            CHECK(k1.mapping == bn_mapping::planes);
            CHECK(k1.width == 16 / bytes);
            CHECK(k1.edges);
            CHECK(k1.parts == 5);
            CHECK(k1.grid_x == g.channels * 5);
            CHECK(cp::plan_bn_launch(g, bytes, 5, 0, {at(0), at(8)}).width == 1);
        }
    }
    // planes of a channel at different lanes (5 x 35 x 35 values: no whole vectors), or planes
    // under two vectors' worth: single values
    CHECK(cp::plan_bn_launch(nchw(32, 5, 1225), 4, 5, 0, {at(0)}).width == 1);
    CHECK(cp::plan_bn_launch(nchw(32, 5, 7), 4, 5, 0, {at(0)}).width == 1);
}

TEST_CASE("the rows mapping: vectors only for aligned data and whole channel vectors",
          "[kernels][bn]") {
    // 32x1024x14x14 float NHWC: 256 channel vectors, tx 32, 8 tiles; 196 partitions, and 196
    // row blocks of the elementwise kernels (8 x 196 = 1568, docs).
    const channel_geometry g = nhwc(32, 1024, 196);
    const std::size_t parts = cuda_partitions(g, 4);
    REQUIRE(parts == 196);
    const cp::bn_launch k1 = cp::plan_bn_launch(g, 4, parts, 0, {at(0)});
    CHECK(k1.mapping == bn_mapping::rows);
    CHECK(k1.width == 4);
    CHECK(k1.tx == 32);
    CHECK(k1.grid_x == 8);
    CHECK(k1.grid_y == 196);
    const cp::bn_launch k3 = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(0)});
    CHECK(k3.grid_x == 8);
    CHECK(k3.grid_y == 196); // 6272 rows / (8 rows x 4 per block)
    // Any pointer off a 16-byte boundary, or channels not a multiple of V: one value per access.
    const cp::bn_launch off = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(4)});
    CHECK(off.width == 1);
    CHECK(off.tx == 32);
    CHECK(off.grid_x == 32);
    CHECK(cp::plan_bn_launch(g, 4, parts, 0, {at(8), at(8)}).width == 1);
    const cp::bn_launch odd = cp::plan_bn_launch(nhwc(4, 66, 9), 4, 3, 0, {at(0)});
    CHECK(odd.width == 1);
    CHECK(odd.grid_x == 3);
    CHECK(odd.grid_y == 3);
    // Few channels: the fewest threads along them that cover the vectors (a power of two).
    CHECK(cp::plan_bn_launch(nhwc(4, 3, 1), 4, 1, 0, {at(0)}).tx == 4);
    CHECK(cp::plan_bn_launch(nhwc(4, 8, 1), 2, 1, 0, {at(0)}).tx == 1); // one vector of 8 halves
    // The elementwise grid along rows stops at 65535.
    CHECK(cp::plan_bn_launch(nhwc(1, 64, std::size_t{1} << 26), 4, 0, 0, {at(0)}).grid_y == 65535);
}

TEST_CASE("a grid of 2^31 blocks or more is refused", "[kernels][bn]") {
    CHECK(cp::grid_1d(0) == 1);
    CHECK(cp::grid_1d((std::size_t{1} << 31) - 1) == (1u << 31) - 1);
    CHECK_THROWS_AS(cp::grid_1d(std::size_t{1} << 31), error);
}

TEST_CASE("a normalize block's table holds every plane the block touches", "[kernels][bn]") {
    // Every block of the plan's normalize grid, for planes of one or a few vectors, odd sizes and
    // ResNet's, 2-, 4- and 8-byte values, aligned and not: the planes it touches fit the table
    // the kernel declares (planes_block_entries), or the kernel would write past its shared
    // memory.
    std::size_t most = 0;
    for (const std::size_t bytes : {std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
        const std::size_t v = 16 / bytes;
        for (const std::size_t inner :
             {std::size_t{2}, std::size_t{3}, v, 2 * v, 2 * v + 1, std::size_t{49},
              std::size_t{196}, std::size_t{263}, std::size_t{784}, std::size_t{3136}}) {
            for (const std::uintptr_t offset :
                 {std::uintptr_t{0}, std::uintptr_t{bytes}, std::uintptr_t{8}}) {
                CAPTURE(bytes, inner, offset);
                const channel_geometry g = nchw(64, 37, inner);
                const cp::bn_launch p = cp::plan_bn_launch(g, bytes, 0, 0, {at(0), at(offset)});
                REQUIRE(p.mapping == bn_mapping::planes);
                // whole vectors of the tensor, each in at most two planes
                CHECK(g.size() % p.width == 0);
                CHECK((p.width == 1 || inner >= std::size_t{2} * p.width));
                const std::size_t span = cp::block_units * p.width; // values a block covers
                for (std::size_t b = 0; b < p.grid_x; ++b) {
                    const cp::block_planes planes(g, b * span, span);
                    CHECK(planes.count <= cp::planes_block_entries);
                    most = std::max(most, planes.count);
                }
                // the blocks cover the tensor
                CHECK(std::size_t{p.grid_x} * span >= g.size());
            }
        }
    }
    // and the cases come within the two planes a block may start and end in of the bound
    CHECK(most >= cp::planes_block_entries - 2); // 2048 units of 2-unit planes
}

TEST_CASE("the kernels' division-free steps match the divisions they replace", "[kernels][bn]") {
    // channel_walk: channel c's values k, k + stride, ... (flat_channel's threads); tensor_walk:
    // offsets a, a + stride, ... with plane and channel (the elementwise planes kernels), for
    // strides below, at and above a plane and a channel's row of planes.
    for (const channel_geometry g :
         {nchw(5, 3, 7), nchw(4, 6, 2), nchw(3, 2, 49), nchw(2, 1, 8), nchw(7, 5, 300)}) {
        for (const std::size_t stride : {std::size_t{1}, std::size_t{5}, g.inner, g.inner + 1,
                                         std::size_t{256}, g.channels * g.inner + 3}) {
            CAPTURE(g.outer, g.channels, g.inner, stride);
            for (std::size_t c = 0; c < g.channels; ++c) {
                for (std::size_t k0 = 0; k0 < std::min<std::size_t>(g.inner + 2, 12); ++k0) {
                    cp::channel_walk w(cp::plane_vectors(g, c, 1), k0, stride);
                    for (std::size_t k = k0; k < g.per_channel(); k += stride, w.next())
                        REQUIRE(w.off == g.offset(c, k));
                }
            }
            for (std::size_t a = 0; a < std::min<std::size_t>(g.size(), 20); ++a) {
                cp::tensor_walk w(g, a, stride);
                for (std::size_t off = a; off < g.size(); off += stride, w.next()) {
                    REQUIRE(w.off == off);
                    REQUIRE(w.plane == off / g.inner);
                    REQUIRE(w.i == off % g.inner);
                    REQUIRE(w.c == g.channel_of(off));
                }
            }
        }
    }
    // plane_vectors: a channel's vectors inside its planes and the plane's edges hold each of
    // its values once; channel_walk over those vectors, plane by plane.
    for (const channel_geometry g :
         {nchw(3, 8, 35), nchw(2, 16, 49), nchw(3, 4, 8), nchw(2, 8, 17), nchw(2, 2, 13)}) {
        for (const std::size_t v :
             {std::size_t{1}, std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
            if (g.channels * g.inner % v != 0 || g.inner < 2 * v)
                continue;
            CAPTURE(g.channels, g.inner, v);
            for (std::size_t c = 0; c < g.channels; ++c) {
                const cp::plane_vectors pv(g, c, v);
                REQUIRE(pv.head < v);
                REQUIRE(pv.tail < v);
                REQUIRE(pv.units >= 1);
                std::vector<std::size_t> seen;
                cp::channel_walk w(pv, 0, 1);
                for (std::size_t s = 0; s < g.outer; ++s) {
                    for (std::size_t u = 0; u < pv.units; ++u, w.next()) {
                        REQUIRE(w.off == pv.first + s * pv.plane + u);
                        for (std::size_t j = 0; j < v; ++j)
                            seen.push_back(w.off * v + j);
                    }
                    for (std::size_t j = 0; j < pv.head + pv.tail; ++j)
                        seen.push_back(pv.edge(s, j));
                }
                std::sort(seen.begin(), seen.end());
                std::vector<std::size_t> want;
                for (std::size_t k = 0; k < g.per_channel(); ++k)
                    want.push_back(g.offset(c, k));
                std::sort(want.begin(), want.end());
                REQUIRE(seen == want);
            }
        }
    }
    // partition_walk: the rows of partition q are outer (q + 1) / parts - outer q / parts.
    for (const std::size_t outer : {std::size_t{1}, std::size_t{7}, std::size_t{50000}}) {
        for (const std::size_t parts : {std::size_t{1}, std::size_t{3}, std::size_t{256}}) {
            for (const std::size_t q0 : {std::size_t{0}, parts / 2}) {
                cp::partition_walk w(outer, parts, q0);
                for (std::size_t q = q0; q < parts; ++q)
                    REQUIRE(w.next() == outer * (q + 1) / parts - outer * q / parts);
            }
        }
    }
}

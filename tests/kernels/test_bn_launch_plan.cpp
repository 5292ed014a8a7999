// Tests of the CUDA batch-norm launch plan (kernels/detail/bn_launch_plan.hpp), on the host: the
// mapping, vectors and grid of every launcher's choice, on shapes of docs/gpu_batch_norm.md's grid
// table (its figures computed by hand from the kernels' geometry) and on the alignment cases.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/detail/bn_launch_plan.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

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

TEST_CASE("the planes mapping: a block per (channel, partition), a warp item per warp",
          "[kernels][bn]") {
    // 32x64x56x56 float NCHW: 13 partitions, 832 reduction blocks, 784 elementwise (docs).
    const channel_geometry g = nchw(32, 64, 3136);
    const std::size_t parts = cuda_partitions(g, 4);
    REQUIRE(parts == 13);
    const cp::bn_launch k1 = cp::plan_bn_launch(g, 4, parts, 0, {at(0)});
    CHECK(k1.mapping == bn_mapping::planes);
    CHECK(k1.vector);
    CHECK(k1.grid_x == 832);
    CHECK(k1.grid_y == 1);
    const cp::bn_launch k3 = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(0)});
    CHECK(k3.vector);
    CHECK(k3.grid_x == 784); // 6,422,528 values / (8 warps x 1024)
    // Pointers at different offsets within 16 bytes: one value per access, items of 256.
    const cp::bn_launch k3s = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(4)});
    CHECK_FALSE(k3s.vector);
    CHECK(k3s.grid_x == 3136);
    // Equally misaligned pointers still line up: vectors after a head.
    CHECK(cp::plan_bn_launch(g, 4, parts, 0, {at(8), at(8)}).vector);
    // One pointer is always in line with itself.
    CHECK(cp::plan_bn_launch(g, 2, cuda_partitions(g, 2), 0, {at(2)}).vector);
    // The fused dx kernel asks for a thread per channel: at least min_blocks blocks.
    CHECK(cp::plan_bn_launch(nchw(1, 8, 256), 4, 0, 1000, {at(0), at(0), at(0)}).grid_x == 1000);
}

TEST_CASE("the flat mapping for small planes, one value per access", "[kernels][bn]") {
    // 256x64x14x14 float NCHW (784-byte planes): 7 partitions, 448 and 1568 blocks (docs).
    const channel_geometry g = nchw(256, 64, 196);
    const std::size_t parts = cuda_partitions(g, 4);
    REQUIRE(parts == 7);
    const cp::bn_launch k1 = cp::plan_bn_launch(g, 4, parts, 0, {at(0)});
    CHECK(k1.mapping == bn_mapping::flat);
    CHECK_FALSE(k1.vector);
    CHECK(k1.grid_x == 448);
    const cp::bn_launch k3 = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(0)});
    CHECK(k3.mapping == bn_mapping::flat);
    CHECK(k3.grid_x == 1568); // 3,211,264 values / (256 threads x 8)
    // 14x14 half planes (392 B) are small too; 28x28 half (1568 B) are not.
    CHECK(cp::plan_bn_launch(nchw(8, 4, 196), 2, 1, 0, {at(0)}).mapping == bn_mapping::flat);
    CHECK(cp::plan_bn_launch(nchw(8, 4, 784), 2, 1, 0, {at(0)}).mapping == bn_mapping::planes);
    // Few values over many channels: the channel blocks of the fused dx kernel.
    const cp::bn_launch k5 = cp::plan_bn_launch(nchw(1, 2048, 4), 4, 0, 8, {at(0), at(0), at(0)});
    CHECK(k5.mapping == bn_mapping::flat);
    CHECK(k5.grid_x == 8);
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
    CHECK(k1.vector);
    CHECK(k1.tx == 32);
    CHECK(k1.grid_x == 8);
    CHECK(k1.grid_y == 196);
    const cp::bn_launch k3 = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(0)});
    CHECK(k3.grid_x == 8);
    CHECK(k3.grid_y == 196); // 6272 rows / (8 rows x 4 per block)
    // Any pointer off a 16-byte boundary, or channels not a multiple of V: one value per access.
    const cp::bn_launch off = cp::plan_bn_launch(g, 4, 0, 0, {at(0), at(4)});
    CHECK_FALSE(off.vector);
    CHECK(off.tx == 32);
    CHECK(off.grid_x == 32);
    CHECK_FALSE(cp::plan_bn_launch(g, 4, parts, 0, {at(8), at(8)}).vector);
    const cp::bn_launch odd = cp::plan_bn_launch(nhwc(4, 66, 9), 4, 3, 0, {at(0)});
    CHECK_FALSE(odd.vector);
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
    // Every block of the plan's normalize grid, for planes just over and under the flat
    // mapping's 1 KiB, odd sizes and ResNet's, 2-, 4- and 8-byte values, aligned and not: the
    // planes it touches fit the table the kernel declares (planes_block_entries,
    // flat_block_entries), or the kernel would write past its shared memory.
    std::size_t most_planes = 0;
    std::size_t most_flat = 0;
    for (const std::size_t bytes : {std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
        const std::size_t edge = 1024 / bytes; // the smallest plane mapped as planes
        for (const std::size_t inner :
             {std::size_t{2}, std::size_t{3}, std::size_t{49}, std::size_t{196}, edge - 1, edge,
              edge + 1, std::size_t{784}, std::size_t{3136}, std::size_t{263}}) {
            for (const std::uintptr_t offset : {std::uintptr_t{0}, std::uintptr_t{bytes}}) {
                CAPTURE(bytes, inner, offset);
                const channel_geometry g = nchw(64, 37, inner);
                const cp::bn_launch p = cp::plan_bn_launch(g, bytes, 0, 0, {at(0), at(offset)});
                const bool flat = p.mapping == bn_mapping::flat;
                REQUIRE((flat || p.mapping == bn_mapping::planes));
                const std::size_t span =
                    cp::block_values(p.mapping, p.vector ? static_cast<int>(16 / bytes) : 1);
                const std::size_t entries =
                    flat ? cp::flat_block_entries : cp::planes_block_entries;
                for (std::size_t b = 0; b < p.grid_x; ++b) {
                    const cp::block_planes planes(g, b * span, span);
                    CHECK(planes.count <= entries);
                    (flat ? most_flat : most_planes) =
                        std::max(flat ? most_flat : most_planes, planes.count);
                }
                // the blocks cover the tensor
                CHECK(std::size_t{p.grid_x} * span >= g.size());
            }
        }
    }
    // and the cases come within the two planes a block may start and end in of the bounds
    CHECK(most_planes >= cp::planes_block_entries - 2); // 32 edge-sized planes
    CHECK(most_flat >= cp::flat_block_entries - 2);     // 2048 values of 2-value planes
}

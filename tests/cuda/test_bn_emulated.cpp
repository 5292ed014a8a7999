// The CUDA batch-norm kernels (kernels/detail/bn_cuda_*.cuh) run on the CPU by the block
// emulator (tests/support/cuda_emulator.hpp), launched by kernels/bn_cuda.cuh's own launchers
// (the plan, the partitions, the widths, the workspace), and checked against the same double
// references as on a device (bn_kernel_checks.hpp): every mapping, vector width and alignment,
// without a GPU. What it cannot show: speed, the device's memory model and cub's fold order (the
// emulated BlockReduce folds in thread order), so bits are compared run against run only.
// SPDX-License-Identifier: Apache-2.0
#include "support/cuda_emulator.hpp"

#include "lockstep/kernels/bn_cuda.cuh"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/channel_geometry.hpp"

#include "bn_kernel_checks.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <vector>

using namespace lockstep_test::bn_data;
using lockstep::kernels::accumulation_t;
using lockstep::kernels::channel_geometry;
namespace kd = lockstep::kernels::detail;

namespace {

/// n values of U from `offset` values into a 16-byte aligned allocation whose other values hold
/// a sentinel byte pattern, so a write outside the n values shows (untouched()).
template <class U>
struct host_array {
    std::vector<uint4> storage;
    std::size_t offset;
    std::size_t size;
    host_array(std::size_t n, std::size_t off)
        : storage(((n + off + 1) * sizeof(U) + sizeof(uint4) - 1) / sizeof(uint4) + 1), offset(off),
          size(n) {
        std::memset(storage.data(), 0x5a, storage.size() * sizeof(uint4));
    }
    host_array(const std::vector<U>& h, std::size_t off) : host_array(h.size(), off) {
        if (!h.empty())
            std::memcpy(data(), h.data(), h.size() * sizeof(U));
    }
    U* data() { return reinterpret_cast<U*>(storage.data()) + offset; }
    std::vector<U> values() const {
        std::vector<U> h(size);
        if (size > 0)
            std::memcpy(h.data(), reinterpret_cast<const U*>(storage.data()) + offset,
                        size * sizeof(U));
        return h;
    }
    /// True when every byte outside the n values still holds the sentinel.
    bool untouched() const {
        const auto* b = reinterpret_cast<const unsigned char*>(storage.data());
        const std::size_t lo = offset * sizeof(U), hi = (offset + size) * sizeof(U);
        for (std::size_t i = 0; i < storage.size() * sizeof(uint4); ++i)
            if ((i < lo || i >= hi) && b[i] != 0x5a)
                return false;
        return true;
    }
};

/// The launchers of kernels/bn_cuda.cuh, on the emulator (the stream is not used).
const cudaStream_t emulated{};
namespace cp = lockstep::kernels::cuda_path;

/// A new seed for each shuffled schedule (lockstep_emulator::schedule_seed), the same each run.
unsigned next_seed() {
    static unsigned seed = 0;
    return ++seed;
}

} // namespace

TEMPLATE_TEST_CASE("emulated cuda_path moments and backward sums agree with a double reference",
                   "[kernels][bn][emulated]", float, double, __half, __nv_bfloat16) {
    using T = TestType;
    using Acc = accumulation_t<T>;
    using lockstep::kernels::packed_moments;
    using lockstep::kernels::packed_sums;
    for (const channel_geometry g : geometries) {
        for (const std::size_t off : reduction_offsets<T>()) {
            CAPTURE(g.outer, g.channels, g.inner, off);
            const std::size_t C = g.channels;
            const auto xh = values<T>(g.size(), 3, 50.0, 2.0);
            const auto dyh = values<T>(g.size(), 4, 0.0, 1.0);
            const auto meanh = channel_means<Acc>(C);
            host_array<T> x(xh, off), dy(dyh, off);
            host_array<std::byte> ws(lockstep::kernels::bn_workspace_bytes<T>(g), 0);
            std::memset(ws.data(), 0, ws.size);
            // K1 twice (the arrival counters must be back at zero), K4 twice on the same
            // workspace; the second launches with blocks and threads in another order, as a
            // device may run them: the same bits (a fixed fold order, no race)
            host_array<Acc> b1(std::vector<Acc>(packed_moments::size(C), Acc(-7)), 0), b2 = b1;
            host_array<Acc> s1(std::vector<Acc>(packed_sums::size(C), Acc(-7)), 0), s2 = s1;
            cp::pack_local_moments(emulated, x.data(), g, Acc(1), b1.data(), ws.data());
            cp::pack_backward_sums(emulated, dy.data(), x.data(), g, meanh.data(), Acc(2),
                                   s1.data(), ws.data());
            {
                const lockstep_emulator::scoped_schedule shuffled(next_seed());
                cp::pack_local_moments(emulated, x.data(), g, Acc(1), b2.data(), ws.data());
                cp::pack_backward_sums(emulated, dy.data(), x.data(), g, meanh.data(), Acc(2),
                                       s2.data(), ws.data());
            }
            CHECK(b1.values() == b2.values());
            CHECK(s1.values() == s2.values());
            check_moments_block(b1.values(), xh, g, Acc(1));
            check_backward_sums(s1.values(), dyh, xh, meanh, g, Acc(2));
            const auto counters = reinterpret_cast<const unsigned*>(ws.data());
            for (std::size_t k = 0; k < kd::counter_bytes(g) / sizeof(unsigned); ++k)
                CHECK(counters[k] == 0u);
            CHECK((b1.untouched() && s1.untouched() && x.untouched() && dy.untouched() &&
                   ws.untouched()));
        }
    }
}

TEMPLATE_TEST_CASE("emulated cuda_path normalize and fused dx agree with a double reference",
                   "[kernels][bn][emulated]", float, double, __half, __nv_bfloat16) {
    using T = TestType;
    using Acc = accumulation_t<T>;
    for (const channel_geometry g : geometries) {
        const elementwise_case<T> e{g};
        for (const auto& [xoff, yoff] : elementwise_offsets<T>()) {
            CAPTURE(g.outer, g.channels, g.inner, xoff, yoff);
            host_array<T> x(e.x, xoff), dy(e.dy, xoff), y(g.size(), yoff), dx(g.size(), yoff);
            host_array<Acc> dg(e.dgamma0, 0), db(e.dbeta0, 0);
            const lockstep_emulator::scoped_schedule shuffled(next_seed());
            cp::normalize(emulated, x.data(), y.data(), g, e.mean.data(), e.scale.data(),
                          e.beta.data());
            cp::input_gradient_fused(emulated, dy.data(), x.data(), dx.data(), g, e.totals.data(),
                                     e.local.data(), &e.count, e.gamma.data(), e.mean.data(),
                                     e.invstd.data(), dg.data(), db.data());
            e.check_y(y.values());
            e.check_dx(dx.values());
            e.check_parameter_gradients(dg.values(), db.values());
            CHECK((y.untouched() && dx.untouched() && dg.untouched() && db.untouched()));
        }
    }
}

TEMPLATE_TEST_CASE("emulated cuda_path normalize with a finishing coefficient source writes "
                   "every channel's coefficients and normalizes with them",
                   "[kernels][bn][emulated]", float, double, __half, __nv_bfloat16) {
    using T = TestType;
    using Acc = accumulation_t<T>;
    for (const channel_geometry g : geometries) {
        CAPTURE(g.outer, g.channels, g.inner);
        const std::size_t C = g.channels;
        const elementwise_case<T> e{g};
        const auto running_var = values<Acc>(C, 15, 2.0, 0.1);
        host_array<T> x(e.x, 0), y(g.size(), 0);
        host_array<Acc> mean(C, 0), scale(C, 0);
        const lockstep::kernels::eval_coefficients_fn<Acc> fin{e.mean.data(),  running_var.data(),
                                                               e.gamma.data(), Acc(1e-5),
                                                               mean.data(),    scale.data()};
        // also for an empty batch
        cp::finish_and_normalize(emulated, fin, x.data(), y.data(), g, e.beta.data());
        // Every channel's coefficients against double ones from the running statistics: the
        // mean is the running mean, copied; scale = gamma / sqrt(running_var + eps) within 16
        // units of Acc's roundoff, relative (Acc rounds the sum, the square root, the quotient
        // and the product once each; a missing eps is 2.5e-6 relative here, 40 float units).
        const double tol = 16 * unit_roundoff<Acc>();
        const auto got_mean = mean.values(), got_scale = scale.values();
        std::vector<double> want_scale(C);
        for (std::size_t c = 0; c < C; ++c) {
            INFO("channel " << c);
            want_scale[c] =
                double(e.gamma[c]) / std::sqrt(double(running_var[c]) + double(Acc(1e-5)));
            CHECK(got_mean[c] == e.mean[c]);
            CHECK(std::abs(got_scale[c] - want_scale[c]) <= tol * std::abs(want_scale[c]));
        }
        // y with those coefficients: rounded once into T (elementwise_case::tol)
        const auto yv = y.values();
        element_misses m;
        for (std::size_t i = 0; i < g.size(); ++i) {
            const std::size_t c = g.channel_of(i);
            m.add(i, to_double(yv[i]),
                  (to_double(e.x[i]) - double(e.mean[c])) * want_scale[c] + double(e.beta[c]),
                  e.tol);
        }
        m.check("y");
        CHECK((y.untouched() && mean.untouched() && scale.untouched()));
    }
}

TEMPLATE_TEST_CASE("emulated cuda_path finish_and_normalize writes what the finish and the "
                   "normalize launched apart write, bit for bit",
                   "[kernels][bn][emulated]", float, double, __half, __nv_bfloat16) {
    using T = TestType;
    using Acc = accumulation_t<T>;
    for (const channel_geometry g : geometries) {
        for (const bool merged : {true, false}) {
            CAPTURE(g.outer, g.channels, g.inner, merged);
            const std::size_t C = g.channels;
            const finish_case<T> f{g, merged};
            host_array<T> x(f.x, 0);
            // [0]: one launch (the finish inside the normalize), [1]: the finish channel by
            // channel on the host, then the normalize with the arrays it wrote
            struct outputs {
                host_array<Acc> mean, invstd, scale, run_mean, run_var, kept;
                host_array<double> count, record;
                host_array<T> y;
                finish_outputs<Acc> at() {
                    return {mean.data(),    invstd.data(), scale.data(),  run_mean.data(),
                            run_var.data(), count.data(),  record.data(), kept.data()};
                }
            };
            const std::vector<Acc> zeros(C, Acc(0));
            const auto make = [&] {
                return outputs{{zeros, 0},
                               {zeros, 0},
                               {zeros, 0},
                               {f.running_mean0, 0},
                               {f.running_var0, 0},
                               {std::vector<Acc>(2 * C, Acc(-7)), 0},
                               {std::vector<double>{-1.0}, 0},
                               {std::vector<double>{-1.0, -1.0, -1.0}, 0},
                               {g.size(), 0}};
            };
            outputs o[2] = {make(), make()};
            {
                const lockstep_emulator::scoped_schedule shuffled(next_seed());
                cp::finish_and_normalize(emulated,
                                         f.finish(f.blocks.data(), f.gamma.data(), o[0].at()),
                                         x.data(), o[0].y.data(), g, f.beta.data());
            }
            const auto fin = f.finish(f.blocks.data(), f.gamma.data(), o[1].at());
            for (std::size_t c = 0; c < C; ++c)
                fin(c);
            cp::normalize(emulated, x.data(), o[1].y.data(), g, o[1].mean.data(), o[1].scale.data(),
                          f.beta.data());
            CHECK(o[0].mean.values() == o[1].mean.values());
            CHECK(o[0].invstd.values() == o[1].invstd.values());
            CHECK(o[0].scale.values() == o[1].scale.values());
            CHECK(o[0].run_mean.values() == o[1].run_mean.values());
            CHECK(o[0].run_var.values() == o[1].run_var.values());
            CHECK(o[0].count.values() == o[1].count.values());
            CHECK(o[0].record.values() == o[1].record.values());
            CHECK(o[0].kept.values() == f.kept_before());
            CHECK(o[1].kept.values() == f.kept_before());
            const auto y0 = o[0].y.values(), y1 = o[1].y.values();
            CHECK(std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(T)) == 0);
            f.check({.mean = o[0].mean.values(),
                     .invstd = o[0].invstd.values(),
                     .scale = o[0].scale.values(),
                     .running_mean = o[0].run_mean.values(),
                     .running_var = o[0].run_var.values(),
                     .y = y0});
            for (const outputs& out : o)
                CHECK((out.mean.untouched() && out.scale.untouched() && out.run_var.untouched() &&
                       out.kept.untouched() && out.record.untouched() && out.y.untouched()));
        }
    }
}

TEST_CASE("cuda_path's launch refuses a plan width that no kernel takes",
          "[kernels][bn][emulated]") {
    namespace cd = lockstep::kernels::cuda_path::detail;
    int launched = 0;
    const auto count = [&](dim3, auto) { ++launched; };
    const auto rows = cd::bn_mapping::rows;
    const auto tiles = cd::bn_mapping::tiles;
    cd::launch<float>(cd::bn_launch{.width = 4}, count);
    cd::launch<float>(cd::bn_launch{.mapping = rows, .width = 4}, count);
    cd::launch<__half>(cd::bn_launch{.width = 4}, count); // the 8-byte vector of 16-bit values
    cd::launch<__half>(cd::bn_launch{.mapping = rows, .width = 8}, count);
    cd::launch<__half>(cd::bn_launch{.mapping = tiles, .width = 8}, count);
    CHECK(launched == 5);
    CHECK_THROWS_WITH(cd::launch<float>(cd::bn_launch{.width = 2}, count),
                      Catch::Contains("width 2 fits no planes kernel of 4-byte values"));
    CHECK_THROWS_WITH(cd::launch<double>(cd::bn_launch{.width = 4}, count),
                      Catch::Contains("width 4 fits no planes kernel of 8-byte values"));
    // Only the planes kernels read 16-bit values in 8-byte vectors.
    CHECK_THROWS_WITH(cd::launch<__half>(cd::bn_launch{.mapping = rows, .width = 4}, count),
                      Catch::Contains("width 4 fits no rows kernel of 2-byte values"));
    // The tiles kernels read 16-byte vectors only.
    CHECK_THROWS_WITH(cd::launch<float>(cd::bn_launch{.mapping = tiles, .width = 1}, count),
                      Catch::Contains("width 1 fits no tiles kernel of 4-byte values"));
    CHECK_THROWS_WITH(cd::launch<__half>(cd::bn_launch{.mapping = tiles, .width = 4}, count),
                      Catch::Contains("width 4 fits no tiles kernel of 2-byte values"));
    // Edges (planes of no whole vectors) only with the 16-byte vector of the planes kernels.
    cd::launch<__half>(cd::bn_launch{.width = 8, .edges = true}, count);
    CHECK(launched == 6);
    CHECK_THROWS_WITH(cd::launch<__half>(cd::bn_launch{.width = 4, .edges = true}, count),
                      Catch::Contains("edges come with width 4"));
    CHECK_THROWS_WITH(
        cd::launch<float>(cd::bn_launch{.mapping = tiles, .width = 4, .edges = true}, count),
        Catch::Contains("edges come with width 4"));
    CHECK(launched == 6);
}

TEST_CASE("the block emulator runs a block's threads in barrier phases, in index order or "
          "shuffled, and refuses divergent barriers",
          "[emulated]") {
    // a block-wide sum through shared memory, with threads that return before the barrier
    std::vector<unsigned> out(3, 0);
    lockstep_emulator::emulate(dim3(3), 64, [&] {
        __shared__ unsigned s[64];
        s[threadIdx.x] = threadIdx.x + 1;
        __syncthreads();
        if (threadIdx.x % 2 == 1)
            return;
        __syncthreads(); // only the even threads: the odd ones have returned
        if (threadIdx.x == 0) {
            unsigned sum = 0;
            for (unsigned t = 0; t < 64; ++t)
                sum += s[t];
            out[blockIdx.x] = sum + blockIdx.x * gridDim.x;
        }
    });
    CHECK(out == std::vector<unsigned>{2080, 2083, 2086});
    // a race (thread 0's write read without a barrier) that index order hides and a shuffled
    // schedule shows; blocks in another order
    const auto racy = [](std::vector<unsigned>& order) {
        unsigned seen = 0;
        lockstep_emulator::emulate(dim3(4), 64, [&] {
            __shared__ unsigned flag;
            if (threadIdx.x == 0) {
                flag = blockIdx.x + 1;
                order.push_back(blockIdx.x);
            }
            if (flag == blockIdx.x + 1)
                ++seen;
        });
        return seen;
    };
    std::vector<unsigned> forward, shuffled;
    CHECK(racy(forward) == 4 * 64);
    CHECK(forward == std::vector<unsigned>{0, 1, 2, 3});
    {
        const lockstep_emulator::scoped_schedule schedule(7);
        {
            const lockstep_emulator::scoped_schedule inner(9);
            CHECK(lockstep_emulator::schedule_seed == 9);
        }
        CHECK(lockstep_emulator::schedule_seed == 7); // scopes nest
        CHECK(racy(shuffled) < 4 * 64);
    }
    CHECK(shuffled != forward);
    CHECK(std::is_permutation(shuffled.begin(), shuffled.end(), forward.begin(), forward.end()));
    CHECK(lockstep_emulator::schedule_seed == 0);
    // two live threads waiting at different barriers
    CHECK_THROWS_WITH(lockstep_emulator::emulate(dim3(1), 4,
                                                 [] {
                                                     if (threadIdx.x == 0)
                                                         __syncthreads();
                                                     else
                                                         __syncthreads();
                                                 }),
                      Catch::Contains("wait at different __syncthreads() calls"));
}

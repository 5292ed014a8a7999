// The CUDA batch-norm kernels (cuda_path: fused moments, normalize, backward sums, fused dx)
// against the generic Thrust path on the same device and a double host reference, for float,
// double, __half and __nv_bfloat16. Runs where a GPU exists. SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_statistics.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "bn_kernel_checks.hpp"
#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <random>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

using namespace lockstep;
using kernels::channel_geometry;
using kernels::packed_moments;
using kernels::packed_sums;
using namespace lockstep_test::bn_data;

namespace {

/// A device copy of h starting `offset` elements into its allocation (offset 1 misaligns it).
template <class U>
struct device_array {
    buffer<U, cuda_system> storage;
    std::size_t offset = 0;
    std::size_t size = 0;
    device_array(const std::vector<U>& h, const cuda_system& sys, std::size_t off = 0)
        : storage(h.size() + off, sys), offset(off), size(h.size()) {
        lockstep::copy(std::span<const U>(h), host_system{}, span(), sys);
    }
    device_array(std::size_t n, const cuda_system& sys, std::size_t off = 0)
        : storage(n + off, sys), offset(off), size(n) {}
    std::span<U> span() { return storage.span().subspan(offset, size); }
    std::span<const U> cspan() const { return storage.span().subspan(offset, size); }
    std::vector<U> download() const {
        std::vector<U> h(size);
        lockstep::copy(cspan(), storage.system(), std::span<U>(h), host_system{});
        return h;
    }
};

/// A zero-filled fused workspace.
template <class T>
buffer<std::byte, cuda_system> workspace(const channel_geometry& g, const cuda_system& sys) {
    buffer<std::byte, cuda_system> ws(kernels::bn_workspace_bytes<T>(g), sys);
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(ws.data(), 0, ws.size_bytes(), sys.stream()));
    return ws;
}

} // namespace

TEMPLATE_TEST_CASE("cuda_path moments and backward sums agree with the generic path and a "
                   "double reference",
                   "[kernels][bn][cuda][gpu]", float, double, __half, __nv_bfloat16) {
    using T = TestType;
    using Acc = kernels::accumulation_t<T>;
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system sys(0);
    for (const channel_geometry g : geometries) {
        for (const std::size_t off : reduction_offsets<T>()) {
            CAPTURE(g.outer, g.channels, g.inner, off);
            const std::size_t C = g.channels;
            const auto xh = values<T>(g.size(), 3, 50.0, 2.0); // mean >> std: stability matters
            const auto dyh = values<T>(g.size(), 4, 0.0, 1.0);
            const auto meanh = channel_means<Acc>(C);
            device_array<T> x(xh, sys, off), dy(dyh, sys, off);
            device_array<Acc> mean(meanh, sys);
            auto ws = workspace<T>(g, sys);
            auto ws_generic = workspace<T>(g, sys);

            // K1 twice in a row (the arrival counters must be back at zero) and the generic path
            const std::vector<Acc> sentinel(packed_moments::size(C), Acc(-7));
            device_array<Acc> b1(sentinel, sys), b2(sentinel, sys), bg(sentinel, sys);
            kernels::pack_local_moments(sys, x.cspan(), g, Acc(1), b1.span(), ws.span());
            kernels::pack_local_moments(sys, x.cspan(), g, Acc(1), b2.span(), ws.span());
            kernels::pack_local_moments_generic(sys, x.cspan(), g, Acc(1), bg.span(),
                                                ws_generic.span());

            // K4 twice, sharing the workspace with K1, and the generic path
            const std::vector<Acc> sum_sentinel(packed_sums::size(C), Acc(-7));
            device_array<Acc> s1(sum_sentinel, sys), s2(sum_sentinel, sys), sg(sum_sentinel, sys);
            kernels::pack_backward_sums(sys, dy.cspan(), x.cspan(), g, mean.cspan(), Acc(2),
                                        s1.span(), ws.span());
            kernels::pack_backward_sums(sys, dy.cspan(), x.cspan(), g, mean.cspan(), Acc(2),
                                        s2.span(), ws.span());
            kernels::pack_backward_sums_generic(sys, dy.cspan(), x.cspan(), g, mean.cspan(), Acc(2),
                                                sg.span(), ws_generic.span());
            sys.synchronize();
            const auto h1 = b1.download(), h2 = b2.download(), hg = bg.download();
            const auto t1 = s1.download(), t2 = s2.download(), tg = sg.download();
            CHECK(h1 == h2); // deterministic, and the counters were reset
            CHECK(t1 == t2);
            for (const auto& b : {h1, hg})
                check_moments_block(b, xh, g, Acc(1));
            for (const auto& t : {t1, tg})
                check_backward_sums(t, dyh, xh, meanh, g, Acc(2));
        }
    }
}

TEMPLATE_TEST_CASE("cuda_path normalize and fused dx agree with the generic path and a double "
                   "reference",
                   "[kernels][bn][cuda][gpu]", float, double, __half, __nv_bfloat16) {
    using T = TestType;
    using Acc = kernels::accumulation_t<T>;
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system sys(0);
    for (const channel_geometry g : geometries) {
        const elementwise_case<T> e{g};
        for (const auto& [xoff, yoff] : elementwise_offsets<T>()) {
            CAPTURE(g.outer, g.channels, g.inner, xoff, yoff);
            device_array<T> x(e.x, sys, xoff), dy(e.dy, sys, xoff);
            device_array<Acc> mean(e.mean, sys), scale(e.scale, sys), beta(e.beta, sys);
            device_array<T> y(g.size(), sys, yoff), yg(g.size(), sys, yoff);
            kernels::normalize(sys, x.cspan(), y.span(), g, mean.cspan(), scale.cspan(),
                               beta.cspan());
            kernels::normalize_generic(sys, x.cspan(), yg.span(), g, mean.cspan(), scale.cspan(),
                                       beta.cspan());
            device_array<Acc> totals(e.totals, sys), local(e.local, sys), gamma(e.gamma, sys),
                invstd(e.invstd, sys), dg(e.dgamma0, sys), db(e.dbeta0, sys), dgg(e.dgamma0, sys),
                dbg(e.dbeta0, sys);
            device_array<double> count(std::vector<double>{e.count}, sys);
            device_array<T> dx(g.size(), sys, yoff), dxg(g.size(), sys, yoff);
            kernels::input_gradient_fused(sys, dy.cspan(), x.cspan(), dx.span(), g, totals.cspan(),
                                          local.cspan(), count.cspan().data(), gamma.cspan(),
                                          mean.cspan(), invstd.cspan(), dg.span(), db.span());
            kernels::input_gradient_fused_generic(sys, dy.cspan(), x.cspan(), dxg.span(), g,
                                                  totals.cspan(), local.cspan(),
                                                  count.cspan().data(), gamma.cspan(), mean.cspan(),
                                                  invstd.cspan(), dgg.span(), dbg.span());
            sys.synchronize();
            const auto yh = y.download(), ygh = yg.download();
            const auto dxh = dx.download(), dxgh = dxg.download();
            e.check_y(yh);
            e.check_dx(dxh);
            e.check_parameter_gradients(dg.download(), db.download());
            e.check_parameter_gradients(dgg.download(), dbg.download());
            element_misses y_generic, dx_generic; // the generic path's results, within rounding
            for (std::size_t i = 0; i < g.size(); ++i) {
                y_generic.add(i, to_double(yh[i]), to_double(ygh[i]), e.tol);
                dx_generic.add(i, to_double(dxh[i]), to_double(dxgh[i]), 4 * e.tol);
            }
            y_generic.check("y against the generic path");
            dx_generic.check("dx against the generic path");
        }
    }
}

TEST_CASE("cuda_path moments keep the count exact beyond 2^24 values in one channel",
          "[kernels][bn][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system sys(0);
    const channel_geometry g{1, 1, (std::size_t(1) << 24) + 3}; // 64 MiB of float
    std::vector<float> xh(g.size());
    for (std::size_t i = 0; i < xh.size(); ++i)
        xh[i] = static_cast<float>(i % 7) + 100.0f;
    double mu = 0, m2 = 0;
    reference_moments(xh, g, 0, mu, m2);
    device_array<float> x(xh, sys);
    auto ws = workspace<float>(g, sys);
    device_array<float> block(packed_moments::size(1), sys);
    kernels::pack_local_moments(sys, x.cspan(), g, 0.0f, block.span(), ws.span());
    sys.synchronize();
    const auto b = block.download();
    CHECK(b[packed_moments::count_hi] == 1.0f);
    CHECK(b[packed_moments::count_lo] == 3.0f);
    CHECK(packed_moments::count(b.data()) == static_cast<double>(g.per_channel()));
    // partitions of <= 2^22 values with exact counts, merged in double
    CHECK(std::abs(b[packed_moments::mean(0)] - mu) <= 1e-6 * mu);
    CHECK(std::abs(b[packed_moments::m2(0)] - m2) <= 1e-4 * m2);
}

// lockstep::half storage is processed as __half: the moments of the same bits stored as either
// type (on a stream created for the test) are the same bits.
TEST_CASE("cuda_path moments of lockstep::half storage equal those of __half bit for bit",
          "[kernels][bn][cuda][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_stream stream(0);
    const cuda_system sys = stream.system();
    const channel_geometry g{4, 8, 49};
    std::vector<lockstep::half> xh(g.size());
    std::vector<__half> xn(g.size());
    std::mt19937 gen(1);
    std::normal_distribution<float> z(0.0f, 1.0f);
    for (std::size_t i = 0; i < g.size(); ++i) {
        xh[i] = lockstep::half(z(gen));
        xn[i] = __ushort_as_half(xh[i].bits);
    }
    device_array<lockstep::half> a(xh, sys);
    device_array<__half> b(xn, sys);
    auto ws = workspace<__half>(g, sys);
    device_array<float> pa(packed_moments::size(g.channels), sys),
        pb(packed_moments::size(g.channels), sys);
    kernels::pack_local_moments(sys, a.cspan(), g, 0.0f, pa.span(), ws.span());
    kernels::pack_local_moments(sys, b.cspan(), g, 0.0f, pb.span(), ws.span());
    sys.synchronize();
    CHECK(pa.download() == pb.download());
}

TEMPLATE_TEST_CASE("cuda_path finish_and_normalize writes what the finish and the normalize "
                   "launched apart write, bit for bit",
                   "[kernels][bn][cuda][gpu]", float, double, __half, __nv_bfloat16) {
    using T = TestType;
    using Acc = kernels::accumulation_t<T>;
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system sys(0);
    for (const channel_geometry g : geometries) {
        for (const bool merged : {true, false}) {
            CAPTURE(g.outer, g.channels, g.inner, merged);
            const std::size_t C = g.channels;
            const finish_case<T> f{g, merged};
            device_array<Acc> blocks(f.blocks, sys), gamma(f.gamma, sys), beta(f.beta, sys);
            device_array<T> x(f.x, sys);
            // [0]: one launch, [1]: the generic finish pass, then the CUDA normalize
            struct outputs {
                device_array<Acc> mean, invstd, scale, run_mean, run_var, kept;
                device_array<double> count, record;
                device_array<T> y;
                finish_outputs<Acc> at() {
                    return {mean.span().data(),     invstd.span().data(),  scale.span().data(),
                            run_mean.span().data(), run_var.span().data(), count.span().data(),
                            record.span().data(),   kept.span().data()};
                }
            };
            const std::vector<Acc> zeros(C, Acc(0));
            const auto make = [&] {
                return outputs{{zeros, sys},
                               {zeros, sys},
                               {zeros, sys},
                               {f.running_mean0, sys},
                               {f.running_var0, sys},
                               {std::vector<Acc>(2 * C, Acc(-7)), sys},
                               {std::vector<double>{-1.0}, sys},
                               {std::vector<double>{-1.0, -1.0, -1.0}, sys},
                               {g.size(), sys}};
            };
            outputs o[2] = {make(), make()};
            const auto finish = [&](outputs& out) {
                return f.finish(blocks.cspan().data(), gamma.cspan().data(), out.at());
            };
            kernels::finish_and_normalize(sys, finish(o[0]), x.cspan(), o[0].y.span(), g,
                                          beta.cspan());
            kernels::bn_finish_normalize(sys, finish(o[1]), x.cspan(), o[1].y.span(), g,
                                         beta.cspan()); // qualified: the generic path
            sys.synchronize();
            CHECK(o[0].mean.download() == o[1].mean.download());
            CHECK(o[0].invstd.download() == o[1].invstd.download());
            CHECK(o[0].scale.download() == o[1].scale.download());
            CHECK(o[0].run_mean.download() == o[1].run_mean.download());
            CHECK(o[0].run_var.download() == o[1].run_var.download());
            CHECK(o[0].count.download() == o[1].count.download());
            CHECK(o[0].record.download() == o[1].record.download());
            // the running statistics kept before the update (what a skipped step restores)
            CHECK(o[0].kept.download() == f.kept_before());
            CHECK(o[1].kept.download() == f.kept_before());
            const auto y0 = o[0].y.download(), y1 = o[1].y.download();
            std::size_t differ = 0;
            for (std::size_t i = 0; i < g.size(); ++i)
                differ += to_double(y0[i]) != to_double(y1[i]) ? 1 : 0;
            CHECK(differ == 0);
            // and what was written is the normalization the statistics ask for
            f.check({.mean = o[0].mean.download(),
                     .invstd = o[0].invstd.download(),
                     .scale = o[0].scale.download(),
                     .running_mean = o[0].run_mean.download(),
                     .running_var = o[0].run_var.download(),
                     .y = y0});
        }
    }
}

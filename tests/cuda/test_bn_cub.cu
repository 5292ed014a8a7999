// The CUDA fast path of the batch-norm reductions (CUB block reductions) against the shared
// generic Thrust path on the same device and a double reference. Runs where a GPU exists.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

using namespace lockstep;
using kernels::channel_geometry;
using kernels::moments;

namespace {

template <class U>
buffer<U, cuda_system> upload(const std::vector<U>& h, const cuda_system& sys) {
    buffer<U, cuda_system> d(h.size(), sys);
    lockstep::copy(std::span<const U>(h), host_system{}, d.span(), sys);
    return d;
}
template <class U>
std::vector<U> download(const buffer<U, cuda_system>& d) {
    std::vector<U> h(d.size());
    lockstep::copy(d.span(), d.system(), std::span<U>(h), host_system{});
    return h;
}

} // namespace

TEMPLATE_TEST_CASE("CUB batch-norm reductions agree with the generic path on the GPU",
                   "[kernels][bn][cuda][gpu]", float, double) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system sys(0);
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
    for (const channel_geometry g :
         {channel_geometry{6, 5, 63}, channel_geometry{32, 64, 3136}, channel_geometry{3000, 19, 1},
          channel_geometry{0, 3, 4}, channel_geometry{1, 4, 1}}) {
        CAPTURE(g.outer, g.channels, g.inner);
        std::mt19937_64 gen(3);
        std::normal_distribution<double> z(1e3, 2.0); // large mean: stability matters
        std::vector<T> x(g.size()), dy(g.size()), mean(g.channels);
        for (auto& v : x)
            v = static_cast<T>(z(gen));
        for (auto& v : dy)
            v = static_cast<T>(z(gen) - 1e3);
        for (auto& v : mean)
            v = static_cast<T>(1e3);
        const auto dx = upload(x, sys), ddy = upload(dy, sys), dmean = upload(mean, sys);
        buffer<moments<T>, cuda_system> cub_out(g.channels, sys), gen_out(g.channels, sys);
        buffer<moments<T>, cuda_system> ws(kernels::moments_workspace_size(g), sys);
        kernels::channel_moments(sys, std::span<const T>(dx.span()), g, cub_out.span(), ws.span());
        kernels::channel_moments_generic(sys, std::span<const T>(dx.span()), g, gen_out.span(),
                                         ws.span());
        buffer<T, cuda_system> cub_sums(2 * g.channels, sys), gen_sums(2 * g.channels, sys);
        buffer<T, cuda_system> bws(kernels::backward_workspace_size(g), sys);
        kernels::backward_sums(sys, std::span<const T>(ddy.span()), std::span<const T>(dx.span()),
                               g, std::span<const T>(dmean.span()), cub_sums.span(), bws.span());
        kernels::backward_sums_generic(
            sys, std::span<const T>(ddy.span()), std::span<const T>(dx.span()), g,
            std::span<const T>(dmean.span()), gen_sums.span(), bws.span());
        sys.synchronize();
        const auto a = download(cub_out), b = download(gen_out);
        const auto sa = download(cub_sums), sb = download(gen_sums);
        for (std::size_t c = 0; c < g.channels; ++c) {
            double sum = 0, m2 = 0, sdy = 0, sdyx = 0, mag_dy = 0, mag_dyx = 0;
            for (std::size_t k = 0; k < g.per_channel(); ++k)
                sum += x[g.offset(c, k)];
            const double n = static_cast<double>(g.per_channel());
            const double mu = n > 0 ? sum / n : 0;
            for (std::size_t k = 0; k < g.per_channel(); ++k) {
                const std::size_t i = g.offset(c, k);
                m2 += (x[i] - mu) * (x[i] - mu);
                sdy += dy[i];
                sdyx += double(dy[i]) * (double(x[i]) - mean[c]);
                mag_dy += std::abs(double(dy[i]));
                mag_dyx += std::abs(double(dy[i]) * (double(x[i]) - mean[c]));
            }
            for (const auto& m : {a[c], b[c]}) {
                CHECK(m.count == n);
                CHECK(std::abs(m.mean - mu) <= tol * (std::abs(mu) + 1));
                CHECK(std::abs(m.m2 - m2) <= tol * (m2 + 1e-30) * 100); // 1e-3 for float
            }
            CHECK(std::abs(sa[c] - sdy) <= tol * (mag_dy + 1e-30));
            CHECK(std::abs(sa[c] - sb[c]) <= tol * (mag_dy + 1e-30));
            CHECK(std::abs(sa[g.channels + c] - sdyx) <= tol * (mag_dyx + 1e-30));
        }
    }
}

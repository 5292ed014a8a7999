// The bn::global GPU cases' helpers: one replica's forward and backward of a fresh layer on any
// device communicator, the double reference on the concatenated global batch, and the 16-bit
// storage case written once for any group of replicas (test_bn_nccl.cu over NCCL,
// test_shared_gpu.cu on one shared GPU). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "bn_kernel_checks.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep_test::bn_gpu {

using namespace lockstep;

template <class T>
std::vector<T> to_host(std::span<const T> s, const cuda_system& sys) {
    std::vector<T> h(s.size());
    copy(s, sys, std::span<T>(h), host_system{});
    return h;
}
template <class T>
buffer<T, cuda_system> to_device(const std::vector<T>& h, const cuda_system& sys) {
    buffer<T, cuda_system> d(h.size(), sys);
    copy(std::span<const T>(h), host_system{}, d.span(), sys);
    return d;
}

using bn_data::to_double;
using bn_data::to_value;

/// One replica's results, on the host.
struct bn_out {
    std::vector<double> y, dx, dgamma, dbeta, mean, invstd, running_mean, running_var;
};

/// Forward (training) and backward of a fresh bn::global layer of `channels` channels on this
/// replica's part: x and dy in storage type T, Layout order, `shape` = this replica's shape.
template <class T, class Layout, class Comm>
bn_out run_layer(Comm& comm, const std::vector<T>& x, const std::vector<T>& dy,
                 const nn::tensor_shape& shape, std::size_t channels) {
    const cuda_system sys = comm.system();
    nn::batch_norm<T, bn::global, Layout, cuda_system> layer(comm, channels);
    auto dx_dev = to_device(x, sys); // sized like x; overwritten
    auto y_dev = to_device(x, sys);
    auto x_dev = to_device(x, sys);
    auto dy_dev = to_device(dy, sys);
    layer.forward_train(comm, std::span<const T>(x_dev.span()), shape, y_dev.span());
    layer.backward(comm, std::span<const T>(dy_dev.span()), dx_dev.span());
    comm.synchronize();
    auto widen = [](const auto& v) {
        std::vector<double> d(v.size());
        for (std::size_t i = 0; i < v.size(); ++i)
            d[i] = to_double(v[i]);
        return d;
    };
    using P = typename decltype(layer)::param_type;
    bn_out out;
    out.y = widen(to_host(std::span<const T>(y_dev.span()), sys));
    out.dx = widen(to_host(std::span<const T>(dx_dev.span()), sys));
    out.dgamma = widen(to_host(std::span<const P>(layer.dgamma()), sys));
    out.dbeta = widen(to_host(std::span<const P>(layer.dbeta()), sys));
    out.mean = widen(to_host(layer.batch_mean(), sys));
    out.invstd = widen(to_host(layer.batch_invstd(), sys));
    out.running_mean = widen(to_host(std::span<const P>(layer.running_mean()), sys));
    out.running_var = widen(to_host(std::span<const P>(layer.running_var()), sys));
    return out;
}

/// Where element (sample n, channel c, spatial s) of an (N, C, HW) tensor lives in Layout.
template <class Layout>
std::size_t index(std::size_t n, std::size_t c, std::size_t s, std::size_t C, std::size_t HW) {
    if constexpr (std::is_same_v<Layout, nn::nhwc>)
        return (n * HW + s) * C + c;
    else
        return (n * C + c) * HW + s;
}

/// The double reference of forward + backward over the whole batch of N x C x HW values with
/// x(i) and dy(i) given by flat index i: per-channel statistics and gradient sums, from which
/// y and dx of any element follow.
struct reference {
    std::size_t count = 0;
    std::vector<double> mean, var, invstd, sum_dy, sum_dy_xhat, dgamma_abs, dbeta_abs;
    double y(double x, std::size_t c) const { return (x - mean[c]) * invstd[c]; }
    double dx(double x, double dy, std::size_t c) const {
        const double n = double(count);
        return invstd[c] * (dy - sum_dy[c] / n - y(x, c) * sum_dy_xhat[c] / n);
    }
    double running_mean(std::size_t c) const { return 0.1 * mean[c]; }
    double running_var(std::size_t c) const {
        return 0.9 + 0.1 * var[c] * double(count) / double(count - 1);
    }
};

/// requires: at(c, k) enumerates the k-th of `count` values of channel c as (x, dy).
template <class At>
reference make_reference(std::size_t C, std::size_t count, At at) {
    reference r;
    r.count = count;
    r.mean.assign(C, 0);
    r.var.assign(C, 0);
    r.invstd.assign(C, 0);
    r.sum_dy.assign(C, 0);
    r.sum_dy_xhat.assign(C, 0);
    r.dgamma_abs.assign(C, 0);
    r.dbeta_abs.assign(C, 0);
    for (std::size_t c = 0; c < C; ++c) {
        double m = 0, m2 = 0;
        for (std::size_t k = 0; k < count; ++k) { // Welford, in double
            const double x = at(c, k).first;
            const double d = x - m;
            m += d / double(k + 1);
            m2 += d * (x - m);
        }
        r.mean[c] = m;
        r.var[c] = m2 / double(count);
        r.invstd[c] = 1.0 / std::sqrt(r.var[c] + 1e-5);
        for (std::size_t k = 0; k < count; ++k) {
            const auto [x, dy] = at(c, k);
            r.sum_dy[c] += dy;
            r.sum_dy_xhat[c] += dy * r.y(x, c);
            r.dgamma_abs[c] += std::abs(dy * r.y(x, c));
            r.dbeta_abs[c] += std::abs(dy);
        }
    }
    return r;
}

template <class T, class L>
struct format_case {
    using storage = T;
    using layout = L;
};

// Tolerances (u = the format's unit roundoff: 2^-11 for __half, 2^-8 for __nv_bfloat16): x and
// dy are exactly representable (the reference starts from the rounded values), statistics are
// float, y and dx are rounded once to T: |y - ref| <= 2u |ref| + 1e-4, |dx - ref| <= 2u |ref| +
// 1e-4 max|dx_ref|; dgamma, dbeta and the running statistics are float: 1e-5 relative to the sum
// of the magnitudes they add up (1e-5 (1 + |ref|) for the running statistics).
/// One bn::global layer with storage T in layout L on every replica of `group` (replica r holds
/// 2 + r samples of 5 channels, 3 x 4 spatial) against the double reference.
template <class T, class L, class Group>
void check_16bit_layer(Group& group) {
    const double u = std::is_same_v<T, __half> ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    constexpr std::size_t C = 5, H = 3, W = 4, HW = H * W;
    const auto R = static_cast<std::size_t>(group.size());
    std::vector<std::size_t> first(R + 1, 0); // replica r holds samples [first[r], first[r+1])
    for (std::size_t r = 0; r < R; ++r)
        first[r + 1] = first[r] + 2 + r;
    const std::size_t N = first[R];
    std::vector<T> x(N * C * HW), dy(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = to_value<T>(2.0 + 1.5 * std::sin(0.37 * double(i)));
        dy[i] = to_value<T>(std::cos(0.23 * double(i) + 0.5));
    }
    std::vector<bn_out> outs(R);
    group.run([&](auto& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::size_t b = first[r] * C * HW, e = first[r + 1] * C * HW;
        const std::vector<T> xs(x.begin() + b, x.begin() + e), dys(dy.begin() + b, dy.begin() + e);
        const std::size_t n = first[r + 1] - first[r];
        const nn::tensor_shape shape = std::is_same_v<L, nn::nhwc> ? nn::tensor_shape{n, H, W, C}
                                                                   : nn::tensor_shape{n, C, H, W};
        outs[r] = run_layer<T, L>(comm, xs, dys, shape, C);
    });
    const reference ref = make_reference(C, N * HW, [&](std::size_t c, std::size_t k) {
        const std::size_t i = index<L>(k / HW, c, k % HW, C, HW);
        return std::pair<double, double>(to_double(x[i]), to_double(dy[i]));
    });
    double max_dx = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
        const std::size_t c = std::is_same_v<L, nn::nhwc> ? i % C : (i / HW) % C;
        max_dx = std::max(max_dx, std::abs(ref.dx(to_double(x[i]), to_double(dy[i]), c)));
    }
    std::vector<double> dgamma(C, 0), dbeta(C, 0);
    for (std::size_t r = 0; r < R; ++r) {
        const bn_out& o = outs[r];
        for (std::size_t k = 0; k < o.y.size(); ++k) {
            const std::size_t i = first[r] * C * HW + k;
            const std::size_t c = std::is_same_v<L, nn::nhwc> ? i % C : (i / HW) % C;
            const double y = ref.y(to_double(x[i]), c);
            const double d = ref.dx(to_double(x[i]), to_double(dy[i]), c);
            INFO("replica " << r << " element " << k);
            CHECK(std::abs(o.y[k] - y) <= 2 * u * std::abs(y) + 1e-4);
            CHECK(std::abs(o.dx[k] - d) <= 2 * u * std::abs(d) + 1e-4 * max_dx);
        }
        for (std::size_t c = 0; c < C; ++c) {
            dgamma[c] += o.dgamma[c];
            dbeta[c] += o.dbeta[c];
            CHECK(std::abs(o.running_mean[c] - ref.running_mean(c)) <=
                  1e-5 * (1 + std::abs(ref.running_mean(c))));
            CHECK(std::abs(o.running_var[c] - ref.running_var(c)) <=
                  1e-5 * (1 + std::abs(ref.running_var(c))));
        }
    }
    for (std::size_t c = 0; c < C; ++c) {
        CHECK(std::abs(dgamma[c] - ref.sum_dy_xhat[c]) <= 1e-5 * ref.dgamma_abs[c] + 1e-6);
        CHECK(std::abs(dbeta[c] - ref.sum_dy[c]) <= 1e-5 * ref.dbeta_abs[c] + 1e-6);
    }
}

/// Checks replica outputs of a float layer against the reference, elements by global flat index.
inline void check_float_layer(const std::vector<bn_out>& outs,
                              const std::vector<std::size_t>& offset, const reference& ref,
                              const std::function<double(std::size_t)>& x,
                              const std::function<double(std::size_t)>& dy,
                              const std::function<std::size_t(std::size_t)>& channel) {
    const std::size_t C = ref.mean.size();
    std::vector<double> dgamma(C, 0), dbeta(C, 0);
    std::size_t bad_y = 0, bad_dx = 0;
    for (std::size_t r = 0; r < outs.size(); ++r) {
        const bn_out& o = outs[r];
        for (std::size_t k = 0; k < o.y.size(); ++k) {
            const std::size_t i = offset[r] + k;
            const std::size_t c = channel(i);
            const double y = ref.y(x(i), c);
            bad_y += std::abs(o.y[k] - y) > 1e-4 * (1 + std::abs(y));
            const double d = ref.dx(x(i), dy(i), c);
            bad_dx += std::abs(o.dx[k] - d) > 1e-4 * (1 + std::abs(d));
        }
        for (std::size_t c = 0; c < C; ++c) {
            dgamma[c] += o.dgamma[c];
            dbeta[c] += o.dbeta[c];
            INFO("replica " << r << " channel " << c);
            CHECK(std::abs(o.mean[c] - ref.mean[c]) <= 1e-5 * (std::abs(ref.mean[c]) + 1));
            CHECK(std::abs(o.invstd[c] - ref.invstd[c]) <= 1e-4 * ref.invstd[c]);
            CHECK(std::abs(o.running_mean[c] - ref.running_mean(c)) <=
                  1e-5 * (1 + std::abs(ref.running_mean(c))));
            CHECK(std::abs(o.running_var[c] - ref.running_var(c)) <=
                  1e-5 * (1 + std::abs(ref.running_var(c))));
        }
    }
    CHECK(bad_y == 0);
    CHECK(bad_dx == 0);
    for (std::size_t c = 0; c < C; ++c) {
        INFO("channel " << c);
        CHECK(std::abs(dgamma[c] - ref.sum_dy_xhat[c]) <= 1e-5 * ref.dgamma_abs[c] + 1e-6);
        CHECK(std::abs(dbeta[c] - ref.sum_dy[c]) <= 1e-5 * ref.dbeta_abs[c] + 1e-6);
    }
}

} // namespace lockstep_test::bn_gpu

// tests/nn/bn_reference.hpp: a naive double-precision batch-norm reference over a whole batch
// (two-pass statistics, textbook gradients), with its own indexing per layout.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/nn/layout.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <type_traits>
#include <vector>

namespace bn_test {

/// A batch of N samples with C channels and S = H * W spatial positions (S = 1 for nc).
struct dims {
    std::size_t n, c, h, w;
    std::size_t s() const { return h * w; }
    std::size_t size() const { return n * c * h * w; }
};

/// The offset of (sample, channel, position) in Layout, computed independently of the library.
template <class Layout>
std::size_t index(const dims& d, std::size_t n, std::size_t c, std::size_t s) {
    if constexpr (std::is_same_v<Layout, lockstep::nn::nchw>)
        return (n * d.c + c) * d.s() + s;
    else
        return (n * d.s() + s) * d.c + c; // nhwc, and nc with s == 0
}

/// The shape the layer takes for dims in Layout.
template <class Layout>
lockstep::nn::tensor_shape shape_of(const dims& d) {
    if constexpr (std::is_same_v<Layout, lockstep::nn::nchw>)
        return {d.n, d.c, d.h, d.w};
    else if constexpr (std::is_same_v<Layout, lockstep::nn::nhwc>)
        return {d.n, d.h, d.w, d.c};
    else
        return {d.n, d.c};
}

/// dims for Layout: nc ignores h and w.
template <class Layout>
dims make_dims(std::size_t n, std::size_t c, std::size_t h, std::size_t w) {
    if constexpr (std::is_same_v<Layout, lockstep::nn::nc>)
        return {n, c, 1, 1};
    else
        return {n, c, h, w};
}

/// Normal values with per-channel offsets, so channels differ: value = mean_c + spread * z.
template <class T>
std::vector<T> random_values(std::size_t count, unsigned seed, double offset = 0.0,
                             double spread = 1.0) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> z(0.0, 1.0);
    std::vector<T> v(count);
    for (auto& e : v)
        e = static_cast<T>(offset + spread * z(gen));
    return v;
}

/// Everything single-device batch norm produces for one training step.
struct result {
    std::vector<double> mean, var;            // batch mean and biased variance per channel
    std::vector<double> y, dx, dgamma, dbeta; // outputs and gradients
    std::vector<double> running_mean, running_var;
};

/// One training step of batch norm over the whole batch x (layout Layout), then backward of dy.
/// running_* are the statistics before the step; they are updated with momentum and the
/// unbiased variance.
template <class Layout, class T>
result reference(const dims& d, const std::vector<T>& x, const std::vector<T>& dy,
                 const std::vector<double>& gamma, const std::vector<double>& beta, double eps,
                 double momentum, std::vector<double> running_mean,
                 std::vector<double> running_var) {
    result r;
    const double m = static_cast<double>(d.n * d.s());
    r.mean.assign(d.c, 0.0);
    r.var.assign(d.c, 0.0);
    r.dgamma.assign(d.c, 0.0);
    r.dbeta.assign(d.c, 0.0);
    r.y.assign(d.size(), 0.0);
    r.dx.assign(d.size(), 0.0);
    for (std::size_t c = 0; c < d.c; ++c) {
        double sum = 0;
        for (std::size_t n = 0; n < d.n; ++n)
            for (std::size_t s = 0; s < d.s(); ++s)
                sum += static_cast<double>(x[index<Layout>(d, n, c, s)]);
        const double mu = sum / m;
        double sq = 0;
        for (std::size_t n = 0; n < d.n; ++n)
            for (std::size_t s = 0; s < d.s(); ++s) {
                const double e = static_cast<double>(x[index<Layout>(d, n, c, s)]) - mu;
                sq += e * e;
            }
        const double var = sq / m;
        const double invstd = 1.0 / std::sqrt(var + eps);
        r.mean[c] = mu;
        r.var[c] = var;
        double sdy = 0, sdyxhat = 0;
        for (std::size_t n = 0; n < d.n; ++n)
            for (std::size_t s = 0; s < d.s(); ++s) {
                const std::size_t i = index<Layout>(d, n, c, s);
                const double xhat = (static_cast<double>(x[i]) - mu) * invstd;
                r.y[i] = gamma[c] * xhat + beta[c];
                sdy += static_cast<double>(dy[i]);
                sdyxhat += static_cast<double>(dy[i]) * xhat;
            }
        r.dgamma[c] = sdyxhat;
        r.dbeta[c] = sdy;
        for (std::size_t n = 0; n < d.n; ++n)
            for (std::size_t s = 0; s < d.s(); ++s) {
                const std::size_t i = index<Layout>(d, n, c, s);
                const double xhat = (static_cast<double>(x[i]) - mu) * invstd;
                r.dx[i] =
                    gamma[c] * invstd / m * (m * static_cast<double>(dy[i]) - sdy - xhat * sdyxhat);
            }
        if (m > 1) {
            running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mu;
            running_var[c] = (1 - momentum) * running_var[c] + momentum * sq / (m - 1);
        }
    }
    r.running_mean = std::move(running_mean);
    r.running_var = std::move(running_var);
    return r;
}

/// max |a - b| / max |b|: the error relative to the scale of the reference (elementwise
/// relative error is meaningless for values near zero).
template <class A>
double rel_error(const A& a, const std::vector<double>& b) {
    double diff = 0, scale = 0;
    for (std::size_t i = 0; i < b.size(); ++i) {
        diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
        scale = std::max(scale, std::abs(b[i]));
    }
    return scale > 0 ? diff / scale : diff;
}

/// The tolerance the issue states: 1e-5 for float, 1e-12 for double.
template <class T>
constexpr double tolerance() {
    return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

} // namespace bn_test

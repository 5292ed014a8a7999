// The batch-norm kernel tests' data, references and checks, shared by the device test
// (test_bn_cuda.cu) and the emulated one (test_bn_emulated.cpp): values in the CUDA storage
// types, their precision, the geometries that reach every mapping and width, and each kernel's
// results against double references over the same inputs. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/bn_statistics.hpp"
#include "lockstep/kernels/channel_geometry.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <random>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep_test::bn_data {

using lockstep::kernels::channel_geometry;
using lockstep::kernels::packed_moments;
using lockstep::kernels::packed_sums;

template <class T>
T to_value(double v) {
    if constexpr (std::is_same_v<T, __half>)
        return __float2half_rn(static_cast<float>(v));
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __float2bfloat16_rn(static_cast<float>(v));
    else
        return static_cast<T>(v);
}
template <class T>
double to_double(T v) {
    if constexpr (std::is_same_v<T, __half>)
        return __half2float(v);
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat162float(v);
    else
        return static_cast<double>(v);
}

/// Unit roundoff of the storage type (the error of rounding one result into it).
template <class T>
constexpr double unit_roundoff() {
    if constexpr (std::is_same_v<T, __half>)
        return lockstep::half::unit_roundoff; // 2^-11
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return lockstep::bfloat16::unit_roundoff; // 2^-8
    else if constexpr (std::is_same_v<T, float>)
        return 0x1p-24;
    else
        return 0x1p-53;
}

/// Relative tolerance of the accumulations (Acc = float, or double for double data).
template <class T>
constexpr double acc_tolerance() {
    return std::is_same_v<T, double> ? 1e-12 : 2e-5;
}

template <class T>
std::vector<T> values(std::size_t n, unsigned seed, double mean, double stddev) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> z(mean, stddev);
    std::vector<T> v(n);
    for (auto& e : v)
        e = to_value<T>(z(gen));
    return v;
}

/// Two-pass double moments of channel c.
template <class T>
void reference_moments(const std::vector<T>& x, const channel_geometry& g, std::size_t c,
                       double& mean, double& m2) {
    const double n = static_cast<double>(g.per_channel());
    double s = 0;
    for (std::size_t k = 0; k < g.per_channel(); ++k)
        s += to_double(x[g.offset(c, k)]);
    mean = n > 0 ? s / n : 0;
    m2 = 0;
    for (std::size_t k = 0; k < g.per_channel(); ++k) {
        const double e = to_double(x[g.offset(c, k)]) - mean;
        m2 += e * e;
    }
}

inline const std::vector<channel_geometry> geometries{
    {6, 5, 63},     // NCHW, odd small planes, channels no whole tile: one value at a time
    {4, 3, 263},    // NCHW, odd planes over 1 KiB: one value at a time
    {4, 3, 197},    // NCHW, odd planes, partitions ending inside planes
    {8, 16, 3136},  // NCHW 56x56 planes: vectors, several partitions per channel
    {256, 20, 49},  // NCHW 7x7: tiles of float (7 partitions) and double, half one at a time
    {40, 16, 49},   // NCHW 7x7: tiles of 8 half channels, 4 float, 2 double
    {64, 8, 9},     // NCHW 3x3: tiles of 9 vectors, 28 samples a block round
    {30, 12, 6},    // NCHW 2x3: tiles of 2 float, 4 half channels; vectors of double
    {16, 8, 1225},  // NCHW 35x35, too wide for a tile: vectors inside planes, edges by value
    {4, 8, 289},    // NCHW 17x17 likewise, one partition
    {32, 10, 196},  // NCHW 14x14 planes: 16-byte vectors of float and double, 8-byte of half
    {16, 6, 8},     // NCHW planes of two float vectors, of two 8-byte half vectors
    {3000, 19, 1},  // NHWC rows, channels not a multiple of the vector width (scalar path)
    {1000, 64, 1},  // NHWC rows, vector path
    {50000, 24, 1}, // NHWC, 256 row partitions folded by a channel tile that is partly empty
    {37, 20000, 1}, // N x C with C = 20000 > 16384 channel tiles
    {1, 4, 1},      // one value per channel
    {0, 3, 16},     // empty batch
};

/// Where the reductions' inputs start, in values from a 16-byte boundary: aligned, misaligned,
/// and 8 bytes off for 16-bit values (8-byte vectors where the planes allow).
template <class T>
std::vector<std::size_t> reduction_offsets() {
    return {0, 1, 8 / sizeof(T)};
}

/// The elementwise kernels' (x and dy, y or dx) offsets: aligned (vectors where the plan
/// allows), equally and differently misaligned (one value at a time), 8 bytes off (8-byte
/// vectors of 16-bit values).
template <class T>
std::vector<std::pair<std::size_t, std::size_t>> elementwise_offsets() {
    return {{0, 0}, {1, 1}, {1, 0}, {8 / sizeof(T), 8 / sizeof(T)}};
}

/// The means the backward sums subtract: one per channel, near the data's 50 and different for
/// neighbouring channels, so a kernel that subtracts another channel's mean shows.
template <class Acc>
std::vector<Acc> channel_means(std::size_t channels) {
    std::vector<Acc> m(channels);
    for (std::size_t c = 0; c < channels; ++c)
        m[c] = Acc(48 + static_cast<int>(c % 5));
    return m;
}

/// A packed statistics block (pack_local_moments) of x with status `status`: the status, the
/// exact count and each channel's mean and M2 against reference_moments.
template <class T, class Acc>
void check_moments_block(const std::vector<Acc>& b, const std::vector<T>& x,
                         const channel_geometry& g, Acc status) {
    const double tol = acc_tolerance<T>();
    CHECK(b[packed_moments::status] == status);
    CHECK(packed_moments::count(b.data()) == static_cast<double>(g.per_channel()));
    for (std::size_t c = 0; c < g.channels; ++c) {
        double mu = 0, m2 = 0;
        reference_moments(x, g, c, mu, m2);
        CHECK(std::abs(b[packed_moments::mean(c)] - mu) <= tol * (std::abs(mu) + 1));
        // M2 of data with mean 50 and std 2: float Welford loses ~1e-3 relative
        CHECK(std::abs(b[packed_moments::m2(c)] - m2) <= tol * 100 * (m2 + 1e-30));
    }
}

/// Packed backward sums (pack_backward_sums) of dy and x about `mean` with status `status`:
/// each channel's sum dy and sum dy (x - mean) against double sums, within the accumulation's
/// tolerance of the sums of magnitudes.
template <class T, class Acc>
void check_backward_sums(const std::vector<Acc>& t, const std::vector<T>& dy,
                         const std::vector<T>& x, const std::vector<Acc>& mean,
                         const channel_geometry& g, Acc status) {
    const double tol = acc_tolerance<T>();
    const std::size_t C = g.channels;
    CHECK(t[packed_sums::status(C)] == status);
    for (std::size_t c = 0; c < C; ++c) {
        double sdy = 0, sdyx = 0, mag_dy = 0, mag_dyx = 0;
        for (std::size_t k = 0; k < g.per_channel(); ++k) {
            const std::size_t i = g.offset(c, k);
            const double d = to_double(dy[i]), e = to_double(x[i]) - mean[c];
            sdy += d;
            sdyx += d * e;
            mag_dy += std::abs(d);
            mag_dyx += std::abs(d * e);
        }
        CHECK(std::abs(t[c] - sdy) <= tol * (mag_dy + 1e-30));
        CHECK(std::abs(t[C + c] - sdyx) <= tol * (mag_dyx + 1e-30));
    }
}

/// Elementwise results against their references, in one assertion per array (a million
/// passing CHECKs cost seconds): how many miss |got - want| <= rel (|want| + 1), and the first.
struct element_misses {
    std::size_t count = 0;
    std::size_t first = 0;
    double got = 0;
    double want = 0;
    void add(std::size_t i, double got_i, double want_i, double rel) {
        if (std::abs(got_i - want_i) <= rel * (std::abs(want_i) + 1))
            return;
        if (count++ == 0) {
            first = i;
            got = got_i;
            want = want_i;
        }
    }
    void check(const char* what) const {
        INFO(what << ": " << count << " element(s) off, the first at " << first << ": " << got
                  << " where " << want << " was expected");
        CHECK(count == 0);
    }
};

/// The inputs of the elementwise kernels (normalize, input_gradient_fused) over g, each from its
/// own seed, and their double references.
template <class T>
struct elementwise_case {
    using Acc = lockstep::kernels::accumulation_t<T>;
    channel_geometry g;
    std::vector<T> x = values<T>(g.size(), 5, 1.0, 3.0);
    std::vector<T> dy = values<T>(g.size(), 6, 0.0, 1.0);
    std::vector<Acc> mean = values<Acc>(g.channels, 7, 1.0, 0.5);
    std::vector<Acc> scale = values<Acc>(g.channels, 8, 1.0, 0.5);
    std::vector<Acc> beta = values<Acc>(g.channels, 9, 0.0, 1.0);
    std::vector<Acc> local = values<Acc>(2 * g.channels, 10, 0.0, 5.0);
    std::vector<Acc> totals = tripled(local);
    std::vector<Acc> gamma = values<Acc>(g.channels, 11, 1.0, 0.3);
    std::vector<Acc> invstd = values<Acc>(g.channels, 12, 2.0, 0.2);
    std::vector<Acc> dgamma0 = values<Acc>(g.channels, 13, 0.0, 1.0);
    std::vector<Acc> dbeta0 = values<Acc>(g.channels, 14, 0.0, 1.0);
    double count = 3.0 * static_cast<double>(g.per_channel()) + 1.0;

    /// A result rounded into T, computed in Acc from values of magnitude <= |want| + 1.
    static constexpr double tol = unit_roundoff<T>() + 4 * acc_tolerance<T>();

    static std::vector<Acc> tripled(const std::vector<Acc>& v) {
        std::vector<Acc> t(v.size());
        for (std::size_t j = 0; j < v.size(); ++j)
            t[j] = Acc(3) * v[j];
        return t;
    }
    double want_y(std::size_t i) const {
        const std::size_t c = g.channel_of(i);
        return (to_double(x[i]) - mean[c]) * double(scale[c]) + double(beta[c]);
    }
    double want_dx(std::size_t i) const {
        const std::size_t c = g.channel_of(i);
        const std::size_t C = g.channels;
        const double inv = invstd[c];
        const double a = totals[c] / count;
        const double b = inv * inv * totals[C + c] / count;
        return gamma[c] * inv * (to_double(dy[i]) - a - (to_double(x[i]) - mean[c]) * b);
    }
    /// y (normalize with mean, scale, beta) against want_y.
    void check_y(const std::vector<T>& y) const {
        element_misses m;
        for (std::size_t i = 0; i < g.size(); ++i)
            m.add(i, to_double(y[i]), want_y(i), tol);
        m.check("y");
    }
    /// dx (input_gradient_fused) against want_dx.
    void check_dx(const std::vector<T>& dx) const {
        element_misses m;
        for (std::size_t i = 0; i < g.size(); ++i)
            m.add(i, to_double(dx[i]), want_dx(i), 2 * tol);
        m.check("dx");
    }
    /// The parameter gradients, added exactly once per channel to dgamma0 and dbeta0 (twice
    /// would be off by a whole local sum).
    void check_parameter_gradients(const std::vector<Acc>& dg, const std::vector<Acc>& db) const {
        const std::size_t C = g.channels;
        const double eps = 4 * acc_tolerance<T>();
        for (std::size_t c = 0; c < C; ++c) {
            const double want_g = dgamma0[c] + double(local[C + c]) * invstd[c];
            const double want_b = double(dbeta0[c]) + local[c];
            CHECK(std::abs(dg[c] - want_g) <= eps * (std::abs(want_g) + 1));
            CHECK(std::abs(db[c] - want_b) <= eps * (std::abs(want_b) + 1));
        }
    }
};

/// Where finish_statistics_fn writes (device or host pointers): the coefficients, the running
/// statistics, the count, the layer's error record and the kept running statistics.
template <class Acc>
struct finish_outputs {
    Acc* mean;
    Acc* invstd;
    Acc* scale;
    Acc* running_mean;
    Acc* running_var;
    double* count;
    double* record; ///< 3 doubles: a layer_error_record
    Acc* kept;      ///< 2 C: kept_mean, then kept_var
};

/// A layer's finish over three replicas' statistics blocks (counts n + r, means near 1, M2 near
/// n + r), this replica the second, normalizing with the merged statistics or its own, and the
/// inputs of the normalization that follows it in one launch (finish_and_normalize).
template <class T>
struct finish_case {
    using Acc = lockstep::kernels::accumulation_t<T>;
    static constexpr int replicas = 3;
    channel_geometry g;
    bool merged;
    std::size_t stride = packed_moments::size(g.channels);
    std::vector<Acc> blocks = make_blocks(g, stride);
    std::vector<T> x = values<T>(g.size(), 21, 1.0, 3.0);
    std::vector<Acc> gamma = values<Acc>(g.channels, 22, 1.0, 0.3);
    std::vector<Acc> beta = values<Acc>(g.channels, 23, 0.0, 1.0);
    std::vector<Acc> running_mean0 = values<Acc>(g.channels, 24, 0.0, 1.0);
    std::vector<Acc> running_var0 = values<Acc>(g.channels, 25, 2.0, 0.1);

    static std::vector<Acc> make_blocks(const channel_geometry& geometry, std::size_t stride) {
        const std::size_t C = geometry.channels;
        std::vector<Acc> b(replicas * stride);
        const auto stats = values<Acc>(2 * C * replicas, 20, 1.0, 0.5);
        for (int r = 0; r < replicas; ++r) {
            Acc* block = b.data() + static_cast<std::size_t>(r) * stride;
            const std::size_t n = geometry.per_channel() + static_cast<std::size_t>(r);
            packed_moments::split_count(n, block[packed_moments::count_hi],
                                        block[packed_moments::count_lo]);
            for (std::size_t c = 0; c < C; ++c) {
                block[packed_moments::mean(c)] = stats[(r * C + c) * 2];
                block[packed_moments::m2(c)] =
                    static_cast<Acc>(n) * std::abs(stats[(r * C + c) * 2 + 1]);
            }
        }
        return b;
    }

    /// The finish over `blocks_at` (where `blocks` lies) with gamma at `gamma_at`, writing `out`.
    lockstep::kernels::finish_statistics_fn<Acc> finish(const Acc* blocks_at, const Acc* gamma_at,
                                                        const finish_outputs<Acc>& out) const {
        return lockstep::kernels::finish_statistics_fn<Acc>{
            .blocks = blocks_at,
            .stride = stride,
            .count_blocks = replicas,
            .self = 1,
            .running_first = 0,
            .running_last = replicas,
            .normalize_merged = merged,
            .world_offset = 0,
            .gamma = gamma_at,
            .eps = Acc(1e-5),
            .momentum = Acc(0.1),
            .mean = out.mean,
            .invstd = out.invstd,
            .scale = out.scale,
            .running_mean = out.running_mean,
            .running_var = out.running_var,
            .count = out.count,
            .report =
                lockstep::kernels::layer_report{
                    .first = reinterpret_cast<lockstep::kernels::layer_error_record*>(out.record)},
            .kept_mean = out.kept,
            .kept_var = out.kept + g.channels};
    }

    /// The running statistics as they were before the finish (what it keeps).
    std::vector<Acc> kept_before() const {
        std::vector<Acc> before(running_mean0);
        before.insert(before.end(), running_var0.begin(), running_var0.end());
        return before;
    }

    /// What a finish wrote, and y, the normalization after it, on the host.
    struct written {
        std::vector<Acc> mean, invstd, scale, running_mean, running_var;
        std::vector<T> y;
    };

    /// The merge of the blocks r in [0, replicas) that `use(r)` selects, in double from their
    /// counts, means and M2 (the finish's raw data): count, mean and M2 of the union.
    template <class Use>
    std::tuple<double, double, double> merged_moments(std::size_t c, Use use) const {
        double n = 0, s = 0;
        for (int r = 0; r < replicas; ++r) {
            const Acc* b = blocks.data() + static_cast<std::size_t>(r) * stride;
            if (use(r)) {
                n += packed_moments::count(b);
                s += packed_moments::count(b) * double(b[packed_moments::mean(c)]);
            }
        }
        const double mean = n > 0 ? s / n : 0;
        double m2 = 0;
        for (int r = 0; r < replicas; ++r) {
            const Acc* b = blocks.data() + static_cast<std::size_t>(r) * stride;
            if (use(r)) {
                const double d = double(b[packed_moments::mean(c)]) - mean;
                m2 += double(b[packed_moments::m2(c)]) + packed_moments::count(b) * d * d;
            }
        }
        return {n, mean, m2};
    }

    /// What the finish wrote and y against double references computed from the blocks alone:
    /// the normalization statistics (merged, or this replica's block), invstd = 1 / sqrt(M2 / n +
    /// eps), scale = gamma invstd, the running statistics over every block (momentum 0.1, the
    /// unbiased variance), and y = (x - mean) scale + beta with the reference's mean and scale.
    /// Tolerances (tol = acc_tolerance): mean and the running statistics 4 tol (|ref| + 1);
    /// invstd and scale 64 units of Acc's roundoff, relative: the finish merges three blocks in
    /// Acc (the count in double), divides, adds eps, takes one square root and multiplies, about
    /// 15 roundings on positive terms only (every part of the merged M2 is), so no cancellation
    /// grows them; the double reference adds a few of double's (as many as Acc's when Acc is
    /// double). A missing eps or a variance over n - 1 is far outside. y adds the rounding into
    /// T: unit_roundoff<T> + 4 tol relative to (|y| + 1).
    void check(const written& got) const {
        const double tol = acc_tolerance<T>();
        const double coefficient_tol = 64 * unit_roundoff<Acc>();
        const double eps = double(Acc(1e-5)); // the finish's eps (finish())
        std::vector<double> want_mean(g.channels), want_scale(g.channels);
        for (std::size_t c = 0; c < g.channels; ++c) {
            INFO("channel " << c);
            const auto [n, mean, m2] = merged_moments(c, [&](int r) { return merged || r == 1; });
            const double invstd = 1.0 / std::sqrt((n > 0 ? m2 / n : 0.0) + eps);
            want_mean[c] = mean;
            want_scale[c] = double(gamma[c]) * invstd;
            CHECK(std::abs(got.mean[c] - mean) <= 4 * tol * (std::abs(mean) + 1));
            CHECK(std::abs(got.invstd[c] - invstd) <= coefficient_tol * invstd);
            CHECK(std::abs(got.scale[c] - want_scale[c]) <=
                  coefficient_tol * std::abs(want_scale[c]));
            const auto [nr, mean_r, m2_r] = merged_moments(c, [](int) { return true; });
            double want_rm = running_mean0[c], want_rv = running_var0[c]; // kept below 2 values
            if (nr > 1) {
                want_rm = 0.9 * double(running_mean0[c]) + 0.1 * mean_r;
                want_rv = 0.9 * double(running_var0[c]) + 0.1 * m2_r / (nr - 1);
            }
            CHECK(std::abs(got.running_mean[c] - want_rm) <= 4 * tol * (std::abs(want_rm) + 1));
            CHECK(std::abs(got.running_var[c] - want_rv) <= 4 * tol * (std::abs(want_rv) + 1));
        }
        element_misses m;
        for (std::size_t i = 0; i < g.size(); ++i) {
            const std::size_t c = g.channel_of(i);
            m.add(i, to_double(got.y[i]),
                  (to_double(x[i]) - want_mean[c]) * want_scale[c] + double(beta[c]),
                  unit_roundoff<T>() + 4 * tol);
        }
        m.check("y");
    }
};

} // namespace lockstep_test::bn_data

// lockstep/kernels/exact_sum.hpp: binned sums (one per element) whose result depends only on
// the multiset of values added, not on their order or grouping. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

// The representation (the idea of ReproBLAS's binned sums, on integers). Every finite float or
// double x is m * 2^(p - 1074) with an integer 0 < |m| < 2^53 and a bit position p >= 0 (float
// values are placed on the same scale). Bit positions are cut into global, data-independent bins
// of bin_bits = 40 bits: bin b holds positions [40 b, 40 b + 40). x splits EXACTLY into at most 3
// signed parts of < 2^40 each, one per bin its mantissa spans (at most 2 for float). An element's
// accumulator is a window of `window` = 3 consecutive bins ending at its top bin (the highest bin
// any added value reached), each an int64 sum of parts. Adding a value above the window slides it
// up and drops the bins that fall out; parts below the window are dropped. Since the top only
// grows, what is dropped would also be dropped by any other order of additions: the final window
// holds, for the final top G, the exact integer sums of every part in bins G-2..G, a function of
// the multiset of values alone. Two accumulators of the same elements combine exactly after
// aligning both to the larger top (the cross-replica sum: MAX of the tops, then SUM of the bins).
//
// Precision: each value loses at most its bits below bin G-2, less than 2^-80 max|x| (max|x| has
// a bit in bin G), so |kept - exact| < N 2^-80 max|x| for N additions; the conversion back adds
// one rounding to T (a double-double sum of the bins, rounded to double, then to T). A plain
// recursive float sum errs by up to (N-1) 2^-24 sum|x|. The int64 bins cannot overflow for fewer
// than 2^23 (8M) additions per element (each part is < 2^40). NaN or infinity marks the element
// non-finite (its result is a quiet NaN, whatever else is added). Memory: 4 int64 per element
// (top + 3 bins), 32 bytes against 4 (float) or 8 (double).

namespace lockstep::kernels {

/// Constants of the binned representation (see the comment at the top of this file).
struct binned {
    static constexpr int bin_bits = 40;
    static constexpr int window = 3;
    /// The top of an element that received no non-zero value.
    static constexpr std::int64_t empty_top = -1;
    /// The top of an element that received a NaN or an infinity (largest: MAX keeps it).
    static constexpr std::int64_t non_finite_top = std::numeric_limits<std::int64_t>::max();
    /// The exponent of bit position 0 (the smallest double subnormal).
    static constexpr int position_exponent = -1074;
};

namespace detail {

/// x = (negative ? -1 : 1) * mantissa * 2^(position - 1074); mantissa == 0 for zeros;
/// finite == false for NaN and infinities.
struct split_value {
    std::uint64_t mantissa;
    std::int64_t position;
    bool negative;
    bool finite;
};

LOCKSTEP_HOST_DEVICE inline split_value split_exact(double x) {
    const auto bits = std::bit_cast<std::uint64_t>(x);
    const auto e = static_cast<std::int64_t>((bits >> 52) & 0x7ff);
    const std::uint64_t frac = bits & ((std::uint64_t{1} << 52) - 1);
    const bool neg = (bits >> 63) != 0;
    if (e == 0x7ff)
        return {0, 0, neg, false};
    if (e == 0)
        return {frac, 0, neg, true};
    return {frac | (std::uint64_t{1} << 52), e - 1, neg, true};
}

LOCKSTEP_HOST_DEVICE inline split_value split_exact(float x) {
    const auto bits = std::bit_cast<std::uint32_t>(x);
    const auto e = static_cast<std::int64_t>((bits >> 23) & 0xff);
    const std::uint64_t frac = bits & ((std::uint32_t{1} << 23) - 1);
    const bool neg = (bits >> 31) != 0;
    if (e == 0xff)
        return {0, 0, neg, false};
    // float value m 2^(e_eff - 150) placed at position e_eff - 150 + 1074.
    if (e == 0)
        return {frac, 1 + 924, neg, true};
    return {frac | (std::uint64_t{1} << 23), e + 924, neg, true};
}

/// Moves the window of one element (bins at stride `stride`, bins[0] the top) up by d >= 1
/// bins: bin j takes bin j - d, the lowest d bins become 0.
LOCKSTEP_HOST_DEVICE inline void slide_window(std::int64_t* bins, std::size_t stride,
                                              std::int64_t d) {
    for (int j = binned::window - 1; j >= 0; --j)
        bins[static_cast<std::size_t>(j) * stride] =
            j - d >= 0 ? bins[static_cast<std::size_t>(j - d) * stride] : 0;
}

/// Adds x into the accumulator of one element (top, bins at stride `stride`).
template <class V>
LOCKSTEP_HOST_DEVICE void binned_add(std::int64_t& top, std::int64_t* bins, std::size_t stride,
                                     V x) {
    if (top == binned::non_finite_top)
        return;
    const split_value v = split_exact(x);
    if (!v.finite) {
        top = binned::non_finite_top;
        return;
    }
    if (v.mantissa == 0)
        return;
    constexpr int w = binned::bin_bits;
    constexpr std::uint64_t mask = (std::uint64_t{1} << w) - 1;
    const std::int64_t lo = v.position / w;
    const int off = static_cast<int>(v.position % w);
    std::uint64_t parts[3];
    parts[0] = (v.mantissa & ((std::uint64_t{1} << (w - off)) - 1)) << off;
    const std::uint64_t rest = v.mantissa >> (w - off);
    parts[1] = rest & mask;
    parts[2] = rest >> w;
    const std::int64_t t = parts[2] != 0 ? lo + 2 : (parts[1] != 0 ? lo + 1 : lo);
    if (top == binned::empty_top) {
        top = t;
    } else if (t > top) {
        slide_window(bins, stride, t - top);
        top = t;
    }
    for (int k = 0; k < 3; ++k) {
        const std::int64_t j = top - (lo + k);
        if (parts[k] != 0 && j >= 0 && j < binned::window) {
            const auto p = static_cast<std::int64_t>(parts[k]);
            bins[static_cast<std::size_t>(j) * stride] += v.negative ? -p : p;
        }
    }
}

LOCKSTEP_HOST_DEVICE inline void two_sum(double& s, double& err, double t) {
    const double a = s + t;
    const double bb = a - s;
    err += (s - (a - bb)) + (t - bb);
    s = a;
}

/// x * 2^e, exactly as ::ldexp(x, e) gives it for |x| < 2^64: a multiplication by the power
/// of two built from its bits when both the power and every product are normal doubles (then
/// the product is exact, as ldexp's is), ldexp itself near the ends of the range (subnormal
/// or overflowing results).
LOCKSTEP_HOST_DEVICE inline double scale_by_power_of_two(double x, int e) {
    if (e >= -1022 && e <= 1023 - 64)
        return x * std::bit_cast<double>(static_cast<std::uint64_t>(e + 1023) << 52);
    return ::ldexp(x, e);
}

/// The value of one element's window whose top is `top` (not empty or non-finite): the bins
/// carried into [0, 2^40) below the top, each split into exact doubles, summed from the lowest
/// as a double-double and rounded once to double.
LOCKSTEP_HOST_DEVICE inline double binned_value(std::int64_t top, const std::int64_t* bins,
                                                std::size_t stride) {
    constexpr int w = binned::bin_bits;
    std::int64_t b[binned::window];
    for (int j = 0; j < binned::window; ++j)
        b[j] = bins[static_cast<std::size_t>(j) * stride];
    for (int j = binned::window - 1; j >= 1; --j) {
        const std::int64_t carry = b[j] >> w; // floor: C++20 shifts are arithmetic
        b[j] -= carry * (std::int64_t{1} << w);
        b[j - 1] += carry;
    }
    double s = 0, err = 0;
    for (int j = binned::window - 1; j >= 0; --j) {
        const int e = static_cast<int>((top - j) * w) + binned::position_exponent;
        const std::int64_t high = b[j] >> 32;
        const std::int64_t low = b[j] - high * (std::int64_t{1} << 32);
        two_sum(s, err, scale_by_power_of_two(static_cast<double>(low), e));
        two_sum(s, err, scale_by_power_of_two(static_cast<double>(high), e + 32));
    }
    // A sum beyond the double range: s is the infinity (err would be NaN).
    return s - s == 0.0 ? s + err : s;
}

} // namespace detail

/// Element i: top[i] = empty_top, its bins = 0 (bins of element i at bins[j * stride + i]).
struct binned_clear_fn {
    std::int64_t* top;
    std::int64_t* bins;
    std::size_t stride;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        top[i] = binned::empty_top;
        for (int j = 0; j < binned::window; ++j)
            bins[static_cast<std::size_t>(j) * stride + i] = 0;
    }
};

/// Element first + i += x[i] (exactly, in the binned representation).
template <class V>
struct binned_add_fn {
    const V* x;
    std::int64_t* top;
    std::int64_t* bins;
    std::size_t stride;
    std::size_t first = 0;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        const std::size_t k = first + i;
        detail::binned_add(top[k], bins + k, stride, x[i]);
    }
};

/// Element i's window moved to the top global_top[i] >= top[i] (what the cross-replica MAX
/// of the tops gave), so that the bins of every replica line up for the integer SUM.
struct binned_align_fn {
    const std::int64_t* global_top;
    std::int64_t* top;
    std::int64_t* bins;
    std::size_t stride;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        const std::int64_t g = global_top[i];
        const std::int64_t t = top[i];
        if (g != binned::non_finite_top && t != binned::empty_top && g > t)
            detail::slide_window(bins + i, stride, g - t);
        top[i] = g;
    }
};

/// out[i] = the value of element first + i rounded to Out (0 when empty, quiet NaN when
/// non-finite).
template <class Out>
struct binned_finalize_fn {
    const std::int64_t* top;
    const std::int64_t* bins;
    std::size_t stride;
    std::size_t first;
    Out* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        const std::size_t k = first + i;
        const std::int64_t t = top[k];
        if (t == binned::non_finite_top)
            out[i] = std::numeric_limits<Out>::quiet_NaN();
        else if (t == binned::empty_top)
            out[i] = Out(0);
        else
            out[i] = static_cast<Out>(detail::binned_value(t, bins + k, stride));
    }
};

} // namespace lockstep::kernels

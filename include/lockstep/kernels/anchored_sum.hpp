// lockstep/kernels/anchored_sum.hpp: sums of float or double values (one per element) whose
// result depends only on the multiset of values added, not on their order or grouping: fixed
// point anchored at each element's largest exponent. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/leading_zeros.hpp"
#include "lockstep/kernels/for_each.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

// The representation. A finite T value x is (-1)^s m 2^(e - bias) with an integer mantissa
// 0 <= m < 2^p (p = 24 for float, 53 for double; subnormals have exponent field 0 and e = 1).
// The anchor a of an element is the largest exponent field among every value summed into it,
// with a = max(a, 1). Each value becomes the integer
//     q(x) = trunc(m 2^(F - (a - e))),   F = 84 - p (60 for float, 31 for double),
// whose unit is 2^(a - bias - F): |q| < 2^84, summed in a signed 128-bit integer (at most
// max_terms values: |sum| < 2^103). q is a function of x and a alone, and integer sums do not
// depend on the order, so the sum is the same for any order, grouping and replica count:
// whoever holds every value of an element (the trainer gathers them to the replica that owns
// the element) gets the same bits.
//
// Precision: a value loses less than one unit, 2^(a - bias - F) <= 2^-83 max|x| (the largest
// value has a bit at 2^(a - bias + p - 1)), so |kept - exact| < N 2^-83 max|x| for N values;
// the result is then rounded to T once, to nearest even. A NaN or an infinity makes the field
// the largest (non_finite): the element's result is a quiet NaN. An exact sum beyond T's range
// rounds to an infinity. At most max_terms values per element (checked by the caller).

namespace lockstep::kernels {

/// Constants of the anchored representation of T (float or double), from its IEEE format.
template <class T>
struct anchored {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
    using limits = std::numeric_limits<T>;
    static constexpr int mantissa_bits = limits::digits;                  ///< p: 24, 53
    static constexpr int bias = limits::max_exponent - 2 + mantissa_bits; ///< x = m 2^(e - bias)
    static constexpr int min_exponent = 1 - bias;                         ///< smallest subnormal's
    static constexpr int max_exponent = limits::max_exponent - 1;         ///< largest leading bit
    static constexpr int non_finite = 2 * limits::max_exponent - 1;       ///< field of NaN, inf
};

/// The unsigned word holding the bits of a T (float or double).
template <class T>
using anchored_word = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;

/// Limits shared by both types.
struct anchored_limits {
    static constexpr int value_bits = 84; ///< |q| < 2^value_bits
    /// The most values one element may receive (the trainer's chunks plus replicas).
    static constexpr std::size_t max_terms = std::size_t{1} << 19;
};

namespace detail {

struct anchored_parts {
    std::uint64_t mantissa;
    int field; ///< the exponent field (non_finite for NaN and infinities)
    bool negative;
};

/// x's mantissa (with the hidden bit of a normal value), exponent field and sign.
template <class T>
LOCKSTEP_HOST_DEVICE anchored_parts anchored_split(T x) {
    using bits_type = anchored_word<T>;
    constexpr int p = anchored<T>::mantissa_bits - 1; // stored mantissa bits
    const auto bits = std::bit_cast<bits_type>(x);
    const int e = static_cast<int>((bits >> p) & anchored<T>::non_finite);
    const std::uint64_t frac = bits & ((bits_type{1} << p) - 1);
    return {e == 0 ? frac : (frac | (std::uint64_t{1} << p)), e,
            (bits >> (8 * sizeof(T) - 1)) != 0};
}

/// The sum of an element's integers q (CUDA supports __int128 in device code too).
__extension__ using anchored_int = __int128;
__extension__ using anchored_uint = unsigned __int128;

/// Adds q(x) for the anchor field `a` (not non_finite, >= every field added) to sum.
template <class T>
LOCKSTEP_HOST_DEVICE void anchored_add(anchored_int& sum, T x, int a) {
    constexpr int f = anchored_limits::value_bits - anchored<T>::mantissa_bits;
    const anchored_parts v = anchored_split(x);
    const int k = f - ((a == 0 ? 1 : a) - (v.field == 0 ? 1 : v.field)); // q = m 2^k, k <= f
    const anchored_int q = k >= 0    ? anchored_int(v.mantissa) << k
                           : k > -64 ? anchored_int(v.mantissa >> -k)
                                     : 0;
    sum += v.negative ? -q : q;
}

/// The element's value sum 2^(a - bias - F) rounded once to T, to nearest even (a: the anchor
/// field, not non_finite).
template <class T>
LOCKSTEP_HOST_DEVICE T anchored_value(anchored_int sum, int a) {
    using A = anchored<T>;
    constexpr int f = anchored_limits::value_bits - A::mantissa_bits;
    const bool negative = sum < 0;
    const anchored_uint mag = negative ? -anchored_uint(sum) : anchored_uint(sum);
    if (mag == 0)
        return T(0);
    const auto top = static_cast<std::uint64_t>(mag >> 64);
    const int length =
        top != 0 ? 128 - countl_zero64(top) : 64 - countl_zero64(static_cast<std::uint64_t>(mag));
    const int scale = (a == 0 ? 1 : a) - A::bias - f; // the exponent of bit 0
    int lsb = scale + length - 1 - (A::mantissa_bits - 1);
    lsb = lsb < A::min_exponent ? A::min_exponent : lsb;
    const int drop = lsb - scale;
    std::uint64_t m = 0;
    if (drop <= 0) {
        m = static_cast<std::uint64_t>(mag << -drop); // length <= p: fits
    } else {                                          // 0 < drop <= 104
        m = static_cast<std::uint64_t>(mag >> drop);
        const anchored_uint rest = mag & ((anchored_uint(1) << drop) - 1);
        const anchored_uint half = anchored_uint(1) << (drop - 1);
        if (rest > half || (rest == half && (m & 1) != 0))
            ++m;
    }
    const int m_length = 64 - countl_zero64(m);
    if (lsb + m_length - 1 > A::max_exponent)
        return negative ? -std::numeric_limits<T>::infinity() : std::numeric_limits<T>::infinity();
    // m 2^lsb with m <= 2^p, from its bits: the field lsb - min_exponent sits below the hidden
    // bit, so adding m carries it into the exponent field of a normal value (m >= 2^(p - 1)),
    // and a subnormal (lsb == min_exponent, m < 2^(p - 1)) keeps field 0.
    using bits_type = anchored_word<T>;
    const auto bits = (static_cast<bits_type>(lsb - A::min_exponent) << (A::mantissa_bits - 1)) +
                      static_cast<bits_type>(m) +
                      (negative ? bits_type{1} << (8 * sizeof(T) - 1) : bits_type{0});
    return std::bit_cast<T>(bits);
}

} // namespace detail

/// The gradients of one replica's chunks: chunk j < count - 1 at stored[j * stride], the last
/// chunk at `last`. requires: count >= 1.
template <class T>
struct anchored_chunks {
    const T* stored;
    const T* last;
    std::size_t count;
    std::size_t stride;
    LOCKSTEP_HOST_DEVICE T value(std::size_t j, std::size_t i) const {
        return j + 1 == count ? last[i] : stored[j * stride + i];
    }
};

/// The values every replica contributed to a range of elements, as a collective laid them out:
/// value c of replica j for element i at base[j * replica_stride + c * call_stride + i]
/// (j < replicas, c < calls; zeros where a replica had fewer values).
template <class V>
struct anchored_terms {
    const V* base;
    std::size_t replicas;
    std::size_t calls;
    std::size_t replica_stride;
    std::size_t call_stride;
    LOCKSTEP_HOST_DEVICE V value(std::size_t j, std::size_t c, std::size_t i) const {
        return base[j * replica_stride + c * call_stride + i];
    }
};

/// out[i] = the sum of element i's terms, rounded once to T: its anchor is the largest exponent
/// field among them (a quiet NaN when one is not finite), every term's q for that anchor summed
/// in 128 bits. Terms: anchored_terms<T>, or any type with replicas, calls and value(j, c, i).
/// requires: replicas * calls <= anchored_limits::max_terms.
template <class T, class Terms = anchored_terms<T>>
struct anchored_sum_fn {
    Terms terms;
    T* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        using A = anchored<T>;
        int a = 0;
        for (std::size_t j = 0; j < terms.replicas; ++j)
            for (std::size_t c = 0; c < terms.calls; ++c) {
                const int e = detail::anchored_split(static_cast<T>(terms.value(j, c, i))).field;
                a = e > a ? e : a;
            }
        if (a == A::non_finite) {
            out[i] = std::numeric_limits<T>::quiet_NaN();
            return;
        }
        detail::anchored_int sum = 0;
        for (std::size_t j = 0; j < terms.replicas; ++j)
            for (std::size_t c = 0; c < terms.calls; ++c)
                detail::anchored_add(sum, static_cast<T>(terms.value(j, c, i)), a);
        out[i] = detail::anchored_value<T>(sum, a);
    }
};

/// out[i] (the last chunk) becomes a quiet NaN where a kept chunk holds a non-finite value, so it
/// is non-finite exactly where one of the replica's chunk values is (its own non-finite counts
/// name it). A replica's own sum beyond T's range is not marked: a skip must not depend on how
/// the chunks fall on replicas. A marked element's global sum is the NaN it was going to be.
template <class T>
struct anchored_own_check_fn {
    anchored_chunks<T> chunks;
    T* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        bool finite = true;
        for (std::size_t j = 0; j + 1 < chunks.count; ++j)
            finite = finite &&
                     detail::anchored_split(chunks.value(j, i)).field != anchored<T>::non_finite;
        if (!finite)
            out[i] = std::numeric_limits<T>::quiet_NaN();
    }
};

// The passes of reduce::reproducible's accumulator on a System. host_system overloads the keep
// pass for float (kernels/detail/anchored_host.hpp, found by argument-dependent lookup); on the
// host the accumulator sums through kernels/detail/anchored_combine.hpp.

/// Task i: dst[i] = src[i], then clear[i] = 0 unless clear (src itself, or null) is null.
template <class T>
struct anchored_keep_fn {
    const T* src;
    T* dst;
    T* clear;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        dst[i] = src[i];
        if (clear != nullptr)
            clear[i] = T(0);
    }
};

/// anchored_keep_fn over elements [first, end) of a chunk's gradient src (n values): one launch
/// on a device.
template <class System, class T>
void anchored_keep(const System& sys, const T* src, T* dst, T* clear, std::size_t first,
                   std::size_t end, std::size_t /*n*/) {
    const anchored_keep_fn<T> f{src + first, dst + first,
                                clear != nullptr ? clear + first : nullptr};
    for_each_index(sys, end - first, f, end - first);
}

} // namespace lockstep::kernels

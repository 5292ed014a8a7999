// lockstep/kernels/anchored_sum.hpp: sums of float or double values (one per element) whose
// result depends only on the multiset of values added, not on their order or grouping: fixed
// point anchored at each element's largest exponent. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/leading_zeros.hpp"
#include "lockstep/kernels/for_each.hpp"

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

// The representation. A finite T value x is (-1)^s m 2^(e - bias) with an integer mantissa
// 0 <= m < 2^p (p = 24 for float, 53 for double; subnormals have exponent field 0 and e = 1).
// The anchor a of an element is the largest exponent field among every value summed into it,
// with a = max(a, 1). Each value becomes the integer
//     q(x) = trunc(m 2^(F - (a - e))),   F = 84 - p (60 for float, 31 for double),
// whose unit is 2^(a - bias - F): |q| < 2^84. q is summed as two signed int64 limbs, q = hi 2^40
// + lo with |lo| < 2^40 and |hi| < 2^44 (both with the sign of x), so the sums of up to 2^19
// values stay inside int64 with no carry between the limbs. q is a function of x and a alone,
// and integer sums do not depend on the order, so the sum is the same for any order, grouping
// and replica count: whoever holds every value of an element (the trainer gathers them to the
// replica that owns the element) gets the same bits.
//
// Precision: a value loses less than one unit, 2^(a - bias - F) <= 2^-83 max|x| (the largest
// value has a bit at 2^(a - bias + p - 1)), so |kept - exact| < N 2^-83 max|x| for N values;
// the result is then rounded to T once, to nearest even. A NaN or an infinity makes the field
// the largest (non_finite): the element's result is a quiet NaN. An exact sum beyond T's range
// rounds to an infinity. At most max_terms values per element (checked by the caller).

namespace lockstep::kernels {

/// Constants of the anchored representation of T (float or double).
template <class T>
struct anchored;

template <>
struct anchored<float> {
    /// The exponent field's type on the wire (MAX all_reduce).
    using exponent_type = std::uint8_t;
    static constexpr int mantissa_bits = 24;  ///< p, with the hidden bit
    static constexpr int bias = 150;          ///< x = m 2^(e - bias)
    static constexpr int min_exponent = -149; ///< of the smallest subnormal
    static constexpr int max_exponent = 127;  ///< of the largest finite value's leading bit
    static constexpr exponent_type non_finite = 255;
};

template <>
struct anchored<double> {
    using exponent_type = int;
    static constexpr int mantissa_bits = 53;
    static constexpr int bias = 1075;
    static constexpr int min_exponent = -1074;
    static constexpr int max_exponent = 1023;
    static constexpr exponent_type non_finite = 2047;
};

/// Limits shared by both types.
struct anchored_limits {
    static constexpr int value_bits = 84; ///< |q| < 2^value_bits
    static constexpr int limb_bits = 40;  ///< q = hi 2^limb_bits + lo
    /// The most values one element may receive: |sum of hi| < 2^19 2^44 = 2^63.
    static constexpr std::size_t max_terms = std::size_t{1} << 19;
};

namespace detail {

template <class T>
struct anchored_parts {
    std::uint64_t mantissa;
    int field; ///< the exponent field (non_finite for NaN and infinities)
    bool negative;
};

LOCKSTEP_HOST_DEVICE inline anchored_parts<float> anchored_split(float x) {
    const auto bits = std::bit_cast<std::uint32_t>(x);
    const int e = static_cast<int>((bits >> 23) & 0xff);
    const std::uint64_t frac = bits & ((std::uint32_t{1} << 23) - 1);
    return {e == 0 ? frac : (frac | (std::uint64_t{1} << 23)), e, (bits >> 31) != 0};
}

LOCKSTEP_HOST_DEVICE inline anchored_parts<double> anchored_split(double x) {
    const auto bits = std::bit_cast<std::uint64_t>(x);
    const int e = static_cast<int>((bits >> 52) & 0x7ff);
    const std::uint64_t frac = bits & ((std::uint64_t{1} << 52) - 1);
    return {e == 0 ? frac : (frac | (std::uint64_t{1} << 52)), e, (bits >> 63) != 0};
}

/// The exponent field of x (non_finite for NaN and infinities).
template <class T>
LOCKSTEP_HOST_DEVICE typename anchored<T>::exponent_type anchored_field(T x) {
    return static_cast<typename anchored<T>::exponent_type>(anchored_split(x).field);
}

/// Adds q(x) for the anchor field `a` (not non_finite, >= every field added) to (hi, lo).
template <class T>
LOCKSTEP_HOST_DEVICE void anchored_add(std::int64_t& hi, std::int64_t& lo, T x, int a) {
    constexpr int w = anchored_limits::limb_bits;
    constexpr int f = anchored_limits::value_bits - anchored<T>::mantissa_bits;
    constexpr std::uint64_t mask = (std::uint64_t{1} << w) - 1;
    const anchored_parts<T> v = anchored_split(x);
    if (v.mantissa == 0)
        return;
    const int e = v.field == 0 ? 1 : v.field;
    const int k = f - ((a == 0 ? 1 : a) - e); // q = m 2^k, k <= f
    std::uint64_t h = 0;
    std::uint64_t l = 0;
    if (k >= 0) {
        l = (v.mantissa << k) & mask; // the low bits of m 2^k (k < 64)
        h = k >= w ? v.mantissa << (k - w) : v.mantissa >> (w - k);
    } else if (k > -64) {
        const std::uint64_t q = v.mantissa >> (-k);
        l = q & mask;
        h = q >> w;
    }
    const auto hs = static_cast<std::int64_t>(h);
    const auto ls = static_cast<std::int64_t>(l);
    hi += v.negative ? -hs : hs;
    lo += v.negative ? -ls : ls;
}

/// Bit j (0..127) of the 128-bit integer (hi, lo).
LOCKSTEP_HOST_DEVICE inline bool bit128(std::uint64_t hi, std::uint64_t lo, int j) {
    return j >= 64 ? ((hi >> (j - 64)) & 1) != 0 : ((lo >> j) & 1) != 0;
}

/// True when a bit below j (0..128) of (hi, lo) is set.
LOCKSTEP_HOST_DEVICE inline bool any_below128(std::uint64_t hi, std::uint64_t lo, int j) {
    if (j <= 0)
        return false;
    if (j <= 64)
        return (j == 64 ? lo : (lo & ((std::uint64_t{1} << j) - 1))) != 0;
    return lo != 0 || (hi & ((std::uint64_t{1} << (j - 64)) - 1)) != 0;
}

/// (hi, lo) >> d for 0 < d < 128, when the result fits 64 bits.
LOCKSTEP_HOST_DEVICE inline std::uint64_t shift_right128(std::uint64_t hi, std::uint64_t lo,
                                                         int d) {
    if (d >= 64)
        return hi >> (d - 64);
    return (lo >> d) | (hi << (64 - d));
}

/// The element's value (hi 2^40 + lo) 2^(a - bias - F) rounded once to T, to nearest even
/// (a: the anchor field, not non_finite).
template <class T>
LOCKSTEP_HOST_DEVICE T anchored_value(std::int64_t hi, std::int64_t lo, int a) {
    using A = anchored<T>;
    constexpr int w = anchored_limits::limb_bits;
    constexpr int f = anchored_limits::value_bits - A::mantissa_bits;
    // Carry lo into [0, 2^40), then take the magnitude of hi 2^40 + lo as 128 bits.
    const std::int64_t carry = lo >> w; // floor: C++20 shifts are arithmetic
    hi += carry;
    lo -= carry * (std::int64_t{1} << w);
    const bool negative = hi < 0;
    std::uint64_t mh = 0;
    std::uint64_t ml = static_cast<std::uint64_t>(lo);
    if (negative) { // -(hi 2^40 + lo) = (-hi - 1) 2^40 + (2^40 - lo) when lo > 0
        mh = static_cast<std::uint64_t>(-(hi + 1));
        ml = (std::uint64_t{1} << w) - ml;
        if (ml == (std::uint64_t{1} << w)) {
            ml = 0;
            ++mh;
        }
    } else {
        mh = static_cast<std::uint64_t>(hi);
    }
    const std::uint64_t top = mh >> (64 - w);
    const std::uint64_t bottom = (mh << w) | ml;
    if (top == 0 && bottom == 0)
        return T(0);
    const int length = top != 0 ? 128 - countl_zero64(top) : 64 - countl_zero64(bottom);
    const int scale = (a == 0 ? 1 : a) - A::bias - f; // the exponent of bit 0
    const int lead = scale + length - 1;
    int lsb = lead - (A::mantissa_bits - 1);
    lsb = lsb < A::min_exponent ? A::min_exponent : lsb;
    const int drop = lsb - scale;
    std::uint64_t m = 0;
    if (drop <= 0) {
        m = bottom << (-drop); // length <= p: fits
    } else {
        m = shift_right128(top, bottom, drop);
        const bool half = bit128(top, bottom, drop - 1);
        const bool sticky = any_below128(top, bottom, drop - 1);
        if (half && (sticky || (m & 1) != 0))
            ++m;
    }
    const int m_length = 64 - countl_zero64(m);
    if (lsb + m_length - 1 > A::max_exponent)
        return negative ? -std::numeric_limits<T>::infinity() : std::numeric_limits<T>::infinity();
    // m 2^lsb with m <= 2^p, from its bits: the field lsb - min_exponent sits below the hidden
    // bit, so adding m carries it into the exponent field of a normal value (m >= 2^(p - 1)),
    // and a subnormal (lsb == min_exponent, m < 2^(p - 1)) keeps field 0.
    using bits_type = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    const auto bits = (static_cast<bits_type>(lsb - A::min_exponent) << (A::mantissa_bits - 1)) +
                      static_cast<bits_type>(m) +
                      (negative ? bits_type{1} << (8 * sizeof(T) - 1) : bits_type{0});
    return std::bit_cast<T>(bits);
}

/// The most terms anchored_short_sum takes: 256 terms of |q| < 2^55 stay inside int64.
inline constexpr std::size_t anchored_short_terms = 256;

/// The float sum of element i's terms for the anchor field a (not non_finite) when every
/// non-zero term lies within 31 binades of it: then q = m 2^(31 - (a - e)) < 2^55 keeps every
/// bit, the int64 sum is the exact sum, its conversion to float rounds once to nearest even, and
/// the scaling by 2^(a - 181) is exact unless the result is subnormal. Returns false (the
/// caller takes the two-limb path, which gives the same bits wherever this one answers) when a
/// term lies further below or the result is subnormal. requires: at most anchored_short_terms.
template <class Terms>
LOCKSTEP_HOST_DEVICE bool anchored_short_sum(const Terms& terms, std::size_t i, int a, float& out) {
    const int top = a == 0 ? 1 : a;
    std::int64_t s = 0;
    bool fits = true;
    for (std::size_t j = 0; j < terms.replicas; ++j)
        for (std::size_t c = 0; c < terms.calls; ++c) {
            const auto bits =
                std::bit_cast<std::uint32_t>(static_cast<float>(terms.value(j, c, i)));
            const int e = static_cast<int>((bits >> 23) & 0xff);
            const auto frac = static_cast<std::int64_t>(bits & 0x7fffff);
            const std::int64_t m = e == 0 ? frac : (frac | 0x800000);
            const int shift = 31 - (top - (e == 0 ? 1 : e));
            fits = fits && (shift >= 0 || m == 0);
            const std::int64_t q = shift >= 0 ? m << shift : 0;
            s += (bits >> 31) != 0 ? -q : q;
        }
    if (!fits)
        return false;
    const auto r = static_cast<float>(s); // int64 -> float: round to nearest even
    const double v = static_cast<double>(r) *
                     std::bit_cast<double>(static_cast<std::uint64_t>(1023 + top - 181) << 52);
    if (v != 0.0 && (v < 0 ? -v : v) < 0x1p-126)
        return false;
    out = static_cast<float>(v); // exact, or an infinity past float's range
    return true;
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
/// (j < replicas, c < calls; zeros where a replica had fewer values). V is T, or double holding
/// T values exactly.
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
/// field among them (a quiet NaN when one is not finite), and every term's q for that anchor is
/// summed in two int64 limbs (for float, in one int64 when no bit is cut: anchored_short_sum).
/// requires: replicas * calls <= anchored_limits::max_terms.
template <class T, class V = T>
struct anchored_sum_fn {
    anchored_terms<V> terms;
    T* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        using A = anchored<T>;
        int a = 0;
        for (std::size_t j = 0; j < terms.replicas; ++j)
            for (std::size_t c = 0; c < terms.calls; ++c) {
                const int e = detail::anchored_field(static_cast<T>(terms.value(j, c, i)));
                a = e > a ? e : a;
            }
        if (a == A::non_finite) {
            out[i] = std::numeric_limits<T>::quiet_NaN();
            return;
        }
        if constexpr (std::is_same_v<T, float>) {
            float r = 0;
            if (terms.replicas * terms.calls <= detail::anchored_short_terms &&
                detail::anchored_short_sum(terms, i, a, r)) {
                out[i] = r;
                return;
            }
        }
        std::int64_t h = 0;
        std::int64_t l = 0;
        for (std::size_t j = 0; j < terms.replicas; ++j)
            for (std::size_t c = 0; c < terms.calls; ++c)
                detail::anchored_add(h, l, static_cast<T>(terms.value(j, c, i)), a);
        out[i] = detail::anchored_value<T>(h, l, a);
    }
};

/// out[i] becomes a quiet NaN where one of this replica's kept chunks (every chunk but the last,
/// which is out itself) holds a value that is not finite, and keeps its value elsewhere: out is
/// then non-finite exactly where one of the replica's chunk values is, which names the replica
/// in its own non-finite counts. A replica's own sum beyond T's range is not marked: whether a
/// step is skipped must not depend on how the chunks fall on replicas, and a global sum beyond
/// the range is caught by the check of the summed gradient. A marked element's global sum is
/// the quiet NaN it was going to be, so out may still be summed as the last chunk.
/// requires: out is chunks.last.
template <class T>
struct anchored_own_check_fn {
    anchored_chunks<T> chunks;
    T* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        bool finite = true;
        for (std::size_t j = 0; j + 1 < chunks.count; ++j)
            finite = finite && detail::anchored_field(chunks.stored[j * chunks.stride + i]) !=
                                   anchored<T>::non_finite;
        if (!finite)
            out[i] = std::numeric_limits<T>::quiet_NaN();
    }
};

/// Task i: dst[i] = src[i], then clear[i] = 0 where clear (src itself, or null) is not null: a
/// chunk's value kept, its slot left zero for the next chunk.
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

/// A pass over elements [first, end) of a chunk's gradient src (n values): copied to dst at the
/// same offsets, left zero where clear (src itself, or null) is not null.
template <class T>
struct anchored_keep_pass {
    const T* src;
    T* dst;
    T* clear;
    std::size_t first;
    std::size_t end;
    std::size_t n;
};

// The passes of reduce::reproducible's accumulator on a System, element by element through the
// functors above. host_system's keep pass for float (kernels/detail/anchored_host.hpp, in
// namespace lockstep::host, found by argument-dependent lookup on the system) runs in tiles; on
// the host the accumulator sums through anchored_combine_fn (kernels/detail/anchored_combine.hpp).

/// out[i] = the sum of element i of terms (anchored_sum_fn), for i < count.
template <class System, class T, class V>
void anchored_sums(const System& sys, const anchored_terms<V>& terms, std::size_t count, T* out) {
    for_each_index(sys, count, anchored_sum_fn<T, V>{terms, out});
}

/// The pass p.
template <class System, class T>
void anchored_keep(const System& sys, const anchored_keep_pass<T>& p) {
    if (p.dst != nullptr && p.first < p.end)
        for_each_index(sys, p.end - p.first,
                       anchored_keep_fn<T>{p.src + p.first, p.dst + p.first,
                                           p.clear != nullptr ? p.clear + p.first : nullptr},
                       p.end - p.first);
}

/// out (the last chunk, n values) marked by anchored_own_check_fn.
template <class System, class T>
void anchored_mark_own(const System& sys, const anchored_chunks<T>& chunks, std::size_t n, T* out) {
    for_each_index(sys, n, anchored_own_check_fn<T>{chunks, out}, chunks.count * n);
}

} // namespace lockstep::kernels

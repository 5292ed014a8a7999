// lockstep/kernels/float16_convert.hpp: ranges of float or double values rounded to 16-bit floats
// (half, bfloat16) and widened back, written once for host and device code.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/float16_arrays.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Host code converts a range with the array conversions of kernels/float16_arrays.hpp (F16C/AVX2
// where the CPU has them); device code converts element by element with the scalar conversions
// of core/float16.hpp. Both round to nearest even and give the same bits (NaN payloads as
// float16_arrays.hpp states), so a host test pins down what a GPU computes.
//
// The 16-bit side is either a typed array (Low*: compute copies, 16-bit gradients) or raw bytes
// (unsigned char*: value i in bytes 2i and 2i + 1 at any alignment, e.g. the wire slots of
// reduce::compressed, two to an int word).

namespace lockstep::kernels {

namespace detail {
/// The 16-bit element i positions past p (typed, or 2i bytes).
template <class Low>
LOCKSTEP_HOST_DEVICE Low* advance16(Low* p, std::size_t i) {
    return p + i;
}
template <class Low>
LOCKSTEP_HOST_DEVICE const Low* advance16(const Low* p, std::size_t i) {
    return p + i;
}
LOCKSTEP_HOST_DEVICE inline unsigned char* advance16(unsigned char* p, std::size_t i) {
    return p + 2 * i;
}
LOCKSTEP_HOST_DEVICE inline const unsigned char* advance16(const unsigned char* p, std::size_t i) {
    return p + 2 * i;
}

/// The bits of element i.
template <class Low>
LOCKSTEP_HOST_DEVICE std::uint16_t load16(const Low* p, std::size_t i) {
    return p[i].bits;
}
LOCKSTEP_HOST_DEVICE inline std::uint16_t load16(const unsigned char* p, std::size_t i) {
    std::uint16_t b;
    std::memcpy(&b, p + 2 * i, sizeof b);
    return b;
}

/// Sets the bits of element i.
template <class Low>
LOCKSTEP_HOST_DEVICE void store16(Low* p, std::size_t i, std::uint16_t b) {
    p[i] = Low::from_bits(b);
}
LOCKSTEP_HOST_DEVICE inline void store16(unsigned char* p, std::size_t i, std::uint16_t b) {
    std::memcpy(p + 2 * i, &b, sizeof b);
}

/// The checks every entry point below states once.
template <class Low, class T, class Slot>
LOCKSTEP_HOST_DEVICE constexpr void check_16bit_types() {
    static_assert(lockstep::is_wire_float16_v<Low>,
                  "16-bit conversions: Low must be lockstep::half or lockstep::bfloat16.");
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "16-bit conversions: the wide values must be float or double.");
    static_assert(std::is_same_v<Slot, Low> || std::is_same_v<Slot, unsigned char>,
                  "16-bit conversions: the 16-bit side is a Low array or raw bytes.");
}
} // namespace detail

/// dst[i] = Low(float(src[i])) for i in [0, n) (for T = float a single rounding to nearest
/// even; for double two: double -> float -> Low). Slot is Low (dst a Low array) or unsigned char
/// (dst 2n bytes, any alignment). requires: dst does not overlap src.
template <class Low, class T, class Slot>
LOCKSTEP_HOST_DEVICE void round_to_16bit(const T* src, std::size_t n, Slot* dst) {
    detail::check_16bit_types<Low, T, Slot>();
#if defined(__CUDA_ARCH__)
    for (std::size_t i = 0; i < n; ++i)
        detail::store16(dst, i,
                        lockstep::detail::wire_codec<Low>::encode(static_cast<float>(src[i])));
#else
    lockstep::detail::to_wire_n<Low>(src, n, dst);
#endif
}

/// dst[i] = T(float(src[i])) for i in [0, n), exactly (NaN payloads kept, as float(Low)). Slot
/// as for round_to_16bit. requires: dst does not overlap src.
template <class Low, class T, class Slot>
LOCKSTEP_HOST_DEVICE void widen_from_16bit(const Slot* src, std::size_t n, T* dst) {
    detail::check_16bit_types<Low, T, Slot>();
#if defined(__CUDA_ARCH__)
    for (std::size_t i = 0; i < n; ++i)
        dst[i] = static_cast<T>(lockstep::detail::wire_codec<Low>::decode(detail::load16(src, i)));
#else
    lockstep::detail::from_wire_n<Low>(src, n, dst);
#endif
}

/// f(i, float(src[i])) for i in [0, n) in increasing order: a widened value consumed at once
/// (e.g. accumulated), without an array of them. On the host the values are widened a tile at a
/// time into a local array (so f's loop vectorises); on a device one at a time.
template <class Low, class Slot, class F>
LOCKSTEP_HOST_DEVICE void for_each_widened(const Slot* src, std::size_t n, F&& f) {
    detail::check_16bit_types<Low, float, Slot>();
#if defined(__CUDA_ARCH__)
    for (std::size_t i = 0; i < n; ++i)
        f(i, lockstep::detail::wire_codec<Low>::decode(detail::load16(src, i)));
#else
    constexpr std::size_t tile = 512;
    float v[tile];
    for (std::size_t at = 0; at < n; at += tile) {
        const std::size_t m = n - at < tile ? n - at : tile;
        lockstep::detail::from_wire_n<Low>(detail::advance16(src, at), m, v);
        for (std::size_t i = 0; i < m; ++i)
            f(at + i, v[i]);
    }
#endif
}

/// The rank-ordered sum of 16-bit blocks (the reduction of reduce::compressed): for i in
/// [0, n), s_i = the float sum, in rank order r = 0..ranks-1, of value i of block r (block r at
/// value r * stride of blocks); value i of out = Low(s_i), and back[i] = T(float(Low(s_i))) for
/// i < n_back. Every caller that sums the same blocks gets the same bits, host or device.
/// requires: n_back <= n; out overlaps neither blocks nor back.
template <class Low, class T>
LOCKSTEP_HOST_DEVICE void sum_16bit(const unsigned char* blocks, std::size_t stride, int ranks,
                                    std::size_t n, unsigned char* out, T* back,
                                    std::size_t n_back) {
    detail::check_16bit_types<Low, T, unsigned char>();
#if defined(__CUDA_ARCH__)
    using codec = lockstep::detail::wire_codec<Low>;
    for (std::size_t i = 0; i < n; ++i) {
        float acc = codec::decode(detail::load16(blocks, i));
        for (int r = 1; r < ranks; ++r)
            acc += codec::decode(detail::load16(blocks, static_cast<std::size_t>(r) * stride + i));
        const std::uint16_t bits = codec::encode(acc);
        detail::store16(out, i, bits);
        if (i < n_back)
            back[i] = static_cast<T>(codec::decode(bits));
    }
#else
    if constexpr (std::is_same_v<T, float>) {
        lockstep::detail::sum_wire_n<Low>(blocks, 2 * stride, ranks, n, out, back, n_back);
    } else {
        constexpr std::size_t tile = 512;
        float wide[tile];
        for (std::size_t at = 0; at < n; at += tile) {
            const std::size_t m = n - at < tile ? n - at : tile;
            const std::size_t k = n_back > at ? (n_back - at < m ? n_back - at : m) : 0;
            lockstep::detail::sum_wire_n<Low>(blocks + 2 * at, 2 * stride, ranks, m, out + 2 * at,
                                              wide, k);
            for (std::size_t i = 0; i < k; ++i)
                back[at + i] = static_cast<T>(wide[i]);
        }
    }
#endif
}

} // namespace lockstep::kernels

// lockstep/train/detail/reduce_functors.hpp: the element-wise arithmetic of the reducers (scale,
// 16-bit wire packing, rank-ordered shard sums, finiteness) as host/device functors over Thrust.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/core/float16_arrays.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>

namespace lockstep::detail {

/// x *= s.
template <class T>
struct scale_fn {
    T s;
    LOCKSTEP_HOST_DEVICE T operator()(T x) const { return x * s; }
};

/// 1 when x is NaN or infinite, else 0 (a bit test, immune to -ffast-math).
template <class T>
struct non_finite_fn {
    LOCKSTEP_HOST_DEVICE int operator()(T x) const {
        if constexpr (sizeof(T) == 4) {
            return (detail::float_bits(static_cast<float>(x)) & 0x7f800000u) == 0x7f800000u;
        } else {
            std::uint64_t u;
            std::memcpy(&u, &x, sizeof u);
            return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
        }
    }
};

/// The wire kernels of reduce::compressed (compressed_all_reduce.hpp). Wire values travel as
/// 16-bit slots of int words (ints are a type every communicator carries): slot i is bytes 2i
/// and 2i + 1 of the word array, so two slots share a word. On the host a task converts a tile
/// of wire_host_tile slots with the array conversions of core/float16_arrays.hpp (F16C/AVX2
/// where the CPU has them); on a device a task converts one word (tile 2), with the scalar
/// conversions of core/float16.hpp, which give the same bits.
inline constexpr std::size_t wire_host_tile = 4096;

/// Slot i of a word array.
LOCKSTEP_HOST_DEVICE inline std::uint16_t wire_slot(const int* words, std::size_t i) {
    std::uint16_t b;
    std::memcpy(&b, reinterpret_cast<const unsigned char*>(words) + 2 * i, sizeof b);
    return b;
}
/// Sets slot i of a word array.
LOCKSTEP_HOST_DEVICE inline void set_wire_slot(int* words, std::size_t i, std::uint16_t b) {
    std::memcpy(reinterpret_cast<unsigned char*>(words) + 2 * i, &b, sizeof b);
}

/// Host: slots [0, n) at dst = src[0..n) rounded to Wire (through float when T is double).
template <class Wire, class T>
void encode_wire_host(const T* src, std::size_t n, int* dst, std::size_t first_slot) {
    to_wire_n<Wire>(src, n, reinterpret_cast<unsigned char*>(dst) + 2 * first_slot);
}
/// Host: dst[0..n) = the values of slots [first_slot, first_slot + n) of src.
template <class Wire, class T>
void decode_wire_host(const int* src, std::size_t first_slot, std::size_t n, T* dst) {
    from_wire_n<Wire>(reinterpret_cast<const unsigned char*>(src) + 2 * first_slot, n, dst);
}

/// Task t: slots [t * tile, min((t + 1) * tile, slots)) of `words` = src rounded to Wire for
/// the elements below n, zero (the bits of +0) for the padding from n to slots.
/// requires: tile even.
template <class Wire, class T>
struct pack_wire_fn {
    const T* src;
    std::size_t n;
    int* words;
    std::size_t slots;
    std::size_t tile;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = t * tile, e = b + tile < slots ? b + tile : slots;
        const std::size_t m = n < b ? b : n < e ? n : e; // [b, m): data, [m, e): padding
#if defined(__CUDA_ARCH__)
        for (std::size_t i = b; i < e; ++i)
            set_wire_slot(words, i,
                          i < m ? wire_codec<Wire>::encode(static_cast<float>(src[i])) : 0);
#else
        encode_wire_host<Wire>(src + b, m - b, words, b);
        if (e > m)
            std::memset(reinterpret_cast<unsigned char*>(words) + 2 * m, 0, 2 * (e - m));
#endif
    }
};

/// The reduction of one shard, task t over slots [t * tile, min((t + 1) * tile, shard)):
/// slot i of `out` = Wire(the float sum, in rank order r = 0..ranks-1, of slot i of block r of
/// `blocks` (blocks of `shard` slots, as all_to_all lays them out)); and for i < n,
/// dst[i] = that rounded sum in T. Every replica that sums the same blocks gets the same bits.
template <class Wire, class T>
struct sum_wire_fn {
    const int* blocks;
    std::size_t shard;
    int ranks;
    int* out;
    T* dst;
    std::size_t n;
    std::size_t tile;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = t * tile, e = b + tile < shard ? b + tile : shard;
#if defined(__CUDA_ARCH__)
        for (std::size_t i = b; i < e; ++i) {
            float acc = wire_codec<Wire>::decode(wire_slot(blocks, i));
            for (int r = 1; r < ranks; ++r)
                acc += wire_codec<Wire>::decode(
                    wire_slot(blocks, static_cast<std::size_t>(r) * shard + i));
            const std::uint16_t bits = wire_codec<Wire>::encode(acc);
            set_wire_slot(out, i, bits);
            if (i < n)
                dst[i] = static_cast<T>(wire_codec<Wire>::decode(bits));
        }
#else
        const auto* in = reinterpret_cast<const unsigned char*>(blocks) + 2 * b;
        auto* o = reinterpret_cast<unsigned char*>(out) + 2 * b;
        const std::size_t n_back = n > b ? (n < e ? n : e) - b : 0;
        if constexpr (std::is_same_v<T, float>) {
            sum_wire_n<Wire>(in, 2 * shard, ranks, e - b, o, dst + b, n_back);
        } else {
            constexpr std::size_t step = 512;
            float back[step];
            for (std::size_t at = 0; at < e - b; at += step) {
                const std::size_t m = e - b - at < step ? e - b - at : step;
                const std::size_t k = n_back > at ? (n_back - at < m ? n_back - at : m) : 0;
                sum_wire_n<Wire>(in + 2 * at, 2 * shard, ranks, m, o + 2 * at, back, k);
                for (std::size_t i = 0; i < k; ++i)
                    dst[b + at + i] = static_cast<T>(back[i]);
            }
        }
#endif
    }
};

/// Task t: dst[i] = the value of slot i of `words`, for i in [t * tile, min((t + 1) * tile, n)).
template <class Wire, class T>
struct unpack_wire_fn {
    const int* words;
    T* dst;
    std::size_t n;
    std::size_t tile;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = t * tile, e = b + tile < n ? b + tile : n;
#if defined(__CUDA_ARCH__)
        for (std::size_t i = b; i < e; ++i)
            dst[i] = static_cast<T>(wire_codec<Wire>::decode(wire_slot(words, i)));
#else
        decode_wire_host<Wire>(words, b, e - b, dst + b);
#endif
    }
};

/// data *= s on sys.
template <class System, class T>
void scale(const System& sys, std::span<T> data, T s) {
    if (data.empty())
        return;
    thrust::transform(sys.policy(), data.data(), data.data() + data.size(), data.data(),
                      scale_fn<T>{s});
}

/// data = 0 on sys.
template <class System, class T>
void zero(const System& sys, std::span<T> data) {
    if (data.empty())
        return;
    thrust::fill(sys.policy(), data.data(), data.data() + data.size(), T(0));
}

/// The number of NaN or infinite elements of data.
template <class System, class T>
std::size_t count_non_finite(const System& sys, std::span<const T> data) {
    if (data.empty())
        return 0;
    return static_cast<std::size_t>(
        thrust::transform_reduce(sys.policy(), data.data(), data.data() + data.size(),
                                 non_finite_fn<T>{}, std::size_t{0}, thrust::plus<std::size_t>()));
}

} // namespace lockstep::detail

// lockstep/train/detail/reduce_functors.hpp: the element-wise arithmetic of the reducers (scale,
// 16-bit wire packing, rank-ordered shard sums, finiteness) as host/device functors over Thrust.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/float16_convert.hpp"
#include "lockstep/kernels/for_each.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

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

/// 1 when x is NaN or infinite, else 0 (lockstep::is_finite).
template <class T>
struct non_finite_fn {
    LOCKSTEP_HOST_DEVICE int operator()(T x) const { return is_finite(x) ? 0 : 1; }
};

/// The wire kernels of reduce::compressed (compressed_all_reduce.hpp). Wire values travel as
/// 16-bit slots of int words (ints are a type every communicator carries): slot i is bytes 2i
/// and 2i + 1 of the word array, so two slots share a word. The conversions are those of
/// kernels/float16_convert.hpp: a host task converts a tile of wire_host_tile slots with the
/// array conversions, a device task one word (tile 2) with the scalar ones, the same bits.
inline constexpr std::size_t wire_host_tile = 4096;

/// The bytes of slot i of a word array.
LOCKSTEP_HOST_DEVICE inline unsigned char* wire_bytes(int* words, std::size_t i) {
    return reinterpret_cast<unsigned char*>(words) + 2 * i;
}
LOCKSTEP_HOST_DEVICE inline const unsigned char* wire_bytes(const int* words, std::size_t i) {
    return reinterpret_cast<const unsigned char*>(words) + 2 * i;
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
        kernels::round_to_16bit<Wire>(src + b, m - b, wire_bytes(words, b));
        if (e > m)
            std::memset(wire_bytes(words, m), 0, 2 * (e - m));
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
        const std::size_t n_back = n > b ? (n < e ? n : e) - b : 0;
        kernels::sum_16bit<Wire>(wire_bytes(blocks, b), shard, ranks, e - b, wire_bytes(out, b),
                                 dst + b, n_back);
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
        kernels::widen_from_16bit<Wire>(wire_bytes(words, b), e - b, dst + b);
    }
};

/// data *= s on sys.
template <class System, class T>
void scale(const System& sys, std::span<T> data, T s) {
    if (data.empty())
        return;
    kernels::with_policy_for(sys, data.size(), [&](auto policy) {
        thrust::transform(policy, data.data(), data.data() + data.size(), data.data(),
                          scale_fn<T>{s});
    });
}

/// data = 0 on sys.
template <class System, class T>
void zero(const System& sys, std::span<T> data) {
    if (data.empty())
        return;
    kernels::with_policy_for(sys, data.size(), [&](auto policy) {
        thrust::fill(policy, data.data(), data.data() + data.size(), T(0));
    });
}

/// The number of NaN or infinite elements of data.
template <class System, class T>
std::size_t count_non_finite(const System& sys, std::span<const T> data) {
    if (data.empty())
        return 0;
    return kernels::with_policy_for(sys, data.size(), [&](auto policy) {
        return static_cast<std::size_t>(thrust::transform_reduce(
            policy, data.data(), data.data() + data.size(), non_finite_fn<T>{}, std::size_t{0},
            thrust::plus<std::size_t>()));
    });
}

} // namespace lockstep::detail

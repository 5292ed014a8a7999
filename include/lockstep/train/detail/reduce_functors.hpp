// lockstep/train/detail/reduce_functors.hpp: the element-wise arithmetic of the reducers (scale,
// 16-bit wire packing, rank-ordered wire sums, finiteness) as host/device functors over Thrust.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/core/step_status.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
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

/// The 16 wire bits of x.
template <class Wire, class T>
LOCKSTEP_HOST_DEVICE std::uint32_t to_wire_bits(T x) {
    return Wire(static_cast<float>(x)).bits;
}
/// The value of 16 wire bits.
template <class Wire>
LOCKSTEP_HOST_DEVICE float from_wire_bits(std::uint32_t b) {
    return static_cast<float>(Wire::from_bits(static_cast<std::uint16_t>(b)));
}

/// Packs elements 2w and 2w + 1 of src (n elements; a missing odd tail packs 0) as two 16-bit
/// wire values into the 32-bit word w: low half = element 2w. Words travel as int, a type every
/// communicator carries.
template <class Wire, class T>
struct pack_wire_fn {
    const T* src;
    std::size_t n;
    int* words;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t w) const {
        const std::uint32_t lo = to_wire_bits<Wire>(src[2 * w]);
        const std::uint32_t hi = 2 * w + 1 < n ? to_wire_bits<Wire>(src[2 * w + 1]) : 0u;
        const std::uint32_t word = lo | (hi << 16);
        std::memcpy(words + w, &word, sizeof word);
    }
};

/// dst[2w], dst[2w + 1] = the sums over ranks r = 0..ranks-1, in rank order, of the two wire
/// values of word w of rank r's block (blocks of `words_per_rank` words, as all_gather lays
/// them out; dst has n elements, an odd tail's high half is ignored). Summing in T in a fixed
/// order gives every replica the same bits.
template <class Wire, class T>
struct sum_wire_fn {
    const int* words;
    std::size_t words_per_rank;
    int ranks;
    T* dst;
    std::size_t n;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t w) const {
        T lo = T(0), hi = T(0);
        for (int r = 0; r < ranks; ++r) {
            std::uint32_t word;
            std::memcpy(&word, words + static_cast<std::size_t>(r) * words_per_rank + w,
                        sizeof word);
            lo += static_cast<T>(from_wire_bits<Wire>(word & 0xffffu));
            hi += static_cast<T>(from_wire_bits<Wire>(word >> 16));
        }
        dst[2 * w] = lo;
        if (2 * w + 1 < n)
            dst[2 * w + 1] = hi;
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

/// Elements per task of count_non_finite_into: large enough that the host runs long vectorised
/// loops, small enough that a GPU has many tasks.
inline constexpr std::size_t non_finite_tile = std::size_t(1) << 14;

/// Task t: partial[t] = the NaN/inf elements of data[t * tile, min(n, (t + 1) * tile)).
template <class T>
struct tile_non_finite_fn {
    const T* data;
    std::size_t n;
    double* partial;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t begin = t * non_finite_tile;
        const std::size_t end = begin + non_finite_tile < n ? begin + non_finite_tile : n;
        const non_finite_fn<T> bad;
        std::uint32_t count = 0;
        for (std::size_t i = begin; i < end; ++i)
            count += static_cast<std::uint32_t>(bad(data[i]));
        partial[t] = static_cast<double>(count);
    }
};

/// One task: status[loss] += loss, status[non_finite] = the sum of the tiles' counts (in tile
/// order, so it does not depend on the thread count).
struct finish_status_fn {
    const double* partial;
    std::size_t tiles;
    double loss;
    double* status;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double count = 0;
        for (std::size_t t = 0; t < tiles; ++t)
            count += partial[t];
        status[status_slot::loss] += loss;
        status[status_slot::non_finite] = count;
    }
};

/// One task, after the status was summed over replicas: the skip decision, as the status slot
/// and as the int the optimizer kernels read (1: skip the update).
struct decide_skip_fn {
    double* status;
    int* skip;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        const bool bad =
            status[status_slot::non_finite] > 0 || status[status_slot::layer_errors] > 0;
        status[status_slot::skip] = bad ? 1.0 : 0.0;
        *skip = bad ? 1 : 0;
    }
};

/// The tasks count_non_finite_into runs for n elements (its partial buffer's size, >= 1).
inline std::size_t non_finite_tiles(std::size_t n) {
    const std::size_t t = (n + non_finite_tile - 1) / non_finite_tile;
    return t == 0 ? 1 : t;
}

/// On the device, without a host read: status[non_finite] = the NaN/inf elements of data, and
/// status[loss] += loss (a host value passed by value into the kernel). requires: partial holds
/// non_finite_tiles(data.size()) doubles and status status_slot::slots, both in sys's memory.
template <class System, class T>
void count_non_finite_into(const System& sys, std::span<const T> data, std::span<double> partial,
                           double loss, double* status) {
    const std::size_t tiles = (data.size() + non_finite_tile - 1) / non_finite_tile;
    if (tiles != 0)
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(tiles),
                         tile_non_finite_fn<T>{data.data(), data.size(), partial.data()});
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(1),
                     finish_status_fn{partial.data(), tiles, loss, status});
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

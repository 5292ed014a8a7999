// lockstep/comm/detail/shm_reduce.hpp: element type tags and the tiled, rank-ordered reduction
// the shared-memory collectives run. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep::detail::shm {

/// The element type of a collective, compared across replicas.
enum class element_type : unsigned char {
    int8,
    uint8,
    int16,
    uint16,
    int32,
    uint32,
    int64,
    uint64,
    float32,
    float64,
    bytes ///< any other trivially copyable type, compared by size only
};

/// The tag of T.
template <class T>
constexpr element_type element_type_of() noexcept {
    if constexpr (std::is_same_v<T, float>)
        return element_type::float32;
    else if constexpr (std::is_same_v<T, double>)
        return element_type::float64;
    else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
        constexpr bool s = std::is_signed_v<T>;
        if constexpr (sizeof(T) == 1)
            return s ? element_type::int8 : element_type::uint8;
        else if constexpr (sizeof(T) == 2)
            return s ? element_type::int16 : element_type::uint16;
        else if constexpr (sizeof(T) == 4)
            return s ? element_type::int32 : element_type::uint32;
        else if constexpr (sizeof(T) == 8)
            return s ? element_type::int64 : element_type::uint64;
        else
            return element_type::bytes;
    } else
        return element_type::bytes;
}

/// A readable name of an element type of `size` bytes, e.g. "float" or "int64".
inline std::string type_name(element_type t, std::size_t size) {
    switch (t) {
    case element_type::int8:
        return "int8";
    case element_type::uint8:
        return "uint8";
    case element_type::int16:
        return "int16";
    case element_type::uint16:
        return "uint16";
    case element_type::int32:
        return "int";
    case element_type::uint32:
        return "uint32";
    case element_type::int64:
        return "int64";
    case element_type::uint64:
        return "uint64";
    case element_type::float32:
        return "float";
    case element_type::float64:
        return "double";
    case element_type::bytes:
        break;
    }
    return std::to_string(size) + "-byte element";
}

/// "12 floats", "1 int".
inline std::string count_of(std::size_t n, element_type t, std::size_t size) {
    return std::to_string(n) + " " + type_name(t, size) + (n == 1 ? "" : "s");
}

/// Types the reductions accept: arithmetic, not bool.
template <class T>
inline constexpr bool reducible = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;

/// Reduces tile `t` of [begin, end): dst[i] = op(sources[0][i], sources[1][i], ...), applied
/// in source (rank) order, so every replica and every run produce the same bits. The tile is
/// accumulated in a local array first, so dst may alias any source (in-place collectives).
template <class T>
struct reduce_tile_fn {
    static constexpr std::size_t tile = sizeof(T) >= 8192 ? 1 : 8192 / sizeof(T);

    const T* const* sources;
    int n_sources;
    T* dst;
    std::size_t begin;
    std::size_t end;
    reduce_op op;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t first = begin + t * tile;
        const std::size_t n = end - first < tile ? end - first : tile;
        T acc[tile];
        const T* s0 = sources[0] + first;
        for (std::size_t i = 0; i < n; ++i)
            acc[i] = s0[i];
        for (int j = 1; j < n_sources; ++j) {
            const T* s = sources[j] + first;
            switch (op) {
            case reduce_op::sum:
                for (std::size_t i = 0; i < n; ++i)
                    acc[i] = static_cast<T>(acc[i] + s[i]);
                break;
            case reduce_op::max:
                for (std::size_t i = 0; i < n; ++i)
                    acc[i] = acc[i] < s[i] ? s[i] : acc[i];
                break;
            case reduce_op::min:
                for (std::size_t i = 0; i < n; ++i)
                    acc[i] = s[i] < acc[i] ? s[i] : acc[i];
                break;
            }
        }
        T* d = dst + first;
        for (std::size_t i = 0; i < n; ++i)
            d[i] = acc[i];
    }
};

/// Reduces elements [begin, end) of every source into dst, in source order, with the threads
/// of sys. requires: end >= begin; every source and dst hold at least `end` elements.
template <class T>
void reduce_range(const host_system& sys, const T* const* sources, int n_sources, T* dst,
                  std::size_t begin, std::size_t end, reduce_op op) {
    if (end <= begin)
        return;
    const reduce_tile_fn<T> fn{sources, n_sources, dst, begin, end, op};
    const std::size_t tiles = (end - begin + fn.tile - 1) / fn.tile;
    if (tiles < 4 || sys.threads() == 1) {
        for (std::size_t t = 0; t < tiles; ++t)
            fn(t);
        return;
    }
    thrust::for_each_n(sys.policy(), thrust::counting_iterator<std::size_t>(0), tiles, fn);
}

/// The element range [first, last) replica `rank` of `size` owns in a chunked collective over
/// `count` elements: equal chunks rounded up to whole cache lines, so owners never share one.
template <class T>
constexpr std::pair<std::size_t, std::size_t> owned_chunk(std::size_t count, int rank, int size) {
    constexpr std::size_t line = sizeof(T) >= 64 ? 1 : 64 / sizeof(T);
    const std::size_t n = static_cast<std::size_t>(size);
    std::size_t per = (count + n - 1) / n;
    per = (per + line - 1) / line * line;
    const std::size_t r = static_cast<std::size_t>(rank);
    return {std::min(count, r * per), std::min(count, (r + 1) * per)};
}

} // namespace lockstep::detail::shm

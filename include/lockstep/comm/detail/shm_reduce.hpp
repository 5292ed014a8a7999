// lockstep/comm/detail/shm_reduce.hpp: element type tags and the tiled, rank-ordered reduction
// the shared-memory collectives run. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/float16.hpp"
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
    float16,  ///< lockstep::half
    bfloat16, ///< lockstep::bfloat16
    bytes     ///< any other trivially copyable type, compared by size only
};

/// The tag of T.
template <class T>
constexpr element_type element_type_of() noexcept {
    if constexpr (std::is_same_v<T, float>)
        return element_type::float32;
    else if constexpr (std::is_same_v<T, double>)
        return element_type::float64;
    else if constexpr (std::is_same_v<T, half>)
        return element_type::float16;
    else if constexpr (std::is_same_v<T, bfloat16>)
        return element_type::bfloat16;
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
    case element_type::float16:
        return "half";
    case element_type::bfloat16:
        return "bfloat16";
    case element_type::bytes:
        break;
    }
    return std::to_string(size) + "-byte element";
}

/// "12 floats", "1 int".
inline std::string count_of(std::size_t n, element_type t, std::size_t size) {
    return std::to_string(n) + " " + type_name(t, size) + (n == 1 ? "" : "s");
}

/// Arithmetic types, not bool: the types the element-wise functors below combine directly.
template <class T>
inline constexpr bool reducible = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;
/// The types reduce_range accepts: reducible ones, and the 16-bit floats (see accumulator).
template <class T>
inline constexpr bool reducible_element = reducible<T> || is_wire_float16_v<T>;

/// The type a reduction combines elements of T in: T itself, or float for half and bfloat16,
/// which are converted exactly, combined in float and rounded once at the end, so a result is
/// round16(the float fold in rank order) on every replica. (max and min are exact either way.)
template <class T>
struct accumulator {
    using type = T;
    LOCKSTEP_HOST_DEVICE static T load(T x) { return x; }
    LOCKSTEP_HOST_DEVICE static T store(T x) { return x; }
};
template <class T>
requires is_wire_float16_v<T>
struct accumulator<T> {
    using type = float;
    LOCKSTEP_HOST_DEVICE static float load(T x) { return static_cast<float>(x); }
    LOCKSTEP_HOST_DEVICE static T store(float x) { return T(x); }
};

// Tells the compiler that a loop has no dependences between iterations. The reduction loops
// may write dst at exactly the index they read from a source (in-place collectives); without
// this the compiler guards the vector loop with an overlap test that sends such calls down a
// scalar path.
#if defined(__CUDA_ARCH__)
#define LOCKSTEP_SHM_IVDEP
#elif defined(__clang__)
#define LOCKSTEP_SHM_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define LOCKSTEP_SHM_IVDEP _Pragma("GCC ivdep")
#else
#define LOCKSTEP_SHM_IVDEP
#endif

/// The element-wise reductions. Integer sums wrap modulo 2^bits, as MPI's do: signed ones are
/// added in the unsigned type of the same width (signed overflow is undefined behaviour) and
/// converted back (modular since C++20).
struct sum_fn {
    template <class T>
    LOCKSTEP_HOST_DEVICE constexpr T operator()(T a, T b) const {
        if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
            using U = std::make_unsigned_t<T>;
            return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
        } else {
            return static_cast<T>(a + b);
        }
    }
};
struct max_fn {
    template <class T>
    LOCKSTEP_HOST_DEVICE T operator()(T a, T b) const {
        return a < b ? b : a;
    }
};
struct min_fn {
    template <class T>
    LOCKSTEP_HOST_DEVICE T operator()(T a, T b) const {
        return b < a ? b : a;
    }
};

/// dsts[k][i] = op(...op(op(s[0][i], s[1][i]), s[2][i])..., s[n_sources-1][i]) for every
/// destination k < n_dsts and i in [first, last), for any n_sources, n_dsts >= 1: each block of
/// elements is folded into a local buffer (in L1), in accumulator<T>::type, then stored to every
/// destination, so a destination may be a source.
template <class T, class Op>
LOCKSTEP_HOST_DEVICE void reduce_to_all_blocks(const T* const* s, int n_sources, T* const* dsts,
                                               int n_dsts, std::size_t first, std::size_t last) {
    using A = accumulator<T>;
    using Acc = typename A::type;
    constexpr std::size_t block = sizeof(Acc) >= 4096 ? 1 : 4096 / sizeof(Acc);
    const Op op{};
    Acc acc[block];
    for (std::size_t b = first; b < last; b += block) {
        const std::size_t m = last - b < block ? last - b : block;
        const T* s0 = s[0] + b;
        for (std::size_t i = 0; i < m; ++i)
            acc[i] = A::load(s0[i]);
        for (int j = 1; j < n_sources; ++j) {
            const T* sj = s[j] + b;
            for (std::size_t i = 0; i < m; ++i)
                acc[i] = op(acc[i], A::load(sj[i]));
        }
        for (int k = 0; k < n_dsts; ++k) {
            T* d = dsts[k] + b;
            for (std::size_t i = 0; i < m; ++i)
                d[i] = A::store(acc[i]);
        }
    }
}

/// dst[i] = op(...op(op(s[0][i], s[1][i]), s[2][i])..., s[n-1][i]) for i in [first, first + n):
/// the rank order every replica and every run uses, so all produce the same bits. Each
/// element is read from every source before it is written, so dst may be one of the sources.
/// The fold runs in accumulator<T>::type and is rounded to T once per element.
template <class T, class Op>
LOCKSTEP_HOST_DEVICE void reduce_block(const T* const* s, int n_sources, T* dst, std::size_t first,
                                       std::size_t n, Op op) {
    using A = accumulator<T>;
    T* d = dst + first;
    const T* s0 = s[0] + first;
    if (n_sources == 1) {
        if (d != s0) {
            LOCKSTEP_SHM_IVDEP
            for (std::size_t i = 0; i < n; ++i)
                d[i] = s0[i];
        }
        return;
    }
    const T* s1 = s[1] + first;
    if (n_sources == 2) {
        LOCKSTEP_SHM_IVDEP
        for (std::size_t i = 0; i < n; ++i)
            d[i] = A::store(op(A::load(s0[i]), A::load(s1[i])));
        return;
    }
    const T* s2 = s[2] + first;
    if (n_sources == 3) {
        LOCKSTEP_SHM_IVDEP
        for (std::size_t i = 0; i < n; ++i)
            d[i] = A::store(op(op(A::load(s0[i]), A::load(s1[i])), A::load(s2[i])));
        return;
    }
    const T* s3 = s[3] + first;
    if (n_sources == 4) {
        LOCKSTEP_SHM_IVDEP
        for (std::size_t i = 0; i < n; ++i)
            d[i] = A::store(
                op(op(op(A::load(s0[i]), A::load(s1[i])), A::load(s2[i])), A::load(s3[i])));
        return;
    }
    // More sources: fold through a local block, so dst is written only after every source of
    // the block has been read.
    reduce_to_all_blocks<T, Op>(s, n_sources, &dst, 1, first, first + n);
}

/// Reduces tile `t` of [begin, end) (see reduce_block), for a parallel loop over tiles.
template <class T, class Op>
struct reduce_tile_fn {
    static constexpr std::size_t tile = sizeof(T) >= 65536 ? 1 : 65536 / sizeof(T);

    const T* const* sources;
    int n_sources;
    T* dst;
    std::size_t begin;
    std::size_t end;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t first = begin + t * tile;
        reduce_block(sources, n_sources, dst, first, end - first < tile ? end - first : tile, Op{});
    }
};

/// fn(t) for every tile t in [0, tiles): on the threads of sys from 4 tiles on, inline below
/// (or with one thread).
template <class Fn>
void for_each_tile(const host_system& sys, std::size_t tiles, const Fn& fn) {
    if (tiles < 4 || sys.threads() == 1) {
        for (std::size_t t = 0; t < tiles; ++t)
            fn(t);
        return;
    }
    thrust::for_each_n(sys.policy(), thrust::counting_iterator<std::size_t>(0), tiles, fn);
}

/// f.template operator()<Op>() with Op the element-wise functor of op (sum_fn, max_fn, min_fn).
template <class F>
void with_reduction(reduce_op op, F&& f) {
    switch (op) {
    case reduce_op::sum:
        f.template operator()<sum_fn>();
        break;
    case reduce_op::max:
        f.template operator()<max_fn>();
        break;
    case reduce_op::min:
        f.template operator()<min_fn>();
        break;
    }
}

/// Reduces elements [begin, end) of every source into dst, in source order, with the threads
/// of sys. requires: end >= begin; every source and dst hold at least `end` elements; dst is
/// one of the sources or overlaps none of them.
template <class T>
void reduce_range(const host_system& sys, const T* const* sources, int n_sources, T* dst,
                  std::size_t begin, std::size_t end, reduce_op op) {
    if (end <= begin)
        return;
    with_reduction(op, [&]<class Op>() {
        const reduce_tile_fn<T, Op> fn{sources, n_sources, dst, begin, end};
        for_each_tile(sys, (end - begin + fn.tile - 1) / fn.tile, fn);
    });
}

/// dsts[k][i] = the fold in source order (reduce_block's bits) of the N sources at i, for every
/// destination k < N and i in [first, last): one loop that stores each value to every
/// destination straight from registers. (Reducing into one destination and copying it to the
/// others, block by block, was 1.15-1.4x a STREAM copy of the same bytes at 4 MiB on 2 replicas;
/// this loop is 0.93-0.95x.) Every source of an element is read before the element is written,
/// so a destination may be a source at the same index.
template <int N, class T, class Op>
void reduce_to_all_fixed(const T* const* s, T* const* dsts, std::size_t first, std::size_t last) {
    static_assert(N >= 2 && N <= 4);
    using A = accumulator<T>;
    const Op op{};
    const T* s0 = s[0];
    const T* s1 = s[1];
    const T* s2 = N > 2 ? s[2] : nullptr;
    const T* s3 = N > 3 ? s[3] : nullptr;
    T* d0 = dsts[0];
    T* d1 = dsts[1];
    T* d2 = N > 2 ? dsts[2] : nullptr;
    T* d3 = N > 3 ? dsts[3] : nullptr;
    LOCKSTEP_SHM_IVDEP
    for (std::size_t i = first; i < last; ++i) {
        auto v = op(A::load(s0[i]), A::load(s1[i]));
        if constexpr (N > 2)
            v = op(v, A::load(s2[i]));
        if constexpr (N > 3)
            v = op(v, A::load(s3[i]));
        const T r = A::store(v);
        d0[i] = r;
        d1[i] = r;
        if constexpr (N > 2)
            d2[i] = r;
        if constexpr (N > 3)
            d3[i] = r;
    }
}

/// Reduces tile `t` of [begin, end) and writes it to every destination: every byte of the tile
/// is read once from each source and written once to each destination, and no other tile's
/// elements are touched (see reduce_to_all_fixed, reduce_to_all_blocks).
template <class T, class Op>
struct reduce_to_all_tile_fn {
    static constexpr std::size_t tile = sizeof(T) >= 65536 ? 1 : 65536 / sizeof(T);

    const T* const* sources;
    int n_sources;
    T* const* dsts;
    int n_dsts;
    std::size_t begin;
    std::size_t end;

    void operator()(std::size_t t) const {
        const std::size_t first = begin + t * tile;
        const std::size_t last = end - first < tile ? end : first + tile;
        if (n_sources == n_dsts && n_sources == 2)
            reduce_to_all_fixed<2, T, Op>(sources, dsts, first, last);
        else if (n_sources == n_dsts && n_sources == 3)
            reduce_to_all_fixed<3, T, Op>(sources, dsts, first, last);
        else if (n_sources == n_dsts && n_sources == 4)
            reduce_to_all_fixed<4, T, Op>(sources, dsts, first, last);
        else
            reduce_to_all_blocks<T, Op>(sources, n_sources, dsts, n_dsts, first, last);
    }
};

/// Elements [begin, end) of every source reduced in source order (reduce_range's bits) and
/// written to every destination: one pass that reads each source and writes each destination
/// once (an all_reduce's owned chunk, reduce-scatter and all-gather fused). requires: end >=
/// begin; sources and destinations hold at least `end` elements; a destination is one of the
/// sources (at the same index) or overlaps none of them.
template <class T>
void reduce_to_all(const host_system& sys, const T* const* sources, int n_sources, T* const* dsts,
                   int n_dsts, std::size_t begin, std::size_t end, reduce_op op) {
    if (end <= begin)
        return;
    with_reduction(op, [&]<class Op>() {
        const reduce_to_all_tile_fn<T, Op> fn{sources, n_sources, dsts, n_dsts, begin, end};
        for_each_tile(sys, (end - begin + fn.tile - 1) / fn.tile, fn);
    });
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

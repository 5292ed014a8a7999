// lockstep/kernels/detail/anchored_host.hpp: the host's float loops of the anchored sums (a tile
// of elements read straight from their arrays of terms, in blocks of GNU vector types: no
// data-dependent branch, run on the widest vector registers the host has (on_widest_vectors), bit
// for bit anchored_sum_fn's results where they answer; anchored_combine_fn runs them) and of the
// pass that keeps a chunk, with host_system's overload of the accumulator's keep pass.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/system/detail/cpu_features.hpp"
#include "lockstep/system/host_system.hpp"

#if LOCKSTEP_HOST_X86
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace lockstep::kernels::detail {

/// Elements per tile of the sums: the tile's anchors, sums and flags live in registers or L1.
inline constexpr std::size_t anchored_tile = 256;
/// The most arrays a tile sums (their pointers on the stack).
inline constexpr std::size_t anchored_tile_terms = 256;
/// Elements per task of the keep pass (16 KiB of floats).
inline constexpr std::size_t anchored_keep_tile = 4096;
/// Chunks of at least this many bytes are kept with streaming stores (a large kept chunk is read
/// back long after, by the sums; smaller ones stay in the caches for the exchange).
inline constexpr std::size_t anchored_stream_bytes = std::size_t(4) << 20;

/// Bit 31 (63 for double) set exactly when x is not finite (its exponent field all ones; the
/// field plus one unit carries into the top bit), so OR-ing it over a range flags the range in
/// a loop that vectorises.
[[gnu::always_inline]] inline std::uint32_t anchored_non_finite_bit(float x) {
    return (std::bit_cast<std::uint32_t>(x) & 0x7f800000u) + 0x00800000u;
}
[[gnu::always_inline]] inline std::uint64_t anchored_non_finite_bit(double x) {
    return (std::bit_cast<std::uint64_t>(x) & 0x7ff0000000000000u) + 0x0010000000000000u;
}

/// Element i's terms sources[c][first + i], c < calls, as anchored_sum_fn reads them.
template <class T>
struct anchored_arrays {
    const T* const* sources;
    std::size_t calls;
    std::size_t first;
    static constexpr std::size_t replicas = 1;
    T value(std::size_t /*j*/, std::size_t c, std::size_t i) const { return sources[c][first + i]; }
};

/// Eight lanes of an anchored block in GNU vector types, which GCC and Clang compile to the
/// registers of the function's target (GCC 12's vectoriser leaves a plain loop's finish, with
/// its double compares and byte stores, in scalar code, and does worse with 16 lanes).
using anchored_lanes = std::int32_t __attribute__((vector_size(32)));
using anchored_bits = std::uint32_t __attribute__((vector_size(32)));
using anchored_floats = float __attribute__((vector_size(32)));
using anchored_sums = double __attribute__((vector_size(64)));

/// Asks for the cache line 256 bytes past `at` (an integer address: never a pointer past an
/// array; a prefetch does not fault). A tile reads k arrays at once, more streams than the
/// hardware prefetcher follows: without it the blocks wait on memory (8 arrays of 4 Mi floats
/// each, as MPI reproducible<8>'s owners sum them: about 1.3x as long).
[[gnu::always_inline]] inline void anchored_prefetch(const float* at) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): an address to prefetch, never dereferenced
    __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(at) + 256));
}

/// The float sums of 8 elements, p[j][at, at + 8) for j < k, into out[0, 8). Each element's
/// anchor a (its largest exponent field) and the smallest field of a non-zero term come first;
/// where every non-zero term lies within `bits` = 29 - ceil(log2 k) binades of a, every term is
/// a whole number of units 2^(a - 150 - bits) below 2^(24 + bits) units, so every partial sum
/// in double is exact and the conversion to float is the one rounding: anchored_sum_fn's result
/// (which keeps 60 bits below the anchor), unless a term or the result is subnormal (what a CPU
/// flushing subnormals, as -ffast-math's start-up code sets it, reads or writes as 0); a zero sum
/// is +0, as the flags cannot change. ok[i] (a mask) is -1 where out[i] holds it (or a quiet NaN
/// for a non-finite anchor), 0 where anchored_sum_fn must answer.
[[gnu::always_inline]] inline void anchored_block(const float* const* p, std::size_t k,
                                                  std::size_t at, int bits, float* out,
                                                  std::int32_t* ok) {
    // The magnitudes' bits order as their values (signed: the top bit is clear): the largest
    // one's field is the anchor. The smallest non-zero one's comes from the least key, the
    // magnitude + INT_MAX (wrapping), which sends zeros past every other term.
    anchored_lanes largest{};
    anchored_lanes least = anchored_lanes{} + 0x7fffffff;
    anchored_sums sum{};
    for (std::size_t j = 0; j < k; ++j) {
        anchored_floats x;
        std::memcpy(&x, p[j] + at, sizeof x);
        const anchored_lanes mag = __builtin_bit_cast(anchored_lanes, x) & 0x7fffffff;
        const auto key = __builtin_bit_cast(anchored_lanes,
                                            __builtin_bit_cast(anchored_bits, mag) + 0x7fffffffu);
        largest = mag > largest ? mag : largest;
        least = key < least ? key : least;
        anchored_prefetch(p[j] + at);
        // Exact where the block answers. Lane by lane, as GCC 12 turns it into one conversion
        // (vcvtps2pd to 512 bits), where __builtin_convertvector takes four instructions.
        sum += anchored_sums{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]};
    }
    // A smallest magnitude of 0: every term is 0; a smallest field of 0: a subnormal term.
    const anchored_lanes top = largest >> 23;
    const auto smallest =
        __builtin_bit_cast(anchored_lanes, __builtin_bit_cast(anchored_bits, least) - 0x7fffffffu);
    const anchored_lanes low = smallest == 0 ? 255 : smallest >> 23;
    // Normal or zero, read from the rounded sum's bits (GCC 12 splits double compares into
    // lanes); the sum scaled by 2^64 (exact) tells a zero from one flushed to zero.
    const auto rounded =
        __builtin_bit_cast(anchored_lanes, __builtin_convertvector(sum, anchored_floats));
    const auto scaled =
        __builtin_bit_cast(anchored_lanes, __builtin_convertvector(sum * 0x1p64, anchored_floats));
    // A non-finite anchor gives a quiet NaN; a term too far below the anchor, a subnormal term or
    // a subnormal result leaves the element to anchored_sum_fn.
    const anchored_lanes nan = top == anchored<float>::non_finite;
    const anchored_lanes zero = ((rounded | scaled) & 0x7fffffff) == 0;
    const anchored_lanes normal = ((rounded & 0x7fffffff) >= 0x00800000) | zero;
    const anchored_lanes result = nan != 0 ? 0x7fc00000 : (zero != 0 ? 0 : rounded);
    const anchored_lanes mask = nan | ((low != 0) & (low >= top - bits) & normal);
    std::memcpy(out, &result, sizeof result);
    std::memcpy(ok, &mask, sizeof mask);
}

/// The float sums of exactly 2 terms, p[0][at + i] + p[1][at + i] for i < 8, as anchored_block
/// reports them, in one float addition, which rounds the exact sum once to nearest even:
/// anchored_sum_fn's result where the larger magnitude is at least 2^-101: a term too far below
/// the other for the 128-bit sum to keep, a subnormal one included, is below half an ulp of it,
/// and a sum that does not cancel to +0 is normal or infinite, so no flush-to-zero mode changes
/// it. Two zeros give +0, a non-finite term a quiet NaN; the rest (both terms below 2^-101) is
/// left to anchored_sum_fn. Every decision reads the terms' bits, which no floating-point flag
/// changes.
[[gnu::always_inline]] inline void anchored_pair_block(const float* const* p, std::size_t at,
                                                       float* out, std::int32_t* ok) {
    anchored_floats x;
    anchored_floats y;
    std::memcpy(&x, p[0] + at, sizeof x);
    std::memcpy(&y, p[1] + at, sizeof y);
    const anchored_lanes a = __builtin_bit_cast(anchored_lanes, x) & 0x7fffffff; // magnitudes
    const anchored_lanes b = __builtin_bit_cast(anchored_lanes, y) & 0x7fffffff;
    const anchored_lanes hi = a > b ? a : b;
    const anchored_lanes zeros = hi == 0;
    const anchored_lanes bits = __builtin_bit_cast(anchored_lanes, x + y) & ~zeros;
    const anchored_lanes result = hi >= 0x7f800000 ? 0x7fc00000 : bits;
    const anchored_lanes mask = (hi >= 0x0d000000) | zeros;
    std::memcpy(out, &result, sizeof result);
    std::memcpy(ok, &mask, sizeof mask);
}

/// The float sums of m <= anchored_tile elements of k arrays (element i's terms: p[j][i], j < k)
/// into out[0, m), 8 at a time (anchored_pair_block for 2 arrays, anchored_block otherwise), and
/// their masks into ok[0, m) (-1: out[i] is anchored_sum_fn's result, 0: it must answer, as for
/// the elements of a short last block); returns true when every mask is -1. The arguments are
/// values: the blocks' byte stores would make a closure's members reload at every block.
/// requires: 1 <= k <= anchored_tile_terms.
[[gnu::always_inline]] inline bool anchored_blocks(const float* const* p, std::size_t k,
                                                   std::size_t m, float* out, std::int32_t* ok) {
    const std::size_t b = m - m % 8;
    const int bits = 29 - static_cast<int>(std::bit_width(k - 1));
    if (k == 2)
        for (std::size_t at = 0; at < b; at += 8)
            anchored_pair_block(p, at, out + at, ok + at);
    else
        for (std::size_t at = 0; at < b; at += 8)
            anchored_block(p, k, at, bits, out + at, ok + at);
    std::fill(ok + b, ok + m, 0);
    std::int32_t all = -1;
    for (std::size_t i = 0; i < m; ++i)
        all &= ok[i];
    return all != 0;
}

/// The float sums of m <= anchored_tile elements of k arrays p[j] into out[0, m), bit for bit
/// anchored_sum_fn's: anchored_blocks on the host's widest vector registers, then anchored_sum_fn
/// for the elements they leave. requires: 1 <= k <= anchored_tile_terms.
inline void anchored_tile_sums(const float* const* p, std::size_t k, std::size_t m, float* out) {
    std::int32_t ok[anchored_tile];
    if (lockstep::detail::on_widest_vectors([&]() __attribute__((always_inline)) {
            return anchored_blocks(p, k, m, out, ok);
        }))
        return;
    const anchored_sum_fn<float, anchored_arrays<float>> each{{p, k, 0}, out};
    for (std::size_t i = 0; i < m; ++i)
        if (ok[i] == 0)
            each(i);
}

/// Copies src[0, m) to dst (streaming stores past the caches where `stream`) and, where `clear`
/// (src itself) is not null, leaves zeros there.
[[gnu::always_inline]] inline void anchored_keep_loop(const float* src, float* dst, float* clear,
                                                      std::size_t m, [[maybe_unused]] bool stream) {
    std::size_t i = 0;
#if LOCKSTEP_HOST_X86
    // Streamed stores bypass the caches and skip reading dst's lines first: 2 bytes of memory
    // traffic per byte kept instead of 3. Whole lines of 16 floats in four SSE streaming stores
    // (the x86-64 baseline; the CPU combines them into one line write), after a head up to
    // dst's next 64-byte boundary; neither compiler here keeps `omp simd nontemporal`.
    const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(dst) % 64;
    if (stream && misaligned % sizeof(float) == 0) {
        i = std::min((64 - misaligned) % 64 / sizeof(float), m);
        std::copy(src, src + i, dst);
        if (clear != nullptr)
            std::fill(clear, clear + i, 0.0f);
        for (; i + 16 <= m; i += 16) {
            for (std::size_t q = 0; q < 16; q += 4)
                _mm_stream_ps(dst + i + q, _mm_loadu_ps(src + i + q));
            if (clear != nullptr) // while the line is in the caches
                std::memset(clear + i, 0, 16 * sizeof(float));
        }
        _mm_sfence(); // the streamed stores are ordered before the task's end is published
    }
#endif
    std::copy(src + i, src + m, dst + i);
    if (clear != nullptr)
        std::fill(clear + i, clear + m, 0.0f);
}

/// Task k: the part of keep tile t = first / anchored_keep_tile + k inside elements [first, end)
/// of src (a chunk's gradient) copied to dst at the same offsets (where the accumulator keeps
/// the chunk), and zeroed in src where `clear`. Host only.
struct anchored_keep_tiles_fn {
    const float* src;
    float* dst;
    float* clear;
    std::size_t first;
    std::size_t end;
    bool stream; ///< the chunk's bytes >= anchored_stream_bytes
    void operator()(std::size_t k) const {
        const std::size_t t = first / anchored_keep_tile + k;
        const std::size_t b = std::max(t * anchored_keep_tile, first);
        const std::size_t e = std::min((t + 1) * anchored_keep_tile, end);
        anchored_keep_loop(src + b, dst + b, clear != nullptr ? clear + b : nullptr, e - b, stream);
    }
};

} // namespace lockstep::kernels::detail

// host_system's overload of the keep pass of kernels/anchored_sum.hpp for float, in its own
// namespace so that argument-dependent lookup on a host_system finds it (as the batch-norm
// operations of bn_host_path.hpp): the tiles above.
namespace lockstep::host {

/// Keep tile by keep tile (anchored_keep_tiles_fn); streaming stores for a chunk of at least
/// anchored_stream_bytes.
inline void anchored_keep(const host_system& sys, const float* src, float* dst, float* clear,
                          std::size_t first, std::size_t end, std::size_t n) {
    using namespace kernels::detail;
    if (first < end)
        kernels::for_each_index(sys,
                                (end - 1) / anchored_keep_tile - first / anchored_keep_tile + 1,
                                anchored_keep_tiles_fn{src, dst, clear, first, end,
                                                       n * sizeof(float) >= anchored_stream_bytes},
                                end - first);
}

} // namespace lockstep::host

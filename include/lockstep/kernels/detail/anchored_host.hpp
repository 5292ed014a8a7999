// lockstep/kernels/detail/anchored_host.hpp: the host's float loops of the anchored sums (a tile
// of elements read straight from their arrays of terms) and of the pass that keeps a chunk and
// flags its non-finite tiles: plain loops with no data-dependent branch, run on the widest vector
// registers the host has (on_widest_vectors), bit for bit anchored_sum_fn's results where they
// answer.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/system/detail/cpu_features.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace lockstep::kernels::detail {

/// Elements per tile of the sums: the tile's anchors, sums and flags live in registers or L1.
inline constexpr std::size_t anchored_tile = 256;
/// Elements per tile of the keep pass (16 KiB of floats), one non-finite flag each.
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

/// The float sums of m <= anchored_tile elements of k arrays (element i's terms: p[j][i], j < k)
/// into out[0, m). Each element's anchor a (its largest exponent field) and the smallest field
/// of a non-zero term come first; where every non-zero term lies within bits = 29 -
/// ceil(log2 k) binades of a, every term is a whole number of units 2^(a - 150 - bits) below
/// 2^(24 + bits) units, so every partial sum in double is exact and the conversion to float is
/// the one rounding: anchored_sum_fn's result (which keeps 60 bits below the anchor), unless the
/// result is subnormal (where flush-to-zero modes would differ). done[i] = 1 where out[i] holds
/// it (or a quiet NaN for a non-finite anchor), 0 where anchored_sum_fn must answer. Returns
/// true when every done[i] is 1. requires: 1 <= k <= anchored_short_terms.
[[gnu::always_inline]] inline bool anchored_tile_loop(const float* const* p, std::size_t k,
                                                      std::size_t m, float* out,
                                                      unsigned char* done) {
    const int bits = 29 - static_cast<int>(std::bit_width(k - 1));
    // The magnitudes' bits order as their values: the largest one's field is the anchor, the
    // smallest non-zero one's (min of magnitude - 1, unsigned, sends zeros past every other
    // term) the smallest field.
    std::uint32_t largest[anchored_tile];
    std::uint32_t below[anchored_tile];
    double sum[anchored_tile];
    // In blocks of `lanes` elements whose accumulators stay in registers over the k terms (a
    // whole tile's would go through memory once per term), the last m mod lanes elements alone.
    constexpr std::size_t lanes = 16;
    for (std::size_t b = 0; b < m; b += lanes) {
        const std::size_t w = m - b < lanes ? m - b : lanes;
        std::uint32_t l[lanes];
        std::uint32_t d[lanes];
        double a[lanes];
        for (std::size_t i = 0; i < lanes; ++i) {
            l[i] = 0;
            d[i] = ~0u;
            a[i] = 0.0;
        }
        for (std::size_t j = 0; j < k; ++j) {
            const float* q = p[j] + b;
            const auto add = [&](std::size_t i) __attribute__((always_inline)) {
                const std::uint32_t mag = std::bit_cast<std::uint32_t>(q[i]) & 0x7fffffffu;
                l[i] = mag > l[i] ? mag : l[i];
                d[i] = mag - 1u < d[i] ? mag - 1u : d[i];
                a[i] += static_cast<double>(q[i]); // exact where the tile answers
            };
            if (w == lanes) {
#pragma omp simd
                for (std::size_t i = 0; i < lanes; ++i)
                    add(i);
            } else {
                for (std::size_t i = 0; i < w; ++i)
                    add(i);
            }
        }
        for (std::size_t i = 0; i < w; ++i) {
            largest[b + i] = l[i];
            below[b + i] = d[i];
            sum[b + i] = a[i];
        }
    }
    unsigned all = 1;
#pragma omp simd reduction(& : all)
    for (std::size_t i = 0; i < m; ++i) {
        const double v = sum[i];
        const double mag = v < 0 ? -v : v;
        // A non-finite anchor gives a quiet NaN; a term too far below the anchor or a subnormal
        // result leaves the element to anchored_sum_fn.
        const auto top = static_cast<std::int32_t>(std::max(largest[i] >> 23, 1u));
        const std::uint32_t smallest = below[i] + 1u; // 0: every term is zero
        const auto low =
            static_cast<std::int32_t>(smallest == 0 ? 255u : std::max(smallest >> 23, 1u));
        const bool nan = top == anchored<float>::non_finite;
        const bool ok = nan | ((low >= top - bits) & ((mag >= 0x1p-126) | (mag == 0.0)));
        out[i] = nan ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(v);
        done[i] = static_cast<unsigned char>(ok);
        all &= static_cast<unsigned>(ok);
    }
    return all != 0;
}

/// The float sums of exactly 2 terms, p[i] + q[i], as anchored_tile_loop reports them, in float
/// additions: one IEEE addition rounds the exact sum once to nearest even, anchored_sum_fn's
/// result wherever that is normal, infinite or zero (a term too far below the other for the
/// limbs to keep is below half an ulp of it; the sum starts from +0 as anchored_sum_fn's does,
/// so -0 + -0 gives +0). A non-finite term gives a quiet NaN; a subnormal result is left to
/// anchored_sum_fn (done[i] = 0).
[[gnu::always_inline]] inline bool anchored_pair_loop(const float* p, const float* q, std::size_t m,
                                                      float* out, unsigned char* done) {
    unsigned all = 1;
#pragma omp simd reduction(& : all)
    for (std::size_t i = 0; i < m; ++i) {
        const float x = p[i];
        const float y = q[i];
        const float sum = (0.0f + x) + y;
        const bool finite = (x - x == 0.0f) & (y - y == 0.0f); // false for infinities and NaNs
        const float mag = sum < 0.0f ? -sum : sum;
        out[i] = finite ? sum : std::numeric_limits<float>::quiet_NaN();
        const bool ok = !finite | (mag >= 0x1p-126f) | (sum == 0.0f);
        done[i] = static_cast<unsigned char>(ok);
        all &= static_cast<unsigned>(ok);
    }
    return all != 0;
}

/// The float sums of m <= anchored_tile elements of k arrays p[j] (anchored_pair_loop for 2,
/// anchored_tile_loop otherwise) on the host's widest vector registers.
/// requires: 1 <= k <= anchored_short_terms.
inline bool anchored_array_sums(const float* const* p, std::size_t k, std::size_t m, float* out,
                                unsigned char* done) {
    return lockstep::detail::on_widest_vectors([&]() __attribute__((always_inline)) {
        return k == 2 ? anchored_pair_loop(p[0], p[1], m, out, done)
                      : anchored_tile_loop(p, k, m, out, done);
    });
}

/// Task t: the float sums of elements [t anchored_tile, min(..., count)) of terms into out,
/// bit for bit what anchored_sum_fn<float> gives (which answers the elements the tile does
/// not). Host only. requires: terms.replicas * terms.calls <= anchored_short_terms.
struct anchored_sum_tiles_fn {
    anchored_terms<float> terms;
    std::size_t count;
    float* out;
    void operator()(std::size_t t) const {
        const std::size_t b = t * anchored_tile;
        const std::size_t m = std::min(count - b, anchored_tile);
        const float* p[anchored_short_terms];
        for (std::size_t j = 0; j < terms.replicas; ++j)
            for (std::size_t c = 0; c < terms.calls; ++c)
                p[j * terms.calls + c] =
                    terms.base + j * terms.replica_stride + c * terms.call_stride + b;
        unsigned char done[anchored_tile];
        if (!anchored_array_sums(p, terms.replicas * terms.calls, m, out + b, done))
            for (std::size_t i = 0; i < m; ++i)
                if (done[i] == 0)
                    anchored_sum_fn<float>{terms, out}(b + i);
    }
};

/// Copies src[0, m) to dst (streaming stores past the caches where `stream`) and, where `clear`
/// (src itself) is not null, leaves zeros there; returns 1 when one of the values is not finite.
[[gnu::always_inline]] inline unsigned anchored_keep_loop(const float* src, float* dst,
                                                          float* clear, std::size_t m,
                                                          [[maybe_unused]] bool stream) {
    std::uint32_t high = 0;
    std::size_t i = 0;
#if defined(__clang__)
    // Streamed stores bypass the caches and skip reading dst's lines first: 2 bytes of memory
    // traffic per byte kept instead of 3. Whole lines of 16 floats (the widest stores the
    // target has), after a head up to dst's next 64-byte boundary; neither compiler here keeps
    // `omp simd nontemporal`, and only clang has __builtin_nontemporal_store.
    using lines = float __attribute__((ext_vector_type(16)));
    using words = std::uint32_t __attribute__((ext_vector_type(16)));
    const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(dst) % 64;
    if (stream && misaligned % sizeof(float) == 0) {
        for (; i < std::min((64 - misaligned) % 64 / sizeof(float), m); ++i) {
            high |= anchored_non_finite_bit(src[i]);
            dst[i] = src[i];
            if (clear != nullptr)
                clear[i] = 0.0f;
        }
        words bits = 0;
        for (; i + 16 <= m; i += 16) {
            lines v;
            std::memcpy(&v, src + i, sizeof v);
            __builtin_nontemporal_store(v, reinterpret_cast<lines*>(dst + i));
            if (clear != nullptr) // while the line is in the caches
                std::memset(clear + i, 0, sizeof v);
            bits |= (__builtin_bit_cast(words, v) & 0x7f800000u) + 0x00800000u;
        }
        for (std::size_t q = 0; q < 16; ++q)
            high |= bits[q];
    }
#endif
#pragma omp simd reduction(| : high)
    for (std::size_t j = i; j < m; ++j) {
        high |= anchored_non_finite_bit(src[j]);
        dst[j] = src[j];
    }
    if (clear != nullptr)
        std::fill(clear + i, clear + m, 0.0f);
    return high >> 31;
}

/// The elements [begin, end) of keep tile t that lie inside [first, last).
inline std::pair<std::size_t, std::size_t> anchored_keep_part(std::size_t t, std::size_t first,
                                                              std::size_t last) {
    return {std::max(t * anchored_keep_tile, first), std::min((t + 1) * anchored_keep_tile, last)};
}

/// Task k: the part of keep tile t = first / anchored_keep_tile + k inside elements [first, end)
/// of src (a chunk's gradient) copied to dst at the same offsets (where the accumulator keeps
/// the chunk; dst null: nothing copied, the chunk stays in src), zeroed in src where `clear`,
/// and flags[t] set to 1 when one of them is not finite (flags null: none), so that the own
/// check reads only the flagged tiles. Tasks: tasks(first, end); a tile cut by two ranges is
/// flagged by either. Host only.
struct anchored_keep_tiles_fn {
    const float* src;
    float* dst;
    float* clear;
    std::size_t first;
    std::size_t end;
    unsigned char* flags;
    bool stream; ///< the chunk's bytes >= anchored_stream_bytes
    void operator()(std::size_t k) const {
        const std::size_t t = first / anchored_keep_tile + k;
        const auto part = anchored_keep_part(t, first, end);
        const std::size_t b = part.first;
        const std::size_t e = part.second;
        unsigned bad = 0;
        if (dst != nullptr) {
            float* const zeros = clear != nullptr ? clear + b : nullptr;
            bad = lockstep::detail::on_widest_vectors([&]() __attribute__((always_inline)) {
                return anchored_keep_loop(src + b, dst + b, zeros, e - b, stream);
            });
        } else {
            std::uint32_t high = 0;
            for (std::size_t i = b; i < e; ++i)
                high |= anchored_non_finite_bit(src[i]);
            bad = high >> 31;
        }
        if (bad != 0 && flags != nullptr)
            flags[t] = 1;
    }
    /// The tasks of [first, end). requires: first < end.
    static std::size_t tasks(std::size_t first, std::size_t end) noexcept {
        return (end - 1) / anchored_keep_tile - first / anchored_keep_tile + 1;
    }
};

/// Task t: anchored_own_check_fn<float> over elements [t anchored_keep_tile, min(..., count))
/// where flags[t] says a kept value there is not finite; elsewhere out is already what the
/// check leaves. Host only. requires: out is chunks.last.
struct anchored_mark_tiles_fn {
    anchored_chunks<float> chunks;
    std::size_t count;
    const unsigned char* flags;
    float* out;
    void operator()(std::size_t t) const {
        if (flags[t] == 0)
            return;
        const std::size_t b = t * anchored_keep_tile;
        for (std::size_t i = b; i < std::min(count, b + anchored_keep_tile); ++i)
            anchored_own_check_fn<float>{chunks, out}(i);
    }
};

} // namespace lockstep::kernels::detail

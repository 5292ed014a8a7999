// lockstep/kernels/detail/anchored_sum_host.hpp: the host's float anchored sums in tiles of
// elements (AVX2 where the CPU has it, else loops the compiler vectorises for the baseline), bit
// for bit equal to anchored_sum_fn.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/float16_arrays.hpp"
#include "lockstep/kernels/anchored_sum.hpp"

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if LOCKSTEP_F16_X86
#include <immintrin.h>
#define LOCKSTEP_ANCHORED_AVX2 __attribute__((target("avx2")))
#endif

namespace lockstep::kernels::detail {

/// Elements per tile: the tile's anchors, sums and flags live in registers or L1.
inline constexpr std::size_t anchored_tile = 256;

/// Test hook: set to true, the tiles take their portable loops even where AVX2 exists (tests run
/// both paths on one machine). Not for production use.
inline std::atomic<bool>& anchored_portable_only() noexcept {
    static std::atomic<bool> flag{false};
    return flag;
}

/// The binades below the anchor that a tile's sum keeps exactly for k terms: 29 - ceil(log2 k),
/// so that k terms of less than 2^(24 + bits) units sum to at most 2^53 units (exact in a
/// double). requires: k >= 1.
inline int anchored_tile_bits(std::size_t k) {
    return 29 - static_cast<int>(std::bit_width(k - 1)); // ceil(log2 k) for k >= 1
}

/// The float sums of the m <= anchored_tile elements [b, b + m) of terms at once, with no
/// data-dependent branch. One pass takes each element's largest exponent field a (the anchor)
/// and the smallest field of a non-zero term (1 for subnormals); where every non-zero term lies
/// within bits = anchored_tile_bits(terms) binades of a, every term is a whole number of units
/// u = 2^(a - 150 - bits) below 2^(24 + bits) units, so every partial sum in double is exact:
/// the double sum is the exact sum, and its conversion to float is the one rounding, which is
/// anchored_sum_fn's result (it keeps 60 bits below the anchor, so it cuts nothing there
/// either), unless the result is subnormal (where flush-to-zero modes would differ). done[i] =
/// 1 where out[b + i] holds it (or a quiet NaN for a non-finite anchor); 0 where
/// anchored_sum_fn must answer. Returns true when every done[i] is 1. requires: terms.replicas *
/// terms.calls <= anchored_short_terms.
[[gnu::always_inline]] inline bool anchored_tile_body(const anchored_terms<float>& terms,
                                                      std::size_t b, std::size_t m, float* out,
                                                      unsigned char* done) {
    const int bits = anchored_tile_bits(terms.replicas * terms.calls);
    std::int32_t top[anchored_tile];
    std::int32_t low[anchored_tile]; ///< the smallest field of a non-zero term (255: none)
    double sum[anchored_tile];
    for (std::size_t i = 0; i < anchored_tile; ++i) {
        top[i] = 1;
        low[i] = anchored<float>::non_finite;
        sum[i] = 0.0;
    }
    for (std::size_t j = 0; j < terms.replicas; ++j)
        for (std::size_t c = 0; c < terms.calls; ++c) {
            const float* p = terms.base + j * terms.replica_stride + c * terms.call_stride + b;
            for (std::size_t i = 0; i < m; ++i) {
                const auto u = std::bit_cast<std::uint32_t>(p[i]);
                const auto e = static_cast<std::int32_t>((u >> 23) & 0xffu);
                const std::int32_t field =
                    (u & 0x7fffffffu) == 0 ? anchored<float>::non_finite : (e > 1 ? e : 1);
                top[i] = e > top[i] ? e : top[i];
                low[i] = field < low[i] ? field : low[i];
            }
        }
    for (std::size_t j = 0; j < terms.replicas; ++j)
        for (std::size_t c = 0; c < terms.calls; ++c) {
            const float* p = terms.base + j * terms.replica_stride + c * terms.call_stride + b;
            for (std::size_t i = 0; i < m; ++i)
                sum[i] += static_cast<double>(p[i]); // exact where the tile answers
        }
    std::int64_t all = -1;
    for (std::size_t i = 0; i < m; ++i) {
        const double v = sum[i];
        const double mag = v < 0 ? -v : v;
        // Masks of 0 or -1, combined with bit operations (no branch): a non-finite anchor gives
        // a quiet NaN; a term too far below the anchor or a subnormal result leaves the element
        // to anchored_sum_fn.
        const std::int64_t nan = top[i] == anchored<float>::non_finite ? -1 : 0;
        const std::int64_t within = low[i] >= top[i] - bits ? -1 : 0;
        const std::int64_t normal = mag >= 0x1p-126 ? -1 : 0;
        const std::int64_t zero = mag == 0.0 ? -1 : 0;
        const double w = std::bit_cast<double>((std::bit_cast<std::int64_t>(v) & ~nan) |
                                               (std::int64_t{0x7ff8000000000000} & nan));
        out[b + i] = static_cast<float>(w); // the one rounding (to infinity past the range)
        const std::int64_t ok = nan | (within & (normal | zero));
        done[i] = static_cast<unsigned char>(ok & 1);
        all &= ok;
    }
    return all != 0;
}

/// The float sums of exactly 2 terms (terms.replicas * terms.calls == 2) over the m elements
/// [b, b + m), as anchored_tile_body reports them, in one pass of float additions: an IEEE
/// float addition rounds the exact sum once to nearest even, which is anchored_sum_fn's result
/// wherever that is normal, infinite or zero (a term too far below the other for the limbs to
/// keep is below half an ulp of it, so it cannot move the rounding either way; the sum starts
/// from +0 as anchored_sum_fn's does, so -0 + -0 gives +0). A non-finite term gives
/// anchored_sum_fn's quiet NaN; a subnormal result is left to anchored_sum_fn (done[i] = 0).
/// (The loop, over the m elements of two arrays p and q into out[0, m).)
[[gnu::always_inline]] inline bool anchored_pair_loop(const float* p, const float* q, std::size_t m,
                                                      float* out, unsigned char* done) {
    // Float operations only and no branch, so the loop vectorises (GCC 12 vectorises no loop
    // that mixes these float loads with their bits as integers).
    const float quiet_nan = std::numeric_limits<float>::quiet_NaN(); // anchored_sum_fn's bits
    unsigned all = 1;
    for (std::size_t i = 0; i < m; ++i) {
        const float x = p[i];
        const float y = q[i];
        const float sum = (0.0f + x) + y;
        const bool finite = (x - x == 0.0f) & (y - y == 0.0f); // false for infinities and NaNs
        const float mag = sum < 0.0f ? -sum : sum;
        out[i] = finite ? sum : quiet_nan;
        const unsigned ok = static_cast<unsigned>(!finite) |
                            static_cast<unsigned>(mag >= 0x1p-126f) |
                            static_cast<unsigned>(sum == 0.0f);
        done[i] = static_cast<unsigned char>(ok);
        all &= ok;
    }
    return all != 0;
}

inline bool anchored_pair_portable(const float* p, const float* q, std::size_t m, float* out,
                                   unsigned char* done) {
    return anchored_pair_loop(p, q, m, out, done);
}

inline bool anchored_tile_portable(const anchored_terms<float>& terms, std::size_t b, std::size_t m,
                                   float* out, unsigned char* done) {
    return anchored_tile_body(terms, b, m, out, done);
}

#if LOCKSTEP_F16_X86
LOCKSTEP_ANCHORED_AVX2 inline bool anchored_tile_avx2(const anchored_terms<float>& terms,
                                                      std::size_t b, std::size_t m, float* out,
                                                      unsigned char* done) {
    return anchored_tile_body(terms, b, m, out, done);
}
LOCKSTEP_ANCHORED_AVX2 inline bool anchored_pair_avx2(const float* p, const float* q, std::size_t m,
                                                      float* out, unsigned char* done) {
    return anchored_pair_loop(p, q, m, out, done);
}
#endif

/// Whether the tiles take their AVX2 loops (the CPU has them and the test hook allows them).
inline bool anchored_use_avx2() noexcept {
#if LOCKSTEP_F16_X86
    return lockstep::detail::cpu_has_f16c() &&
           !anchored_portable_only().load(std::memory_order_relaxed);
#else
    return false;
#endif
}

/// anchored_pair_loop over two arrays p and q, on the AVX2 loop where anchored_use_avx2().
inline bool anchored_pair(const float* p, const float* q, std::size_t m, float* out,
                          unsigned char* done) {
#if LOCKSTEP_F16_X86
    if (anchored_use_avx2())
        return anchored_pair_avx2(p, q, m, out, done);
#endif
    return anchored_pair_portable(p, q, m, out, done);
}

/// anchored_tile_body, on the AVX2 loop where anchored_use_avx2().
inline bool anchored_tile_sums(const anchored_terms<float>& terms, std::size_t b, std::size_t m,
                               float* out, unsigned char* done) {
#if LOCKSTEP_F16_X86
    if (anchored_use_avx2())
        return anchored_tile_avx2(terms, b, m, out, done);
#endif
    return anchored_tile_portable(terms, b, m, out, done);
}

/// Task t: the float sums of elements [t anchored_tile, min(..., count)) of terms into out,
/// bit for bit what anchored_sum_fn<float> gives (which answers the elements the tile does
/// not); 2 terms (2 replicas of one chunk, or one replica's 2 chunks) take anchored_pair_loop. Host
/// only. requires: terms.replicas * terms.calls <= anchored_short_terms.
struct anchored_sum_tiles_fn {
    anchored_terms<float> terms;
    std::size_t count;
    float* out;
    void operator()(std::size_t t) const {
        const std::size_t b = t * anchored_tile;
        const std::size_t m = count - b < anchored_tile ? count - b : anchored_tile;
        unsigned char done[anchored_tile];
        bool all = false;
        if (terms.replicas * terms.calls == 2) {
            // The second term is the other replica's value or this replica's other chunk.
            const float* p = terms.base + b;
            const float* q = p + (terms.replicas == 2 ? terms.replica_stride : terms.call_stride);
            all = anchored_pair(p, q, m, out + b, done);
        } else {
            all = anchored_tile_sums(terms, b, m, out, done);
        }
        if (!all)
            for (std::size_t i = 0; i < m; ++i)
                if (done[i] == 0)
                    anchored_sum_fn<float>{terms, out}(b + i);
    }
};

/// The anchored sums (anchored_sum_fn's bits) of elements [first, first + m) of n arrays of
/// terms: out[k] = the sum of sources[j][first + k] over j < n, rounded once. Each tile of
/// anchored_tile elements is copied from the arrays into one block (in L1) and summed there by
/// anchored_sum_tiles_fn (float, n <= anchored_short_terms) or anchored_sum_fn, so the arrays
/// may live anywhere (thread_communicator::all_combine's peers' buffers). out must not overlap
/// a source. requires: 1 <= n <= anchored_limits::max_terms.
template <class T>
struct anchored_combine_fn {
    void operator()(const T* const* sources, std::size_t n, std::size_t first, std::size_t m,
                    T* out) const {
        if constexpr (std::is_same_v<T, float>) {
            if (n == 2) {
                pair(sources[0] + first, sources[1] + first, m, out);
                return;
            }
        }
        constexpr std::size_t on_stack = 16;
        alignas(64) T local[n_local(on_stack)];
        std::vector<T> heap(n > on_stack ? n * anchored_tile : 0);
        T* stage = n > on_stack ? heap.data() : static_cast<T*>(local);
        for (std::size_t b = 0; b < m; b += anchored_tile) {
            const std::size_t mm = m - b < anchored_tile ? m - b : anchored_tile;
            for (std::size_t j = 0; j < n; ++j)
                std::memcpy(stage + j * anchored_tile, sources[j] + first + b, mm * sizeof(T));
            const anchored_terms<T> terms{stage, n, 1, anchored_tile, 0};
            if constexpr (std::is_same_v<T, float>) {
                if (n <= anchored_short_terms) {
                    anchored_sum_tiles_fn{terms, mm, out + b}(0);
                    continue;
                }
            }
            for (std::size_t i = 0; i < mm; ++i)
                anchored_sum_fn<T>{terms, out + b}(i);
        }
    }

private:
    static constexpr std::size_t n_local(std::size_t arrays) { return arrays * anchored_tile; }
    /// Two arrays: anchored_pair_loop straight from them (no staging), anchored_sum_fn for the
    /// elements it leaves (subnormal results).
    static void pair(const float* p, const float* q, std::size_t m, float* out) {
        unsigned char done[anchored_tile];
        for (std::size_t b = 0; b < m; b += anchored_tile) {
            const std::size_t mm = m - b < anchored_tile ? m - b : anchored_tile;
            if (!anchored_pair(p + b, q + b, mm, out + b, done))
                for (std::size_t i = 0; i < mm; ++i)
                    if (done[i] == 0) {
                        const float v[2] = {p[b + i], q[b + i]};
                        anchored_sum_fn<float>{{v, 2, 1, 1, 0}, out + b + i}(0);
                    }
        }
    }
};

} // namespace lockstep::kernels::detail

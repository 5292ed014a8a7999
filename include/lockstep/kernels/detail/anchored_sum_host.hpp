// lockstep/kernels/detail/anchored_sum_host.hpp: the host's float anchored sums and own checks in
// tiles of elements (AVX2 where the CPU has it, else loops the compiler vectorises for the
// baseline), bit for bit equal to anchored_sum_fn and anchored_own_check_fn.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/float16_arrays.hpp"
#include "lockstep/kernels/anchored_sum.hpp"

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#if LOCKSTEP_F16_X86
#define LOCKSTEP_ANCHORED_AVX2 __attribute__((target("avx2")))
#endif

namespace lockstep::kernels::detail {

/// Elements per tile: the tile's anchors, sums and flags live in registers or L1.
inline constexpr std::size_t anchored_tile = 64;

/// Test hook: set to true, the tiles take their portable loops even where AVX2 exists (tests run
/// both paths on one machine). Not for production use.
inline std::atomic<bool>& anchored_portable_only() noexcept {
    static std::atomic<bool> flag{false};
    return flag;
}

/// anchored_short_sum for the m <= anchored_tile elements [b, b + m) of terms at once, with no
/// data-dependent branch in the loops over terms: each element's anchor, its q = m 2^(31 - (a -
/// e)) summed in one int64, and whether a bit was cut. done[i] = 1 where out[b + i] was written
/// (a quiet NaN for a non-finite anchor, or the exact sum rounded once and normal or infinite);
/// 0 where anchored_sum_fn must answer. requires: terms.replicas * terms.calls <=
/// anchored_short_terms.
[[gnu::always_inline]] inline void anchored_tile_body(const anchored_terms<float>& terms,
                                                      std::size_t b, std::size_t m, float* out,
                                                      unsigned char* done) {
    // Every lane is 64 bits wide (anchors and flags too) and every condition is arithmetic, so
    // the loops vectorise in one width.
    std::int64_t top[anchored_tile];
    std::int64_t sum[anchored_tile];
    std::int64_t cut[anchored_tile]; ///< non-zero where a bit was cut
    for (std::size_t i = 0; i < anchored_tile; ++i) {
        top[i] = 1;
        sum[i] = 0;
        cut[i] = 0;
    }
    for (std::size_t j = 0; j < terms.replicas; ++j)
        for (std::size_t c = 0; c < terms.calls; ++c) {
            const float* p = terms.base + j * terms.replica_stride + c * terms.call_stride + b;
            for (std::size_t i = 0; i < m; ++i) {
                const auto e =
                    static_cast<std::int64_t>((std::bit_cast<std::uint32_t>(p[i]) >> 23) & 0xffu);
                top[i] = e > top[i] ? e : top[i];
            }
        }
    for (std::size_t j = 0; j < terms.replicas; ++j)
        for (std::size_t c = 0; c < terms.calls; ++c) {
            const float* p = terms.base + j * terms.replica_stride + c * terms.call_stride + b;
            for (std::size_t i = 0; i < m; ++i) {
                const auto u = static_cast<std::int64_t>(std::bit_cast<std::uint32_t>(p[i]));
                const std::int64_t e = (u >> 23) & 0xff;
                const std::int64_t normal = (e + 0xff) >> 8; // e != 0, as 0 or 1
                const std::int64_t mant = (u & 0x7fffff) | (normal << 23);
                const std::int64_t shift = 31 - top[i] + e + (1 - normal);
                const std::int64_t below = shift >> 63; // shift < 0, as 0 or -1
                cut[i] |= below & mant;
                const std::int64_t q = (mant << (shift & ~below)) & ~below;
                const std::int64_t neg = -(u >> 31); // 0 or -1
                sum[i] += (q ^ neg) - neg;
            }
        }
    for (std::size_t i = 0; i < m; ++i) {
        if (top[i] == anchored<float>::non_finite) {
            out[b + i] = std::numeric_limits<float>::quiet_NaN();
            done[i] = 1;
            continue;
        }
        const auto r = static_cast<float>(sum[i]); // int64 -> float: round to nearest even
        const double v =
            static_cast<double>(r) *
            std::bit_cast<double>(static_cast<std::uint64_t>(1023 + top[i] - 181) << 52);
        const bool ok = cut[i] == 0 && (v == 0.0 || (v < 0 ? -v : v) >= 0x1p-126);
        if (ok)
            out[b + i] = static_cast<float>(v);
        done[i] = static_cast<unsigned char>(ok);
    }
}

inline void anchored_tile_portable(const anchored_terms<float>& terms, std::size_t b, std::size_t m,
                                   float* out, unsigned char* done) {
    anchored_tile_body(terms, b, m, out, done);
}

#if LOCKSTEP_F16_X86
LOCKSTEP_ANCHORED_AVX2 inline void anchored_tile_avx2(const anchored_terms<float>& terms,
                                                      std::size_t b, std::size_t m, float* out,
                                                      unsigned char* done) {
    anchored_tile_body(terms, b, m, out, done);
}
#endif

/// Task t: the float sums of elements [t anchored_tile, min(..., count)) of terms into out,
/// bit for bit what anchored_sum_fn<float> gives (which answers the elements the tile does
/// not). Host only. requires: terms.replicas * terms.calls <= anchored_short_terms.
struct anchored_sum_tiles_fn {
    anchored_terms<float> terms;
    std::size_t count;
    float* out;
    void operator()(std::size_t t) const {
        const std::size_t b = t * anchored_tile;
        const std::size_t m = count - b < anchored_tile ? count - b : anchored_tile;
        unsigned char done[anchored_tile];
#if LOCKSTEP_F16_X86
        if (lockstep::detail::cpu_has_f16c() &&
            !anchored_portable_only().load(std::memory_order_relaxed))
            anchored_tile_avx2(terms, b, m, out, done);
        else
            anchored_tile_portable(terms, b, m, out, done);
#else
        anchored_tile_portable(terms, b, m, out, done);
#endif
        for (std::size_t i = 0; i < m; ++i)
            if (done[i] == 0)
                anchored_sum_fn<float>{terms, out}(b + i);
    }
};

/// Task t: anchored_own_check_fn<float> over elements [t anchored_tile, min(..., count)),
/// skipped where it would not change which elements are non-finite: when every value of the
/// tile has an exponent field below non_finite - 32, this replica's own sums there are finite,
/// and so is out (the last chunk). Host only; a read of the chunks in the common case.
/// requires: out is chunks.last.
struct anchored_own_check_tiles_fn {
    anchored_chunks<float> chunks;
    std::size_t count;
    float* out;
    void operator()(std::size_t t) const {
        const std::size_t b = t * anchored_tile;
        const std::size_t m = count - b < anchored_tile ? count - b : anchored_tile;
        constexpr std::uint32_t limit = anchored<float>::non_finite - 32;
        std::uint32_t high = 0; // non-zero when a field reaches limit
        for (std::size_t j = 0; j < chunks.count; ++j) {
            const float* p =
                j + 1 == chunks.count ? chunks.last : chunks.stored + j * chunks.stride;
            for (std::size_t i = b; i < b + m; ++i)
                high |= (((std::bit_cast<std::uint32_t>(p[i]) >> 23) & 0xffu) + (256 - limit)) >> 8;
        }
        if (high != 0)
            for (std::size_t i = b; i < b + m; ++i)
                anchored_own_check_fn<float>{chunks, out}(i);
    }
};

} // namespace lockstep::kernels::detail

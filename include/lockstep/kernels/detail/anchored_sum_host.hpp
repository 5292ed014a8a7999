// lockstep/kernels/detail/anchored_sum_host.hpp: the host's float anchored sums in tiles of
// elements (the x86 loops of anchored_x86_host.hpp where the CPU has them, chosen at run time,
// else the loops of anchored_tile_host.hpp, which the compiler vectorises), bit for bit equal to
// anchored_sum_fn. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/float16_arrays.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/detail/anchored_tile_host.hpp"
#include "lockstep/kernels/detail/anchored_x86_host.hpp"

#include <atomic>
#include <cstddef>

namespace lockstep::kernels::detail {

/// Test hook: set to true, the tiles take their portable loops even where AVX2 exists (tests run
/// both paths on one machine). Not for production use.
inline std::atomic<bool>& anchored_portable_only() noexcept {
    static std::atomic<bool> flag{false};
    return flag;
}

/// Test hook: set to true, the tiles take their AVX2 loops even where AVX-512 exists. Not for
/// production use.
inline std::atomic<bool>& anchored_avx512_off() noexcept {
    static std::atomic<bool> flag{false};
    return flag;
}

inline bool anchored_pair_portable(const float* p, const float* q, std::size_t m, float* out,
                                   unsigned char* done) {
    return anchored_pair_loop(p, q, m, out, done);
}

inline bool anchored_tile_portable(const float* const* p, std::size_t k, std::size_t m, float* out,
                                   unsigned char* done) {
    return anchored_tile_body(p, k, m, out, done);
}

/// Whether the tiles take their AVX2 loops (the CPU has them and the test hook allows them).
inline bool anchored_use_avx2() noexcept {
#if LOCKSTEP_F16_X86
    return lockstep::detail::cpu_has_f16c() &&
           !anchored_portable_only().load(std::memory_order_relaxed);
#else
    return false;
#endif
}

/// Whether the tiles take their AVX-512 loops (the CPU has them and the test hooks allow them).
inline bool anchored_use_avx512() noexcept {
#if LOCKSTEP_F16_X86
    return lockstep::detail::cpu_has_avx512f() &&
           !anchored_portable_only().load(std::memory_order_relaxed) &&
           !anchored_avx512_off().load(std::memory_order_relaxed);
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

/// anchored_tile_body, on the AVX-512 loop where anchored_use_avx512(), else on the AVX2 loop
/// where anchored_use_avx2().
inline bool anchored_tile_sums(const float* const* p, std::size_t k, std::size_t m, float* out,
                               unsigned char* done) {
#if LOCKSTEP_F16_X86
    if (anchored_use_avx512())
        return anchored_tile_avx512(p, k, m, out, done);
    if (anchored_use_avx2())
        return anchored_tile_avx2(p, k, m, out, done);
#endif
    return anchored_tile_portable(p, k, m, out, done);
}

/// The float sums of m <= anchored_tile elements of k arrays p[j] into out[0, m): one float
/// addition each for 2 arrays (anchored_pair), anchored_tile_sums otherwise; done and the
/// result as anchored_tile_body reports them. requires: 1 <= k <= anchored_short_terms.
inline bool anchored_array_sums(const float* const* p, std::size_t k, std::size_t m, float* out,
                                unsigned char* done) {
    return k == 2 ? anchored_pair(p[0], p[1], m, out, done)
                  : anchored_tile_sums(p, k, m, out, done);
}

/// Task t: the float sums of elements [t anchored_tile, min(..., count)) of terms into out,
/// bit for bit what anchored_sum_fn<float> gives (which answers the elements the tile does
/// not); 2 terms (2 replicas of one chunk, or one replica's 2 chunks) take anchored_pair_loop.
/// Host only. requires: terms.replicas * terms.calls <= anchored_short_terms.
struct anchored_sum_tiles_fn {
    anchored_terms<float> terms;
    std::size_t count;
    float* out;
    void operator()(std::size_t t) const {
        const std::size_t b = t * anchored_tile;
        const std::size_t m = count - b < anchored_tile ? count - b : anchored_tile;
        const std::size_t k = terms.replicas * terms.calls;
        const float* p[anchored_short_terms];
        for (std::size_t j = 0; j < terms.replicas; ++j)
            for (std::size_t c = 0; c < terms.calls; ++c)
                p[j * terms.calls + c] =
                    terms.base + j * terms.replica_stride + c * terms.call_stride + b;
        unsigned char done[anchored_tile];
        if (!anchored_array_sums(p, k, m, out + b, done))
            for (std::size_t i = 0; i < m; ++i)
                if (done[i] == 0)
                    anchored_sum_fn<float>{terms, out}(b + i);
    }
};

} // namespace lockstep::kernels::detail

// lockstep/kernels/detail/anchored_keep_host.hpp: the host's copies that keep a chunk's float
// gradient (leaving zeros behind where asked) while flagging the tiles that hold a non-finite
// value, the same flags for a chunk left in place, and the own check
// (anchored_own_check_fn) over the flagged tiles only. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/detail/anchored_sum_host.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

namespace lockstep::kernels::detail {

/// Elements per tile of the keep pass (16 KiB of floats), one flag each.
inline constexpr std::size_t anchored_keep_tile = 4096;

/// The elements [begin, end) of keep tile t that lie inside [first, end).
struct anchored_tile_part {
    std::size_t begin;
    std::size_t end;
};
inline anchored_tile_part anchored_keep_part(std::size_t t, std::size_t first, std::size_t end) {
    return {std::max(t * anchored_keep_tile, first), std::min((t + 1) * anchored_keep_tile, end)};
}

/// Copies src[0, m) to dst and, where `clear` is not null (it is src itself), leaves zeros there
/// (a chunk kept from the gradient the next chunk accumulates on); returns 1 when one of the
/// values is not finite (its exponent field all ones), else 0. (The portable loop.)
[[gnu::always_inline]] inline unsigned anchored_keep_loop(const float* src, float* dst,
                                                          float* clear, std::size_t m) {
    std::uint32_t high = 0;
    for (std::size_t i = 0; i < m; ++i) {
        high |= anchored_non_finite_bit(src[i]);
        dst[i] = src[i];
        if (clear != nullptr)
            clear[i] = 0.0f;
    }
    return high >> 31;
}

inline unsigned anchored_keep_portable(const float* src, float* dst, float* clear, std::size_t m) {
    return anchored_keep_loop(src, dst, clear, m);
}

#if LOCKSTEP_F16_X86
/// anchored_keep_loop, the stores to dst streamed where `stream` (after a scalar head up to
/// dst's next 32-byte boundary): a large kept chunk is read back long after (by the sums, after
/// the next chunks' passes), so it bypasses the caches, and the copy moves 2 bytes of memory
/// traffic per byte instead of 3. The zeros go back where the values were read (while the
/// backward that wrote them may still hold them in the caches).
LOCKSTEP_ANCHORED_AVX2 inline unsigned
anchored_keep_avx2(const float* src, float* dst, float* clear, std::size_t m, bool stream) {
    const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(dst) & 31u;
    if (!stream || misaligned % sizeof(float) != 0)
        return anchored_keep_loop(src, dst, clear, m);
    const std::size_t head = std::min((32u - misaligned) % 32u / sizeof(float), m);
    unsigned bad = anchored_keep_loop(src, dst, clear, head);
    const __m256i field = _mm256_set1_epi32(0x7f800000);
    const __m256i unit = _mm256_set1_epi32(0x00800000);
    const __m256 zero = _mm256_setzero_ps();
    __m256i high = _mm256_setzero_si256();
    std::size_t i = head;
    for (; i + 8 <= m; i += 8) {
        const __m256 v = _mm256_loadu_ps(src + i);
        _mm256_stream_ps(dst + i, v);
        if (clear != nullptr)
            _mm256_storeu_ps(clear + i, zero);
        high = _mm256_or_si256(
            high, _mm256_add_epi32(_mm256_and_si256(_mm256_castps_si256(v), field), unit));
    }
    _mm_sfence(); // the streamed stores reach memory before the task ends
    bad |= anchored_keep_loop(src + i, dst + i, clear != nullptr ? clear + i : nullptr, m - i);
    return bad | (_mm256_movemask_ps(_mm256_castsi256_ps(high)) != 0 ? 1u : 0u);
}

/// anchored_keep_avx2 on 512-bit registers (16 floats a store, after a head up to dst's next
/// 64-byte boundary, so each streamed store fills a whole cache line).
LOCKSTEP_ANCHORED_AVX512 inline unsigned
anchored_keep_avx512(const float* src, float* dst, float* clear, std::size_t m, bool stream) {
    const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(dst) & 63u;
    if (!stream || misaligned % sizeof(float) != 0)
        return anchored_keep_loop(src, dst, clear, m);
    const std::size_t head = std::min((64u - misaligned) % 64u / sizeof(float), m);
    unsigned bad = anchored_keep_loop(src, dst, clear, head);
    const __m512i field = _mm512_set1_epi32(0x7f800000);
    const __m512i unit = _mm512_set1_epi32(0x00800000);
    const __m512 zero = _mm512_setzero_ps();
    __m512i high = _mm512_setzero_si512();
    std::size_t i = head;
    for (; i + 16 <= m; i += 16) {
        const __m512 v = _mm512_loadu_ps(src + i);
        _mm512_stream_ps(dst + i, v);
        if (clear != nullptr)
            _mm512_storeu_ps(clear + i, zero);
        high = _mm512_or_si512(
            high, _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(v), field), unit));
    }
    _mm_sfence(); // the streamed stores reach memory before the task ends
    bad |= anchored_keep_loop(src + i, dst + i, clear != nullptr ? clear + i : nullptr, m - i);
    const __mmask16 sign = _mm512_test_epi32_mask(high, _mm512_set1_epi32(INT32_MIN));
    return bad | (sign != 0 ? 1u : 0u);
}
#endif

/// Chunks of at least this many bytes are kept with streaming stores (smaller ones stay in the
/// caches for the exchange that reads them soon after): anchored_keep_tiles_fn::stream.
inline constexpr std::size_t anchored_stream_bytes = std::size_t(4) << 20;

/// Task k: the part of keep tile t = first / anchored_keep_tile + k inside elements [first, end)
/// of src (a chunk's gradient): copied to dst (the same offsets, where the accumulator keeps the
/// chunk), zeroed in src where `clear` (src itself, whose next chunk's backward accumulates
/// there; null to leave src as it is), and flags[t] set to 1 when one of them is not finite
/// (left as it is otherwise), so that the own check later reads only the flagged tiles (flags
/// null: none are set; the exchanges whose sums report each replica's non-finite values need
/// none). Tasks = the keep tiles [first, end) touches (tasks()); a tile cut by two ranges is
/// flagged by either. With `stream`, the AVX-512 and AVX2 loops store the kept values past the
/// caches. Host only.
struct anchored_keep_tiles_fn {
    const float* src;
    float* dst;
    float* clear;
    std::size_t first;
    std::size_t end;
    unsigned char* flags;
    bool stream; ///< the chunk's bytes >= anchored_stream_bytes, for the trainer
    void operator()(std::size_t k) const {
        const std::size_t t = first / anchored_keep_tile + k;
        const auto [b, e] = anchored_keep_part(t, first, end);
        float* const zeros = clear != nullptr ? clear + b : nullptr;
        unsigned bad = 0;
#if LOCKSTEP_F16_X86
        if (anchored_use_avx512())
            bad = anchored_keep_avx512(src + b, dst + b, zeros, e - b, stream);
        else if (anchored_use_avx2())
            bad = anchored_keep_avx2(src + b, dst + b, zeros, e - b, stream);
        else
#endif
            bad = anchored_keep_portable(src + b, dst + b, zeros, e - b);
        if (bad != 0 && flags != nullptr)
            flags[t] = 1;
    }
    /// The tasks of [first, end). requires: first < end.
    static std::size_t tasks(std::size_t first, std::size_t end) noexcept {
        return (end - 1) / anchored_keep_tile - first / anchored_keep_tile + 1;
    }
};

/// Task k: flags[t] = 1 for keep tile t = first / anchored_keep_tile + k when one of the
/// elements of src inside [first, end) there is not finite (left as it is otherwise): the
/// flags of anchored_keep_tiles_fn for a chunk that stays where the backward wrote it (the
/// last one), read while the backward may still hold it in the caches. Tasks: as
/// anchored_keep_tiles_fn::tasks. Host only.
struct anchored_flag_tiles_fn {
    const float* src;
    std::size_t first;
    std::size_t end;
    unsigned char* flags;
    void operator()(std::size_t k) const {
        const std::size_t t = first / anchored_keep_tile + k;
        const auto [b, e] = anchored_keep_part(t, first, end);
        std::uint32_t high = 0;
        for (std::size_t i = b; i < e; ++i)
            high |= anchored_non_finite_bit(src[i]);
        if ((high >> 31) != 0)
            flags[t] = 1;
    }
};

/// Task t: anchored_own_check_fn<float> over elements [t anchored_keep_tile, min(..., count))
/// where flags[t] (set by anchored_keep_tiles_fn for every kept chunk) says a kept value there
/// is not finite; elsewhere out is already what the check leaves. Host only. requires: out is
/// chunks.last.
struct anchored_mark_tiles_fn {
    anchored_chunks<float> chunks;
    std::size_t count;
    const unsigned char* flags;
    float* out;
    void operator()(std::size_t t) const {
        if (flags[t] == 0)
            return;
        const std::size_t b = t * anchored_keep_tile;
        const std::size_t m = count - b < anchored_keep_tile ? count - b : anchored_keep_tile;
        for (std::size_t i = b; i < b + m; ++i)
            anchored_own_check_fn<float>{chunks, out}(i);
    }
};

} // namespace lockstep::kernels::detail

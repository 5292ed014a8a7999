// lockstep/kernels/detail/anchored_combine.hpp: anchored_combine_fn, the anchored sums of arrays
// read where they lie (thread_communicator::all_combine's pass; a block's owner over MPI), and
// its report of what the sums saw: whether one is not finite, and for each replica's group of
// arrays the elements where one of its values is not finite. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/detail/anchored_host.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <type_traits>

namespace lockstep::kernels::detail {

/// Where anchored_combine_fn reports what it saw in the elements it summed: words_for(groups)
/// host doubles (whole numbers, ready for an all_gather), zero before the first call, updated
/// atomically (a pass's tiles run on several threads) by a tile whose sums are not all finite:
/// - words[0]: 1 when a sum is not finite (a non-finite value, whose sum is a quiet NaN, or an
///   exact sum beyond T's range, an infinity), else 0;
/// - words[1 + 2 j]: the elements holding a non-finite value of group j, the sources [j size,
///   (j + 1) size) (a replica's chunks);
/// - words[2 + 2 j]: 1 + the flat index (index_base + element) of the first of them, 0: none.
/// words null: no report.
struct anchored_combine_report {
    double* words = nullptr;
    std::size_t groups = 0;
    std::size_t size = 0;       ///< sources per group
    std::size_t index_base = 0; ///< the flat index of the arrays' element 0
    static constexpr std::size_t words_for(std::size_t groups) noexcept { return 1 + 2 * groups; }
};

/// Adds to `report` what the sums out[0, m) of elements [first, first + m) saw: nothing when every
/// sum is finite (one pass over out); else the words above, from the sources of the elements
/// whose sum is a quiet NaN (exactly those with a non-finite value).
template <class T>
void anchored_note(const anchored_combine_report& report, const T* const* sources,
                   std::size_t first, std::size_t m, const T* out) {
    anchored_word<T> high = 0;
    for (std::size_t i = 0; i < m; ++i)
        high |= anchored_non_finite_bit(out[i]);
    if ((high >> (8 * sizeof(T) - 1)) == 0)
        return;
    std::atomic_ref<double>(report.words[0]).store(1.0, std::memory_order_relaxed);
    for (std::size_t j = 0; j < report.groups; ++j) {
        double count = 0;
        double at = 0;
        for (std::size_t i = 0; i < m; ++i) {
            if (!is_nan(out[i]))
                continue;
            bool bad = false;
            for (std::size_t c = 0; c < report.size; ++c)
                bad = bad || anchored_split(sources[j * report.size + c][first + i]).field ==
                                 anchored<T>::non_finite;
            if (bad) {
                ++count;
                at = at == 0 ? static_cast<double>(report.index_base + first + i + 1) : at;
            }
        }
        if (count == 0)
            continue;
        std::atomic_ref<double>(report.words[1 + 2 * j])
            .fetch_add(count, std::memory_order_relaxed);
        std::atomic_ref<double> least(report.words[2 + 2 * j]);
        double now = least.load(std::memory_order_relaxed);
        while ((now == 0 || at < now) &&
               !least.compare_exchange_weak(now, at, std::memory_order_relaxed)) {
        }
    }
}

/// The anchored sums (anchored_sum_fn's bits) of elements [first, first + m) of n arrays, read
/// where they lie (all_combine's peers' buffers): out[k] = the sum of sources[j][first + k] over
/// j < n, rounded once; float sums of at most anchored_tile_terms arrays tile by tile
/// (anchored_tile_sums). With report.words, each call adds what its sums saw (anchored_note), so
/// the owner learns, without another pass, whether every sum is finite and which group's values
/// were not. out must not overlap a source. requires: 1 <= n <= anchored_limits::max_terms; with
/// a report, n == report.groups * report.size.
template <class T>
struct anchored_combine_fn {
    anchored_combine_report report{};
    void operator()(const T* const* sources, std::size_t n, std::size_t first, std::size_t m,
                    T* out) const {
        const bool tiles = std::is_same_v<T, float> && n <= anchored_tile_terms;
        if constexpr (std::is_same_v<T, float>) {
            const float* p[anchored_tile_terms];
            for (std::size_t b = 0; tiles && b < m; b += anchored_tile) {
                for (std::size_t j = 0; j < n; ++j)
                    p[j] = sources[j] + first + b;
                anchored_tile_sums(p, n, std::min(m - b, anchored_tile), out + b);
            }
        }
        const anchored_sum_fn<T, anchored_arrays<T>> each{{sources, n, first}, out};
        for (std::size_t i = 0; !tiles && i < m; ++i)
            each(i);
        if (report.words != nullptr)
            anchored_note(report, sources, first, m, out);
    }
};

} // namespace lockstep::kernels::detail

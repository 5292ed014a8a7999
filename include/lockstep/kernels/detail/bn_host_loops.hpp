// lockstep/kernels/detail/bn_host_loops.hpp: the host fast path of the batch-norm kernels:
// OpenMP over channels x partitions, vectorizable inner loops, the same arithmetic functors as
// the generic Thrust path. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/channel_geometry.hpp"
#include "lockstep/kernels/detail/bn_host_inner.hpp"
#include "lockstep/kernels/moments.hpp"

#include <algorithm>
#include <cstddef>
#include <vector>

namespace lockstep::kernels::detail {

// Two shapes of loop cover every layout:
// - planes (inner > 1, NCHW): channel c of sample o is a contiguous run of `inner` values. A
//   task is (channel, range of samples); it keeps `lanes` Welford lanes that step in lockstep
//   through the run in chunks (so they share one reciprocal count and vectorize), plus
//   inner % lanes tail lanes that step once per sample. Enough independent lanes hide the
//   latency of the dependent mean update.
// - rows (inner == 1, NHWC and N x C): a row holds every channel. A task is a range of rows
//   times a block of `lanes` channels, whose Welford states step together row by row, again
//   sharing the count.
// Partials are Chan-merged per channel in a fixed order that depends on the shape only.

/// inv[k] = 1 / (k + 1) for k < n: the Welford reciprocals, divided once per call in a vector
/// loop instead of once per step on the dependent path (same values, so same results).
template <class Acc>
std::vector<Acc> reciprocals(std::size_t n) {
    std::vector<Acc> inv(n);
    for (std::size_t k = 0; k < n; ++k)
        inv[k] = Acc(1) / static_cast<Acc>(k + 1);
    return inv;
}

/// Rows per task of the elementwise row loops.
inline constexpr std::size_t rows_per_task = 64;

/// Sample partitions per channel for plane tasks: about 256 tasks in all, at most one per sample.
inline std::size_t plane_partitions(const channel_geometry& g) {
    const std::size_t want = (256 + g.channels - 1) / std::max<std::size_t>(g.channels, 1);
    return std::max<std::size_t>(1, std::min(want, g.outer));
}

/// Row partitions for row tasks: at least 256 rows each, at most 64 partitions.
inline std::size_t row_partitions(const channel_geometry& g) {
    return std::max<std::size_t>(1, std::min<std::size_t>(64, g.outer / 256));
}

template <class T, class Acc>
void host_channel_moments(int threads, const T* x, channel_geometry g, moments<Acc>* out) {
    const std::size_t C = g.channels;
    (void)threads;
    if (g.inner > 1) {
        constexpr std::size_t L = plane_lanes<Acc>;
        const std::size_t parts = plane_partitions(g);
        const std::size_t full = g.inner / L * L;
        const std::size_t tail = g.inner - full;
        std::vector<moments<Acc>> partial(C * parts);
        const std::size_t samples_per_task = (g.outer + parts - 1) / parts;
        const std::vector<Acc> inv =
            reciprocals<Acc>(samples_per_task * std::max<std::size_t>(1, full / L));
        const auto tasks = static_cast<std::ptrdiff_t>(C * parts);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < tasks; ++t) {
            const std::size_t c = static_cast<std::size_t>(t) / parts;
            const std::size_t p = static_cast<std::size_t>(t) % parts;
            Acc mean[L] = {};
            Acc m2[L] = {};
            Acc tmean[L] = {};
            Acc tm2[L] = {};
            std::size_t chunks = 0;
            std::size_t samples = 0;
            for (std::size_t o = g.outer * p / parts; o < g.outer * (p + 1) / parts; ++o) {
                const T* plane = x + (o * C + c) * g.inner;
                for (std::size_t i = 0; i < full; i += L)
                    welford_fixed<L>(mean, m2, plane + i, inv[chunks++]);
                welford_run(tmean, tm2, plane + full, tail, inv[samples++]);
            }
            moments<Acc> m =
                merge_lanes(moments<Acc>{}, mean, m2, chunks > 0 ? L : 0, static_cast<Acc>(chunks));
            partial[static_cast<std::size_t>(t)] =
                merge_lanes(m, tmean, tm2, tail, static_cast<Acc>(samples));
        }
        merge_partials_fn<Acc> merge{partial.data(), parts, out};
        for (std::size_t c = 0; c < C; ++c)
            merge(c);
    } else {
        // tasks: row partitions x blocks of L channels; a block's state lives in registers
        constexpr std::size_t L = plane_lanes<Acc>;
        const std::size_t parts = row_partitions(g);
        const std::size_t blocks = (C + L - 1) / L;
        std::vector<Acc> state(parts * 2 * C);
        const std::vector<Acc> inv = reciprocals<Acc>((g.outer + parts - 1) / parts);
        const auto tasks = static_cast<std::ptrdiff_t>(parts * blocks);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < tasks; ++t) {
            const std::size_t p = static_cast<std::size_t>(t) / blocks;
            const std::size_t c0 = static_cast<std::size_t>(t) % blocks * L;
            const std::size_t width = std::min(L, C - c0);
            Acc mean[L] = {};
            Acc m2[L] = {};
            const std::size_t begin = g.outer * p / parts, end = g.outer * (p + 1) / parts;
            if (width == L) {
                for (std::size_t o = begin; o < end; ++o)
                    welford_fixed<L>(mean, m2, x + o * C + c0, inv[o - begin]);
            } else {
                for (std::size_t o = begin; o < end; ++o)
                    welford_run(mean, m2, x + o * C + c0, width, inv[o - begin]);
            }
            Acc* out_mean = state.data() + p * 2 * C + c0;
            for (std::size_t j = 0; j < width; ++j) {
                out_mean[j] = mean[j];
                out_mean[C + j] = m2[j];
            }
        }
        const chan_merge merge;
        for (std::size_t c = 0; c < C; ++c) {
            moments<Acc> m;
            for (std::size_t p = 0; p < parts; ++p) {
                // Integer division on purpose: partition p's rows are [outer p / parts, ...).
                const Acc rows = static_cast<Acc>(
                    g.outer * (p + 1) / parts - // NOLINT(bugprone-integer-division)
                    g.outer * p / parts);       // NOLINT(bugprone-integer-division)
                m = merge(m, moments<Acc>{rows, state[p * 2 * C + c], state[p * 2 * C + C + c]});
            }
            out[c] = m;
        }
    }
}

template <class T, class Acc>
void host_normalize(int threads, const T* x, T* y, channel_geometry g, const Acc* mean,
                    const Acc* scale, const Acc* beta) {
    const std::size_t C = g.channels;
    (void)threads;
    if (g.inner > 1) {
        const auto planes = static_cast<std::ptrdiff_t>(g.outer * C);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < planes; ++t) {
            const std::size_t c = static_cast<std::size_t>(t) % C;
            const std::size_t off = static_cast<std::size_t>(t) * g.inner;
            normalize_run(x + off, y + off, g.inner, mean[c], scale[c], beta[c]);
        }
    } else {
        constexpr std::size_t L = plane_lanes<Acc>;
        const std::size_t blocks = (C + L - 1) / L;
        const std::size_t chunks = (g.outer + rows_per_task - 1) / rows_per_task;
        const auto tasks = static_cast<std::ptrdiff_t>(chunks * blocks);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < tasks; ++t) {
            const std::size_t r0 = static_cast<std::size_t>(t) / blocks * rows_per_task;
            const std::size_t rows = std::min(rows_per_task, g.outer - r0);
            const std::size_t c0 = static_cast<std::size_t>(t) % blocks * L;
            const std::size_t off = r0 * C + c0;
            if (C - c0 >= L) {
                normalize_rows<L>(x + off, y + off, rows, C, mean + c0, scale + c0, beta + c0);
            } else {
                for (std::size_t r = 0; r < rows; ++r)
                    normalize_row(x + off + r * C, y + off + r * C, C - c0, mean + c0, scale + c0,
                                  beta + c0);
            }
        }
    }
}

template <class T, class Acc>
void host_backward_sums(int threads, const T* dy, const T* x, channel_geometry g, const Acc* mean,
                        Acc* sums) {
    const std::size_t C = g.channels;
    (void)threads;
    if (g.inner > 1) {
        constexpr std::size_t L = plane_lanes<Acc>;
        const std::size_t parts = plane_partitions(g);
        const std::size_t full = g.inner / L * L;
        std::vector<Acc> partial(2 * C * parts);
        const auto tasks = static_cast<std::ptrdiff_t>(C * parts);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < tasks; ++t) {
            const std::size_t c = static_cast<std::size_t>(t) / parts;
            const std::size_t p = static_cast<std::size_t>(t) % parts;
            Acc sdy[L] = {};
            Acc sdyx[L] = {};
            // the tail has its own scalar sums: a runtime-length loop over sdy would keep the
            // lanes in memory instead of registers
            Acc a = 0;
            Acc b = 0;
            for (std::size_t o = g.outer * p / parts; o < g.outer * (p + 1) / parts; ++o) {
                const std::size_t off = (o * C + c) * g.inner;
                for (std::size_t i = 0; i < full; i += L)
                    backward_fixed<L>(sdy, sdyx, dy + off + i, x + off + i, mean[c]);
                for (std::size_t i = full; i < g.inner; ++i)
                    backward_accumulate(a, b, static_cast<Acc>(dy[off + i]),
                                        static_cast<Acc>(x[off + i]), mean[c]);
            }
            for (std::size_t j = 0; j < L; ++j) {
                a += sdy[j];
                b += sdyx[j];
            }
            partial[2 * static_cast<std::size_t>(t)] = a;
            partial[2 * static_cast<std::size_t>(t) + 1] = b;
        }
        merge_backward_fn<Acc> merge{partial.data(), parts, C, sums};
        for (std::size_t c = 0; c < C; ++c)
            merge(c);
    } else {
        // tasks: row partitions x blocks of L channels
        constexpr std::size_t L = plane_lanes<Acc>;
        const std::size_t parts = row_partitions(g);
        const std::size_t blocks = (C + L - 1) / L;
        std::vector<Acc> state(parts * 2 * C, Acc(0));
        const auto tasks = static_cast<std::ptrdiff_t>(parts * blocks);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < tasks; ++t) {
            const std::size_t p = static_cast<std::size_t>(t) / blocks;
            const std::size_t c0 = static_cast<std::size_t>(t) % blocks * L;
            const std::size_t begin = g.outer * p / parts, end = g.outer * (p + 1) / parts;
            Acc* sdy = state.data() + p * 2 * C + c0;
            if (C - c0 >= L) {
                backward_rows<L>(sdy, sdy + C, dy + begin * C + c0, x + begin * C + c0, end - begin,
                                 C, mean + c0);
            } else {
                for (std::size_t o = begin; o < end; ++o)
                    backward_row(sdy, sdy + C, dy + o * C + c0, x + o * C + c0, mean + c0, C - c0);
            }
        }
        for (std::size_t c = 0; c < C; ++c) {
            Acc a = 0;
            Acc b = 0;
            for (std::size_t p = 0; p < parts; ++p) {
                a += state[p * 2 * C + c];
                b += state[p * 2 * C + C + c];
            }
            sums[c] = a;
            sums[C + c] = b;
        }
    }
}

template <class T, class Acc>
void host_input_gradient(int threads, const T* dy, const T* x, T* dx, channel_geometry g,
                         backward_coefficients<Acc> co) {
    const std::size_t C = g.channels;
    (void)threads;
    if (g.inner > 1) {
        const auto planes = static_cast<std::ptrdiff_t>(g.outer * C);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < planes; ++t) {
            const std::size_t c = static_cast<std::size_t>(t) % C;
            const std::size_t off = static_cast<std::size_t>(t) * g.inner;
            gradient_run(dy + off, x + off, dx + off, g.inner, co.mean[c], co.k[c], co.a[c],
                         co.b[c]);
        }
    } else {
        constexpr std::size_t L = plane_lanes<Acc>;
        const std::size_t blocks = (C + L - 1) / L;
        const std::size_t chunks = (g.outer + rows_per_task - 1) / rows_per_task;
        const auto tasks = static_cast<std::ptrdiff_t>(chunks * blocks);
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
        for (std::ptrdiff_t t = 0; t < tasks; ++t) {
            const std::size_t r0 = static_cast<std::size_t>(t) / blocks * rows_per_task;
            const std::size_t rows = std::min(rows_per_task, g.outer - r0);
            const std::size_t c0 = static_cast<std::size_t>(t) % blocks * L;
            const std::size_t off = r0 * C + c0;
            if (C - c0 >= L) {
                gradient_rows<L>(dy + off, x + off, dx + off, rows, C, co.mean + c0, co.k + c0,
                                 co.a + c0, co.b + c0);
            } else {
                for (std::size_t r = 0; r < rows; ++r)
                    gradient_row(dy + off + r * C, x + off + r * C, dx + off + r * C, C - c0,
                                 co.mean + c0, co.k + c0, co.a + c0, co.b + c0);
            }
        }
    }
}

} // namespace lockstep::kernels::detail

// lockstep/kernels/detail/bn_host_inner.hpp: the vectorizable inner loops of the host batch-norm
// fast path (lane counts, fixed-width and runtime-width runs). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>

namespace lockstep::kernels::detail {

/// Accumulator lanes per task: as many as the vector registers hold with room to spare
/// (4 x 512-bit registers per accumulator array with AVX-512, else 128 bytes), so the Welford
/// state stays in registers and enough independent lanes hide the latency of the mean update.
#if defined(__AVX512F__)
inline constexpr std::size_t lane_bytes = 256;
#else
inline constexpr std::size_t lane_bytes = 128;
#endif
template <class Acc>
inline constexpr std::size_t plane_lanes = lane_bytes / sizeof(Acc);

/// Welford over exactly L values (a compile-time count, so the loop unrolls into registers).
template <std::size_t L, class T, class Acc>
inline void welford_fixed(Acc* __restrict mean, Acc* __restrict m2, const T* __restrict x,
                          Acc inv_count) {
    for (std::size_t j = 0; j < L; ++j)
        welford_accumulate(mean[j], m2[j], static_cast<Acc>(x[j]), inv_count);
}

template <class T, class Acc>
inline void welford_run(Acc* __restrict mean, Acc* __restrict m2, const T* __restrict x,
                        std::size_t n, Acc inv_count) {
    for (std::size_t j = 0; j < n; ++j)
        welford_accumulate(mean[j], m2[j], static_cast<Acc>(x[j]), inv_count);
}

template <class T, class Acc>
inline void backward_row(Acc* __restrict sdy, Acc* __restrict sdyx, const T* __restrict dy,
                         const T* __restrict x, const Acc* __restrict mean, std::size_t n) {
    for (std::size_t j = 0; j < n; ++j)
        backward_accumulate(sdy[j], sdyx[j], static_cast<Acc>(dy[j]), static_cast<Acc>(x[j]),
                            mean[j]);
}

template <class T, class Acc>
inline void normalize_run(const T* __restrict x, T* __restrict y, std::size_t n, Acc mean,
                          Acc scale, Acc beta) {
    for (std::size_t j = 0; j < n; ++j)
        y[j] = static_cast<T>(normalize_value(static_cast<Acc>(x[j]), mean, scale, beta));
}

template <class T, class Acc>
inline void normalize_row(const T* __restrict x, T* __restrict y, std::size_t n,
                          const Acc* __restrict mean, const Acc* __restrict scale,
                          const Acc* __restrict beta) {
    for (std::size_t j = 0; j < n; ++j)
        y[j] = static_cast<T>(normalize_value(static_cast<Acc>(x[j]), mean[j], scale[j], beta[j]));
}

template <class T, class Acc>
inline void gradient_run(const T* __restrict dy, const T* __restrict x, T* __restrict dx,
                         std::size_t n, Acc mean, Acc k, Acc a, Acc b) {
    for (std::size_t j = 0; j < n; ++j)
        dx[j] = static_cast<T>(
            input_gradient(static_cast<Acc>(dy[j]), static_cast<Acc>(x[j]), mean, k, a, b));
}

template <class T, class Acc>
inline void gradient_row(const T* __restrict dy, const T* __restrict x, T* __restrict dx,
                         std::size_t n, const Acc* __restrict mean, const Acc* __restrict k,
                         const Acc* __restrict a, const Acc* __restrict b) {
    for (std::size_t j = 0; j < n; ++j)
        dx[j] = static_cast<T>(input_gradient(static_cast<Acc>(dy[j]), static_cast<Acc>(x[j]),
                                              mean[j], k[j], a[j], b[j]));
}

/// The fixed-width (L channels) row loops: per-channel coefficients and sums are copied into
/// local arrays, which the unrolled loops keep in registers across rows.
template <std::size_t L, class T, class Acc>
inline void backward_fixed(Acc* __restrict sdy, Acc* __restrict sdyx, const T* __restrict dy,
                           const T* __restrict x, Acc mean) {
    for (std::size_t j = 0; j < L; ++j)
        backward_accumulate(sdy[j], sdyx[j], static_cast<Acc>(dy[j]), static_cast<Acc>(x[j]), mean);
}

template <std::size_t L, class T, class Acc>
inline void backward_rows(Acc* __restrict out_dy, Acc* __restrict out_dyx, const T* __restrict dy,
                          const T* __restrict x, std::size_t rows, std::size_t stride,
                          const Acc* __restrict mean_in) {
    Acc mean[L], sdy[L] = {}, sdyx[L] = {};
    for (std::size_t j = 0; j < L; ++j)
        mean[j] = mean_in[j];
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t j = 0; j < L; ++j)
            backward_accumulate(sdy[j], sdyx[j], static_cast<Acc>(dy[r * stride + j]),
                                static_cast<Acc>(x[r * stride + j]), mean[j]);
    for (std::size_t j = 0; j < L; ++j) {
        out_dy[j] = sdy[j];
        out_dyx[j] = sdyx[j];
    }
}

template <std::size_t L, class T, class Acc>
inline void normalize_rows(const T* __restrict x, T* __restrict y, std::size_t rows,
                           std::size_t stride, const Acc* __restrict mean_in,
                           const Acc* __restrict scale_in, const Acc* __restrict beta_in) {
    Acc mean[L], scale[L], beta[L];
    for (std::size_t j = 0; j < L; ++j) {
        mean[j] = mean_in[j];
        scale[j] = scale_in[j];
        beta[j] = beta_in[j];
    }
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t j = 0; j < L; ++j)
            y[r * stride + j] = static_cast<T>(
                normalize_value(static_cast<Acc>(x[r * stride + j]), mean[j], scale[j], beta[j]));
}

template <std::size_t L, class T, class Acc>
inline void gradient_rows(const T* __restrict dy, const T* __restrict x, T* __restrict dx,
                          std::size_t rows, std::size_t stride, const Acc* __restrict mean_in,
                          const Acc* __restrict k_in, const Acc* __restrict a_in,
                          const Acc* __restrict b_in) {
    Acc mean[L], k[L], a[L], b[L];
    for (std::size_t j = 0; j < L; ++j) {
        mean[j] = mean_in[j];
        k[j] = k_in[j];
        a[j] = a_in[j];
        b[j] = b_in[j];
    }
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t j = 0; j < L; ++j)
            dx[r * stride + j] = static_cast<T>(input_gradient(static_cast<Acc>(dy[r * stride + j]),
                                                               static_cast<Acc>(x[r * stride + j]),
                                                               mean[j], k[j], a[j], b[j]));
}

} // namespace lockstep::kernels::detail

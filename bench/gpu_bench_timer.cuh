// gpu_bench's timing: every timed call runs after a read-only pass over a buffer of several L2
// sizes, between its own pair of CUDA events; medians over the calls. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

namespace gpu_bench {

/// Reads n vectors and writes nothing unless their XOR is a value a zero-filled buffer never
/// gives: the loads stay, and the lines they leave in L2 are clean (a memset as the flush would
/// leave dirty lines whose write-back would land in the next timed call).
__global__ void flush_kernel(const uint4* p, std::size_t n, unsigned* sink) {
    unsigned acc = 0;
    const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
    for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint4 v = __ldcg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u)
        *sink = acc;
}

/// One timed quantity: the median and the fastest of the timed calls, in milliseconds.
struct sample {
    double median_ms = 0;
    double min_ms = 0;
};

/// Times calls enqueued on one stream, each after an L2 flush (so every call starts with its
/// data in DRAM, as in a network where other layers ran in between), with CUDA events around the
/// call alone; one host synchronisation per quantity.
class timer {
public:
    /// requires: stream belongs to the current device; l2_bytes from cudaDeviceProp.
    timer(cudaStream_t stream, std::size_t l2_bytes, int sms, int warmup, int iterations)
        : stream_(stream), warmup_(warmup), iterations_(std::max(iterations, 1)),
          grid_(static_cast<unsigned>(std::max(sms, 1) * 8)) {
        // four L2 sizes, at least 128 MiB: L2's hashing and its two partitions keep a little of
        // a buffer only twice its size
        flush_bytes_ = std::max<std::size_t>(4 * l2_bytes, std::size_t(128) << 20);
        LOCKSTEP_CUDA_CHECK(cudaMalloc(&flush_, flush_bytes_));
        LOCKSTEP_CUDA_CHECK(cudaMalloc(&sink_, sizeof(unsigned)));
        LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(flush_, 0, flush_bytes_, stream_));
        start_.resize(static_cast<std::size_t>(iterations_));
        stop_.resize(static_cast<std::size_t>(iterations_));
        for (std::size_t i = 0; i < start_.size(); ++i) {
            LOCKSTEP_CUDA_CHECK(cudaEventCreate(&start_[i]));
            LOCKSTEP_CUDA_CHECK(cudaEventCreate(&stop_[i]));
        }
    }
    timer(const timer&) = delete;
    timer& operator=(const timer&) = delete;
    ~timer() {
        for (std::size_t i = 0; i < start_.size(); ++i) {
            (void)cudaEventDestroy(start_[i]);
            (void)cudaEventDestroy(stop_[i]);
        }
        (void)cudaFree(flush_);
        (void)cudaFree(sink_);
    }

    /// Bytes the flush reads before every call.
    std::size_t flush_bytes() const { return flush_bytes_; }
    int iterations() const { return iterations_; }

    /// Evicts the L2 (untimed).
    void flush() {
        flush_kernel<<<grid_, 256, 0, stream_>>>(static_cast<const uint4*>(flush_),
                                                 flush_bytes_ / sizeof(uint4), sink_);
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    }

    /// f() enqueues the work to time on the stream: warm-up calls, then the timed ones, each
    /// after a flush.
    template <class F>
    sample time(F&& f) {
        for (int i = 0; i < warmup_; ++i) {
            flush();
            f();
        }
        for (std::size_t i = 0; i < start_.size(); ++i) {
            flush();
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(start_[i], stream_));
            f();
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(stop_[i], stream_));
        }
        LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(stop_.back()));
        std::vector<double> ms(start_.size());
        for (std::size_t i = 0; i < start_.size(); ++i) {
            float t = 0;
            LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&t, start_[i], stop_[i]));
            ms[i] = t;
        }
        std::sort(ms.begin(), ms.end());
        const std::size_t n = ms.size();
        return {n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]), ms.front()};
    }

private:
    cudaStream_t stream_;
    int warmup_;
    int iterations_;
    unsigned grid_;
    std::size_t flush_bytes_ = 0;
    void* flush_ = nullptr;
    unsigned* sink_ = nullptr;
    std::vector<cudaEvent_t> start_, stop_;
};

/// Deterministic values in [lo, hi) at p[0, n) (a hash of the index and the seed).
template <class T>
__global__ void fill_kernel(T* p, std::size_t n, unsigned seed, float lo, float hi) {
    const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
    for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        std::uint32_t h = static_cast<std::uint32_t>(i) ^
                          (static_cast<std::uint32_t>(i >> 32) * 0x85ebca6bu) ^ seed;
        h ^= h >> 16;
        h *= 0x7feb352du;
        h ^= h >> 15;
        h *= 0x846ca68bu;
        h ^= h >> 16;
        const float u = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
        p[i] = static_cast<T>(lo + (hi - lo) * u);
    }
}

/// *out = max over i of |a[i] - b[i]| (as float; NaN beats every number). *out must start at 0.
template <class T>
__global__ void max_diff_kernel(const T* a, const T* b, std::size_t n, unsigned* out) {
    float m = 0;
    const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
    for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float d = fabsf(static_cast<float>(a[i]) - static_cast<float>(b[i]));
        if (!(d <= m) && m == m) // a NaN, once found, stays
            m = d;
    }
    // non-negative floats (and NaN above them) order as their bit patterns
    atomicMax(out, __float_as_uint(m));
}

} // namespace gpu_bench

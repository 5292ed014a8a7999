// gpu_bench: lockstep's CUDA batch norm (forward: moments + coefficients + normalize; backward:
// sums + fused dx) next to cuDNN's batch norm and the memory-traffic bound, and an NCCL
// all_reduce bandwidth line. SPDX-License-Identifier: Apache-2.0
//
// The traffic bound of a training BN step over S bytes of activations is 8 S: the forward reads
// x twice and writes y (3 S), the backward reads dy and x twice and writes dx (5 S). It is
// timed at the device's cudaMemcpy device-to-device bandwidth (read + write bytes per second),
// and every time is printed as a ratio to it (1.00 = at the bound).
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>
#if LOCKSTEP_HAS_NCCL
#include <nccl.h>
#endif

namespace {

using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::kernels::channel_geometry;

#define BENCH_CUDNN(expr)                                                                          \
    do {                                                                                           \
        const cudnnStatus_t bench_status_ = (expr);                                                \
        if (bench_status_ != CUDNN_STATUS_SUCCESS) {                                               \
            std::fprintf(stderr, "%s failed: %s\n", #expr, cudnnGetErrorString(bench_status_));    \
            std::exit(1);                                                                          \
        }                                                                                          \
    } while (0)

constexpr int warmup = 5;
constexpr int iterations = 20;

/// Milliseconds per call of f (enqueued on stream), averaged over `iterations` after warm-up.
template <class F>
double time_ms(cudaStream_t stream, F f) {
    cudaEvent_t start, stop;
    LOCKSTEP_CUDA_CHECK(cudaEventCreate(&start));
    LOCKSTEP_CUDA_CHECK(cudaEventCreate(&stop));
    for (int i = 0; i < warmup; ++i)
        f();
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < iterations; ++i)
        f();
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(stop, stream));
    LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    LOCKSTEP_CUDA_CHECK(cudaEventDestroy(start));
    LOCKSTEP_CUDA_CHECK(cudaEventDestroy(stop));
    return ms / iterations;
}

/// Device-to-device copy bandwidth in bytes per second (read + write).
double copy_bandwidth(const cuda_system& sys) {
    const std::size_t bytes = std::size_t(256) << 20;
    buffer<std::byte, cuda_system> a(bytes, sys), b(bytes, sys);
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(a.data(), 0, bytes, sys.stream()));
    const double ms = time_ms(sys.stream(), [&] {
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, sys.stream()));
    });
    return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

/// The merge + coefficients step between the forward collectives and normalize (one replica: the
/// packed block is the merged statistics): mean, invstd, scale = gamma * invstd, the count for
/// the backward pass, running statistics.
__global__ void coefficients_kernel(const float* block, std::size_t channels, float eps,
                                    const float* gamma, float* mean, float* invstd, float* scale,
                                    double* count, float* running_mean, float* running_var) {
    namespace k = lockstep::kernels;
    const std::size_t c = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
    const double n = k::packed_moments::count(block);
    if (c == 0)
        *count = n;
    if (c >= channels)
        return;
    const float m = block[k::packed_moments::mean(c)];
    const float m2 = block[k::packed_moments::m2(c)];
    const float var = n > 0 ? static_cast<float>(m2 / n) : 0.0f;
    const float inv = rsqrtf(var + eps);
    mean[c] = m;
    invstd[c] = inv;
    scale[c] = gamma[c] * inv;
    if (n > 1) {
        running_mean[c] = 0.9f * running_mean[c] + 0.1f * m;
        running_var[c] = 0.9f * running_var[c] + 0.1f * static_cast<float>(m2 / (n - 1));
    }
}

struct shape {
    int n, c, h, w;
};

template <class T>
void bench_bn(const cuda_system& sys, cudnnHandle_t cudnn, shape s, bool nhwc, double bandwidth) {
    const std::size_t C = static_cast<std::size_t>(s.c);
    const std::size_t hw = static_cast<std::size_t>(s.h) * static_cast<std::size_t>(s.w);
    const std::size_t N = static_cast<std::size_t>(s.n);
    const channel_geometry g = nhwc ? channel_geometry{N * hw, C, 1} : channel_geometry{N, C, hw};
    const std::size_t size = g.size();
    const double bytes = static_cast<double>(size * sizeof(T));

    buffer<T, cuda_system> x(size, sys), y(size, sys), dy(size, sys), dx(size, sys);
    {
        // x, dy: any finite values (BN's speed does not depend on them)
        std::vector<T> h(size);
        for (std::size_t i = 0; i < size; ++i)
            h[i] = static_cast<T>(static_cast<float>(i % 17) * 0.25f - 2.0f);
        lockstep::copy(std::span<const T>(h), lockstep::host_system{}, x.span(), sys);
        lockstep::copy(std::span<const T>(h), lockstep::host_system{}, dy.span(), sys);
    }
    auto channel_buffer = [&](float v) {
        buffer<float, cuda_system> b(C, sys);
        std::vector<float> h(C, v);
        lockstep::copy(std::span<const float>(h), lockstep::host_system{}, b.span(), sys);
        return b;
    };
    auto gamma = channel_buffer(1), beta = channel_buffer(0), mean = channel_buffer(0),
         invstd = channel_buffer(1), scale = channel_buffer(1), running_mean = channel_buffer(0),
         running_var = channel_buffer(1), dgamma = channel_buffer(0), dbeta = channel_buffer(0);
    buffer<float, cuda_system> block(lockstep::kernels::packed_moments::size(C), sys);
    buffer<float, cuda_system> sums(lockstep::kernels::packed_sums::size(C), sys);
    buffer<double, cuda_system> count(1, sys);
    buffer<std::byte, cuda_system> ws(lockstep::kernels::bn_workspace_bytes<T>(g), sys);
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(ws.data(), 0, ws.size_bytes(), sys.stream()));

    const auto cx = std::span<const T>(x.span());
    const auto cdy = std::span<const T>(dy.span());
    auto cf = [](buffer<float, cuda_system>& b) { return std::span<const float>(b.span()); };
    const unsigned cblocks = static_cast<unsigned>((C + 255) / 256);
    const double fwd = time_ms(sys.stream(), [&] {
        lockstep::kernels::pack_local_moments(sys, cx, g, 0.0f, block.span(), ws.span());
        coefficients_kernel<<<cblocks, 256, 0, sys.stream()>>>(
            block.data(), C, 1e-5f, gamma.data(), mean.data(), invstd.data(), scale.data(),
            count.data(), running_mean.data(), running_var.data());
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
        lockstep::kernels::normalize(sys, cx, y.span(), g, cf(mean), cf(scale), cf(beta));
    });
    const double bwd = time_ms(sys.stream(), [&] {
        lockstep::kernels::pack_backward_sums(sys, cdy, cx, g, cf(mean), 0.0f, sums.span(),
                                              ws.span());
        const auto totals = std::span<const float>(sums.span());
        lockstep::kernels::input_gradient_fused(sys, cdy, cx, dx.span(), g, totals, totals,
                                                count.data(), cf(gamma), cf(mean), cf(invstd),
                                                dgamma.span(), dbeta.span());
    });

    // cuDNN, legacy batch-norm API, same stream
    const cudnnDataType_t type = std::is_same_v<T, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_HALF;
    const cudnnTensorFormat_t format = nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    const cudnnBatchNormMode_t mode = CUDNN_BATCHNORM_SPATIAL_PERSISTENT;
    cudnnTensorDescriptor_t xd, pd;
    BENCH_CUDNN(cudnnCreateTensorDescriptor(&xd));
    BENCH_CUDNN(cudnnCreateTensorDescriptor(&pd));
    BENCH_CUDNN(cudnnSetTensor4dDescriptor(xd, format, type, s.n, s.c, s.h, s.w));
    BENCH_CUDNN(cudnnDeriveBNTensorDescriptor(pd, xd, mode));
    BENCH_CUDNN(cudnnSetStream(cudnn, sys.stream()));
    const float one = 1, zero = 0;
    const double cudnn_fwd = time_ms(sys.stream(), [&] {
        BENCH_CUDNN(cudnnBatchNormalizationForwardTraining(
            cudnn, mode, &one, &zero, xd, x.data(), xd, y.data(), pd, gamma.data(), beta.data(),
            0.1, running_mean.data(), running_var.data(), 1e-5, mean.data(), invstd.data()));
    });
    const double cudnn_bwd = time_ms(sys.stream(), [&] {
        BENCH_CUDNN(cudnnBatchNormalizationBackward(
            cudnn, mode, &one, &zero, &one, &one, xd, x.data(), xd, dy.data(), xd, dx.data(), pd,
            gamma.data(), dgamma.data(), dbeta.data(), 1e-5, mean.data(), invstd.data()));
    });
    BENCH_CUDNN(cudnnDestroyTensorDescriptor(xd));
    BENCH_CUDNN(cudnnDestroyTensorDescriptor(pd));

    const double bound_fwd = 3 * bytes / bandwidth * 1e3;
    const double bound_bwd = 5 * bytes / bandwidth * 1e3;
    std::printf("%4dx%4dx%3dx%3d %s %-5s | fwd %8.3f ms (%5.2fx bound) cudnn %8.3f ms (%5.2fx) | "
                "bwd %8.3f ms (%5.2fx bound) cudnn %8.3f ms (%5.2fx) | step vs cudnn %5.2f\n",
                s.n, s.c, s.h, s.w, nhwc ? "NHWC" : "NCHW",
                std::is_same_v<T, float> ? "float" : "half", fwd, fwd / bound_fwd, cudnn_fwd,
                cudnn_fwd / bound_fwd, bwd, bwd / bound_bwd, cudnn_bwd, cudnn_bwd / bound_bwd,
                (fwd + bwd) / (cudnn_fwd + cudnn_bwd));
}

#if LOCKSTEP_HAS_NCCL
#define BENCH_NCCL(expr)                                                                           \
    do {                                                                                           \
        const ncclResult_t bench_status_ = (expr);                                                 \
        if (bench_status_ != ncclSuccess) {                                                        \
            std::fprintf(stderr, "%s failed: %s\n", #expr, ncclGetErrorString(bench_status_));     \
            std::exit(1);                                                                          \
        }                                                                                          \
    } while (0)

/// All-reduce bus bandwidth of 256 MiB of float over every visible device (one process, one
/// NCCL group call per step).
void bench_nccl(int devices) {
    if (devices < 2) { // one rank: NCCL copies nothing in place, so a time would mean nothing
        std::printf("nccl all_reduce: needs 2 or more GPUs (%d visible); not measured\n", devices);
        return;
    }
    const std::size_t count = std::size_t(64) << 20;
    std::vector<ncclComm_t> comms(static_cast<std::size_t>(devices));
    std::vector<int> list(static_cast<std::size_t>(devices));
    for (int d = 0; d < devices; ++d)
        list[static_cast<std::size_t>(d)] = d;
    BENCH_NCCL(ncclCommInitAll(comms.data(), devices, list.data()));
    std::vector<cudaStream_t> streams(comms.size());
    std::vector<float*> data(comms.size());
    for (std::size_t d = 0; d < comms.size(); ++d) {
        LOCKSTEP_CUDA_CHECK(cudaSetDevice(static_cast<int>(d)));
        LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
        LOCKSTEP_CUDA_CHECK(cudaMalloc(&data[d], count * sizeof(float)));
        LOCKSTEP_CUDA_CHECK(cudaMemset(data[d], 0, count * sizeof(float)));
    }
    auto step = [&] {
        BENCH_NCCL(ncclGroupStart());
        for (std::size_t d = 0; d < comms.size(); ++d)
            BENCH_NCCL(
                ncclAllReduce(data[d], data[d], count, ncclFloat, ncclSum, comms[d], streams[d]));
        BENCH_NCCL(ncclGroupEnd());
    };
    auto sync_all = [&] {
        for (std::size_t d = 0; d < comms.size(); ++d) {
            LOCKSTEP_CUDA_CHECK(cudaSetDevice(static_cast<int>(d)));
            LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(streams[d]));
        }
    };
    for (int i = 0; i < warmup; ++i)
        step();
    sync_all();
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(0));
    cudaEvent_t start, stop;
    LOCKSTEP_CUDA_CHECK(cudaEventCreate(&start));
    LOCKSTEP_CUDA_CHECK(cudaEventCreate(&stop));
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(start, streams[0]));
    for (int i = 0; i < iterations; ++i)
        step();
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(0));
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(stop, streams[0]));
    sync_all();
    float ms = 0;
    LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    const double seconds = ms * 1e-3 / iterations;
    const double bytes = static_cast<double>(count * sizeof(float));
    const double bus = bytes * 2.0 * (devices - 1) / devices / seconds;
    std::printf("nccl all_reduce %d devices, %.0f MiB float: %.3f ms, algbw %.1f GB/s, busbw "
                "%.1f GB/s\n",
                devices, bytes / (1 << 20), ms / iterations, bytes / seconds * 1e-9, bus * 1e-9);
    LOCKSTEP_CUDA_CHECK(cudaEventDestroy(start));
    LOCKSTEP_CUDA_CHECK(cudaEventDestroy(stop));
    // One thread owns every rank: finalized together in one group (one by one, the first would
    // wait for the others), then destroyed locally.
    BENCH_NCCL(ncclGroupStart());
    for (std::size_t d = 0; d < comms.size(); ++d)
        BENCH_NCCL(ncclCommFinalize(comms[d]));
    BENCH_NCCL(ncclGroupEnd());
    for (std::size_t d = 0; d < comms.size(); ++d) {
        LOCKSTEP_CUDA_CHECK(cudaSetDevice(static_cast<int>(d)));
        BENCH_NCCL(ncclCommDestroy(comms[d]));
        LOCKSTEP_CUDA_CHECK(cudaFree(data[d]));
        LOCKSTEP_CUDA_CHECK(cudaStreamDestroy(streams[d]));
    }
}
#endif

} // namespace

int main() {
    try {
        const int devices = lockstep::cuda_device_count();
        if (devices == 0) {
            std::puts("no CUDA device");
            return 0;
        }
        const lockstep::cuda_stream stream(0);
        const cuda_system sys = stream.system();
        const double bandwidth = copy_bandwidth(sys);
        cudaDeviceProp prop{};
        LOCKSTEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        std::printf("device 0: %s, cudaMemcpy D2D %.1f GB/s (read + write); bound = 8 S bytes "
                    "per step at that rate\n",
                    prop.name, bandwidth * 1e-9);
        cudnnHandle_t cudnn;
        BENCH_CUDNN(cudnnCreate(&cudnn));
        const shape shapes[] = {{32, 64, 56, 56}, {256, 64, 14, 14}, {64, 256, 28, 28}};
        for (const shape s : shapes)
            for (const bool nhwc : {false, true}) {
                bench_bn<float>(sys, cudnn, s, nhwc, bandwidth);
                bench_bn<__half>(sys, cudnn, s, nhwc, bandwidth);
            }
        // small planes (7x7, 14x14): the NCHW kernels' flat mapping
        const shape small_planes[] = {{256, 2048, 7, 7}, {32, 1024, 14, 14}};
        for (const shape s : small_planes) {
            bench_bn<float>(sys, cudnn, s, false, bandwidth);
            bench_bn<__half>(sys, cudnn, s, false, bandwidth);
        }
        BENCH_CUDNN(cudnnDestroy(cudnn));
#if LOCKSTEP_HAS_NCCL
        bench_nccl(devices);
#else
        std::puts("nccl: not built with lockstep::nccl");
#endif
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "gpu_bench: %s\n", e.what());
        return 1;
    }
}

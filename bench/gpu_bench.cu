// gpu_bench: lockstep's CUDA batch norm (training forward and backward) next to cuDNN's four
// entry points and the memory-traffic bound, per shape, layout and type; an NCCL all_reduce line
// and the cost of nccl_communicator's device timing (report_stragglers_every).
// SPDX-License-Identifier: Apache-2.0
//
// The traffic bound of a training BN step over S bytes of activations is 8 S: the forward reads
// x twice and writes y (3 S), the backward reads dy and x twice and writes dx (5 S). It is timed
// at the cudaMemcpy device-to-device rate (read + write bytes per second) measured in the same
// run. Every timed call starts with the L2 evicted (gpu_bench_timer.cuh), so the bound is a DRAM
// bound. docs/gpu_batch_norm.md says what the figures are for.
#include "gpu_bench_cudnn.cuh"
#include "gpu_bench_timer.cuh"
#include "median.hpp"

#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_statistics.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>
#if LOCKSTEP_HAS_NCCL
#include "lockstep/comm/nccl_communicator.hpp"

#include <chrono>
#include <span>

#include <nccl.h>
#endif

namespace {

using gpu_bench::cudnn_api;
using gpu_bench::sample;
using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::kernels::channel_geometry;

constexpr int warmup = 5;      // the NCCL line's
constexpr int iterations = 20; // the NCCL line's

struct shape {
    int n, c, h, w;
};

/// Issue 47's shapes: ResNet-50's batch norms, and one larger than twice the L2.
constexpr shape all_shapes[] = {{32, 64, 56, 56},   {64, 256, 28, 28}, {256, 64, 14, 14},
                                {32, 1024, 14, 14}, {256, 2048, 7, 7}, {64, 256, 56, 56}};

struct options {
    std::string csv;
    int warmup = 3;
    int iterations = 20;
    bool counts_given = false; ///< --iterations or --warmup on the command line
    bool cudnn = true;
    std::vector<shape> shapes;               // empty: all_shapes
    std::vector<std::string> layouts, types; // empty: all
};

void usage(std::FILE* to) {
    std::fputs("usage: gpu_bench [--csv FILE] [--iterations N] [--warmup N] [--shape NxCxHxW]...\n"
               "                 [--layout nchw|nhwc]... [--type float|half|bf16]... [--no-cudnn]\n"
               "Times lockstep's CUDA batch norm (training forward, backward) against cuDNN and\n"
               "the 8 S traffic bound for issue 47's shapes, every layout and type (or the\n"
               "shapes, any, and the layouts and types named), then an NCCL all_reduce line\n"
               "and the cost of nccl_communicator's device timing. Median of 20 calls after 3\n"
               "warm-up calls (1 and 0 under a profiler, unless given).\n"
               "Exits 77 without a CUDA device.\n",
               to);
}

bool wanted(const std::vector<std::string>& list, const std::string& v) {
    if (list.empty())
        return true;
    for (const auto& e : list)
        if (e == v)
            return true;
    return false;
}

/// s as N x C x H x W of positive ints ("32x288x35x35"); false when it is not that.
bool parse_shape(const std::string& s, shape& out) {
    int v[4];
    std::size_t at = 0;
    for (int k = 0; k < 4; ++k) {
        std::size_t used = 0;
        try {
            v[k] = std::stoi(s.substr(at), &used);
        } catch (const std::exception&) {
            return false;
        }
        at += used;
        if (v[k] <= 0 || (k < 3 && (at >= s.size() || s[at++] != 'x')))
            return false;
    }
    out = {v[0], v[1], v[2], v[3]};
    return at == s.size();
}

std::string shape_name(shape s) {
    return std::to_string(s.n) + "x" + std::to_string(s.c) + "x" + std::to_string(s.h) + "x" +
           std::to_string(s.w);
}

template <class T>
const char* type_name() {
    if constexpr (std::is_same_v<T, float>)
        return "float";
    else if constexpr (std::is_same_v<T, __half>)
        return "half";
    else
        return "bf16";
}

template <class T>
cudnnDataType_t cudnn_type() {
    if constexpr (std::is_same_v<T, float>)
        return CUDNN_DATA_FLOAT;
    else if constexpr (std::is_same_v<T, __half>)
        return CUDNN_DATA_HALF;
    else
        return CUDNN_DATA_BFLOAT16;
}

/// What the run shares between configurations.
struct bench_context {
    const cuda_system& sys;
    cudnnHandle_t cudnn;
    gpu_bench::timer& timer;
    double bandwidth; ///< copy rate, bytes per second (read + write)
    const options& opt;
    std::FILE* csv;
    std::string device;
};

constexpr double nan_ms = std::numeric_limits<double>::quiet_NaN();

/// One (shape, layout, type): lockstep's forward and backward as nn::batch_norm<bn::local> runs
/// them (pack_local_moments, finish_and_normalize; pack_backward_sums, input_gradient_fused), then
/// cuDNN's four entry points on the same data.
template <class T>
void bench_bn(bench_context& b, shape s, bool nhwc) {
    namespace k = lockstep::kernels;
    const cuda_system& sys = b.sys;
    const std::size_t C = static_cast<std::size_t>(s.c);
    const std::size_t hw = static_cast<std::size_t>(s.h) * static_cast<std::size_t>(s.w);
    const std::size_t N = static_cast<std::size_t>(s.n);
    const channel_geometry g = nhwc ? channel_geometry{N * hw, C, 1} : channel_geometry{N, C, hw};
    const std::size_t size = g.size();
    const double bytes = static_cast<double>(size * sizeof(T));

    buffer<T, cuda_system> x(size, sys), y(size, sys), dy(size, sys), dx(size, sys);
    buffer<T, cuda_system> y_cudnn(size, sys), dx_cudnn(size, sys);
    const unsigned fill_grid = 1024;
    gpu_bench::fill_kernel<<<fill_grid, 256, 0, sys.stream()>>>(x.data(), size, 1u, -1.5f, 2.5f);
    gpu_bench::fill_kernel<<<fill_grid, 256, 0, sys.stream()>>>(dy.data(), size, 2u, -1.0f, 1.0f);
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    auto channel_buffer = [&](float v) {
        buffer<float, cuda_system> p(C, sys);
        const std::vector<float> h(C, v);
        lockstep::copy(std::span<const float>(h), lockstep::host_system{}, p.span(), sys);
        return p;
    };
    auto gamma = channel_buffer(1), beta = channel_buffer(0), mean = channel_buffer(0),
         invstd = channel_buffer(1), scale = channel_buffer(1), running_mean = channel_buffer(0),
         running_var = channel_buffer(1), dgamma = channel_buffer(0), dbeta = channel_buffer(0);
    buffer<float, cuda_system> block(k::packed_moments::size(C), sys);
    buffer<float, cuda_system> sums(k::packed_sums::size(C), sys);
    buffer<double, cuda_system> count(1, sys);
    buffer<double, cuda_system> record(3, sys); // a layer_error_record
    buffer<std::byte, cuda_system> ws(k::bn_workspace_bytes<T>(g), sys);
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(ws.data(), 0, ws.size_bytes(), sys.stream()));

    const auto cx = std::span<const T>(x.span());
    const auto cdy = std::span<const T>(dy.span());
    auto cf = [](buffer<float, cuda_system>& p) { return std::span<const float>(p.span()); };
    const k::finish_statistics_fn<float> finish{
        .blocks = block.data(),
        .stride = k::packed_moments::size(C),
        .count_blocks = 1,
        .self = 0,
        .running_first = 0,
        .running_last = 1,
        .normalize_merged = false,
        .world_offset = 0,
        .gamma = gamma.data(),
        .eps = 1e-5f,
        .momentum = 0.1f,
        .mean = mean.data(),
        .invstd = invstd.data(),
        .scale = scale.data(),
        .running_mean = running_mean.data(),
        .running_var = running_var.data(),
        .count = count.data(),
        .report =
            k::layer_report{.first = reinterpret_cast<k::layer_error_record*>(record.data())}};
    const sample fwd = b.timer.time([&] {
        k::pack_local_moments(sys, cx, g, 0.0f, block.span(), ws.span());
        k::finish_and_normalize(sys, finish, cx, y.span(), g, cf(beta));
    });
    const sample bwd = b.timer.time([&] {
        k::pack_backward_sums(sys, cdy, cx, g, cf(mean), 0.0f, sums.span(), ws.span());
        const auto totals = std::span<const float>(sums.span());
        k::input_gradient_fused(sys, cdy, cx, dx.span(), g, totals, totals, count.data(), cf(gamma),
                                cf(mean), cf(invstd), dgamma.span(), dbeta.span());
    });

    // cuDNN: each entry point's forward (which saves its statistics), then its backward
    struct cudnn_result {
        sample fwd{nan_ms, nan_ms}, bwd{nan_ms, nan_ms};
        std::string status = "skipped";
    };
    cudnn_result cr[std::size(gpu_bench::cudnn_apis)];
    bool compared = false;
    if (b.opt.cudnn) {
        GPU_BENCH_CUDNN(cudnnSetStream(b.cudnn, sys.stream()));
        gpu_bench::cudnn_bn bn(b.cudnn, s.n, s.c, s.h, s.w, nhwc, cudnn_type<T>());
        for (std::size_t i = 0; i < std::size(gpu_bench::cudnn_apis); ++i) {
            const cudnn_api a = gpu_bench::cudnn_apis[i];
            cudnnStatus_t st = bn.prepare(a);
            if (st == CUDNN_STATUS_SUCCESS)
                st = bn.forward(a, x.data(), y_cudnn.data());
            if (st == CUDNN_STATUS_SUCCESS)
                st = bn.backward(a, x.data(), dy.data(), dx_cudnn.data());
            LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(sys.stream()));
            if (st != CUDNN_STATUS_SUCCESS) {
                cr[i].status = cudnnGetErrorString(st);
                continue;
            }
            // a call that fails after a good trial stops the calls and voids the entry point
            cr[i].fwd = b.timer.time([&] {
                if (st == CUDNN_STATUS_SUCCESS)
                    st = bn.forward(a, x.data(), y_cudnn.data());
            });
            cr[i].bwd = b.timer.time([&] {
                if (st == CUDNN_STATUS_SUCCESS)
                    st = bn.backward(a, x.data(), dy.data(), dx_cudnn.data());
            });
            if (st != CUDNN_STATUS_SUCCESS) {
                cr[i] = cudnn_result{};
                cr[i].status = cudnnGetErrorString(st);
                continue;
            }
            cr[i].status = "ok";
            compared = true;
        }
    }
    // lockstep's y and dx against the last cuDNN entry point's (same data, same statistics up
    // to rounding): a benchmark of wrong results would mean nothing
    double y_diff = nan_ms, dx_diff = nan_ms;
    if (compared) {
        buffer<unsigned, cuda_system> d(2, sys);
        LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, d.size_bytes(), sys.stream()));
        gpu_bench::max_diff_kernel<<<fill_grid, 256, 0, sys.stream()>>>(y.data(), y_cudnn.data(),
                                                                        size, d.data());
        gpu_bench::max_diff_kernel<<<fill_grid, 256, 0, sys.stream()>>>(dx.data(), dx_cudnn.data(),
                                                                        size, d.data() + 1);
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
        unsigned h[2] = {0, 0};
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(h, d.data(), sizeof h, cudaMemcpyDeviceToHost, sys.stream()));
        LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(sys.stream()));
        float f[2];
        std::memcpy(f, h, sizeof f);
        y_diff = f[0];
        dx_diff = f[1];
    }

    const double bound_fwd = 3 * bytes / b.bandwidth * 1e3;
    const double bound_bwd = 5 * bytes / b.bandwidth * 1e3;
    const double bound_step = bound_fwd + bound_bwd;
    const double step = fwd.median_ms + bwd.median_ms;
    double best = nan_ms;
    const char* best_name = "none";
    for (std::size_t i = 0; i < std::size(gpu_bench::cudnn_apis); ++i) {
        const double t = cr[i].fwd.median_ms + cr[i].bwd.median_ms;
        if (t == t && !(t >= best)) {
            best = t;
            best_name = gpu_bench::name(gpu_bench::cudnn_apis[i]);
        }
    }
    const double mib = bytes / (1 << 20);
    const bool large = mib >= 16.0;
    const char* target = !large ? "n/a" : (step <= 1.25 * bound_step ? "met" : "missed");
    const std::string name = shape_name(s);
    const char* layout = nhwc ? "NHWC" : "NCHW";
    std::printf("%-16s %s %-5s %6.1f MiB | fwd %7.3f (%4.2fx) bwd %7.3f (%4.2fx) step %7.3f "
                "(%4.2fx 8S, 1.25x %s) | cudnn",
                name.c_str(), layout, type_name<T>(), mib, fwd.median_ms, fwd.median_ms / bound_fwd,
                bwd.median_ms, bwd.median_ms / bound_bwd, step, step / bound_step, target);
    for (std::size_t i = 0; i < std::size(gpu_bench::cudnn_apis); ++i) {
        const double t = cr[i].fwd.median_ms + cr[i].bwd.median_ms;
        if (t == t)
            std::printf(" %s %.3f", gpu_bench::name(gpu_bench::cudnn_apis[i]), t);
        else
            std::printf(" %s n/a", gpu_bench::name(gpu_bench::cudnn_apis[i]));
    }
    std::printf(" | step / best cuDNN %5.2f | max |diff| y %.2g dx %.2g\n", step / best, y_diff,
                dx_diff);
    std::fflush(stdout);
    if (b.csv != nullptr) {
        std::fprintf(b.csv,
                     "%s,%s,%.0f,%d,%d,%d,%d,%s,%s,%.3f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,"
                     "%.6f,%.4f,%.4f,%.4f,%s",
                     b.device.c_str(), name.c_str(), b.bandwidth * 1e-9, s.n, s.c, s.h, s.w, layout,
                     type_name<T>(), mib, bound_fwd, bound_bwd, bound_step, fwd.median_ms,
                     fwd.min_ms, bwd.median_ms, bwd.min_ms, step, fwd.median_ms / bound_fwd,
                     bwd.median_ms / bound_bwd, step / bound_step, target);
        for (const auto& r : cr)
            std::fprintf(b.csv, ",%.6f,%.6f,%s", r.fwd.median_ms, r.bwd.median_ms,
                         r.status.c_str());
        std::fprintf(b.csv, ",%s,%.6f,%.4f,%.3g,%.3g\n", best_name, best, step / best, y_diff,
                     dx_diff);
        std::fflush(b.csv);
    }
}

void csv_header(std::FILE* f) {
    std::fputs("device,shape,copy_gbs,n,c,h,w,layout,type,mib,bound_fwd_ms,bound_bwd_ms,"
               "bound_step_ms,fwd_ms,fwd_min_ms,bwd_ms,bwd_min_ms,step_ms,fwd_over_bound,"
               "bwd_over_bound,step_over_bound,target_1p25",
               f);
    for (const cudnn_api a : gpu_bench::cudnn_apis)
        std::fprintf(f, ",cudnn_%s_fwd_ms,cudnn_%s_bwd_ms,cudnn_%s_status", gpu_bench::name(a),
                     gpu_bench::name(a), gpu_bench::name(a));
    std::fputs(",best_cudnn,best_cudnn_step_ms,step_over_best_cudnn,y_max_diff,dx_max_diff\n", f);
}

/// Device-to-device copy rate in bytes per second (read + write), 256 MiB, L2 flushed first.
double copy_bandwidth(const cuda_system& sys, gpu_bench::timer& t) {
    const std::size_t bytes = std::size_t(256) << 20;
    buffer<std::byte, cuda_system> a(bytes, sys), c(bytes, sys);
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(a.data(), 0, bytes, sys.stream()));
    const sample s = t.time([&] {
        LOCKSTEP_CUDA_CHECK(
            cudaMemcpyAsync(c.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, sys.stream()));
    });
    return 2.0 * static_cast<double>(bytes) / (s.median_ms * 1e-3);
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

#if LOCKSTEP_HAS_NCCL
/// The cost of report_stragglers_every's device timing on NCCL (two CUDA events per collective):
/// the host time per collective of 2000 one-element all_reduces on a one-rank
/// nccl_communicator of device 0 with time_between_on_device() beside one without, in 7
/// alternating rounds (medians). Multiplied by a step's collectives, it is the timing's cost
/// per step; the timed communicator's gaps are printed beside its wall time as a check.
void bench_gap_timer() {
    const int device[] = {0};
    auto plain = lockstep::nccl_communicator::init_all(device);
    auto timed = lockstep::nccl_communicator::init_all(device);
    timed[0].time_between_on_device();
    constexpr int calls = 2000;
    const auto round = [&](lockstep::nccl_communicator& comm) {
        lockstep::buffer<float, cuda_system> x(1, comm.system());
        comm.synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i)
            comm.all_reduce(std::span<const float>(x.span()), x.span(), lockstep::reduce_op::sum);
        comm.synchronize();
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                   .count() /
               calls;
    };
    std::vector<double> off, on;
    double wall_us = 0;
    const std::int64_t gaps_before = timed[0].device_between_ns();
    for (int r = 0; r < 7; ++r) {
        off.push_back(round(plain[0]));
        on.push_back(round(timed[0]));
        wall_us += on.back() * calls;
    }
    using bench_stats::median;
    const double gaps_us = static_cast<double>(timed[0].device_between_ns() - gaps_before) * 1e-3;
    std::printf("nccl_communicator device timing (report_stragglers_every): %.2f us per one-rank "
                "all_reduce without, %.2f us with (+%.2f us per collective, ratio %.3f); the "
                "timed gaps %.0f us of %.0f us wall\n",
                median(off), median(on), median(on) - median(off), median(on) / median(off),
                gaps_us, wall_us);
}
#endif

/// Parses argv into o; false (after a message) on a bad option.
bool parse(int argc, char** argv, options& o) {
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const bool has_value = i + 1 < argc;
        auto count = [&](int& v) {
            v = std::atoi(argv[++i]);
            return v >= 0;
        };
        if (a == "--help" || a == "-h") {
            usage(stdout);
            std::exit(0);
        } else if (a == "--csv" && has_value) {
            o.csv = argv[++i];
        } else if (a == "--iterations" && has_value) {
            if (!count(o.iterations) || o.iterations == 0)
                return false;
            o.counts_given = true;
        } else if (a == "--warmup" && has_value) {
            if (!count(o.warmup))
                return false;
            o.counts_given = true;
        } else if (a == "--shape" && has_value) {
            shape s{};
            if (!parse_shape(argv[++i], s))
                return false;
            o.shapes.push_back(s);
        } else if (a == "--layout" && has_value) {
            o.layouts.emplace_back(argv[++i]);
        } else if (a == "--type" && has_value) {
            o.types.emplace_back(argv[++i]);
        } else if (a == "--no-cudnn") {
            o.cudnn = false;
        } else {
            std::fprintf(stderr, "gpu_bench: unknown or incomplete option '%s'\n", a.c_str());
            return false;
        }
    }
    return true;
}

} // namespace

int main(int argc, char** argv) {
    options opt;
    if (!parse(argc, argv, opt)) {
        usage(stderr);
        return 2;
    }
    // Under a profiler (Nsight Compute and Systems inject themselves through this variable) one
    // call per quantity, so that a launch count covers every configuration in little time.
    if (!opt.counts_given && std::getenv("CUDA_INJECTION64_PATH") != nullptr) {
        opt.warmup = 0;
        opt.iterations = 1;
        std::puts("gpu_bench: under a profiler: --warmup 0 --iterations 1");
    }
    try {
        const int devices = lockstep::cuda_device_count();
        if (devices == 0) {
            std::puts("gpu_bench: skipped: no CUDA device");
            return 77;
        }
        const lockstep::cuda_stream stream(0);
        const cuda_system sys = stream.system();
        cudaDeviceProp prop{};
        LOCKSTEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        gpu_bench::timer timer(sys.stream(), static_cast<std::size_t>(prop.l2CacheSize),
                               prop.multiProcessorCount, opt.warmup, opt.iterations);
        const double bandwidth = copy_bandwidth(sys, timer);
        std::printf("device 0: %s, %d SMs, L2 %.0f MiB (flushed by reading %.0f MiB before every "
                    "timed call), cudaMemcpy D2D %.1f GB/s (read + write); bound = 8 S bytes per "
                    "step at that rate; median of %d calls\n",
                    prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0,
                    static_cast<double>(timer.flush_bytes()) / 1048576.0, bandwidth * 1e-9,
                    timer.iterations());
        std::FILE* csv = nullptr;
        if (!opt.csv.empty()) {
            csv = std::fopen(opt.csv.c_str(), "w");
            if (csv == nullptr) {
                std::fprintf(stderr, "gpu_bench: cannot write %s\n", opt.csv.c_str());
                return 1;
            }
            csv_header(csv);
        }
        cudnnHandle_t cudnn;
        GPU_BENCH_CUDNN(cudnnCreate(&cudnn));
        std::printf("cuDNN %zu (step = forward + backward ms of each entry point)\n",
                    cudnnGetVersion());
        bench_context ctx{sys, cudnn, timer, bandwidth, opt, csv, prop.name};
        const std::vector<shape> shapes =
            opt.shapes.empty() ? std::vector<shape>(std::begin(all_shapes), std::end(all_shapes))
                               : opt.shapes;
        for (const shape s : shapes) {
            for (const bool nhwc : {false, true}) {
                if (!wanted(opt.layouts, nhwc ? "nhwc" : "nchw"))
                    continue;
                if (wanted(opt.types, "float"))
                    bench_bn<float>(ctx, s, nhwc);
                if (wanted(opt.types, "half"))
                    bench_bn<__half>(ctx, s, nhwc);
                if (wanted(opt.types, "bf16"))
                    bench_bn<__nv_bfloat16>(ctx, s, nhwc);
            }
        }
        GPU_BENCH_CUDNN(cudnnDestroy(cudnn));
        if (csv != nullptr)
            std::fclose(csv);
#if LOCKSTEP_HAS_NCCL
        bench_nccl(devices);
        if (std::getenv("CUDA_INJECTION64_PATH") == nullptr) // a profiler would trace 28000 calls
            bench_gap_timer();
        else
            std::puts("nccl_communicator device timing: not measured under a profiler");
#else
        std::puts("nccl: not built with lockstep::nccl");
#endif
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "gpu_bench: %s\n", e.what());
        return 1;
    }
}

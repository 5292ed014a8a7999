// bench/batch_norm.cpp: host batch norm (forward training, backward) against oneDNN on the same
// shapes and against the STREAM-copy traffic bound, all measured in one run with the same
// threads. SPDX-License-Identifier: Apache-2.0
//
//   bench_batch_norm [reps = 20] [threads = all cores] [wall | cpu] [--csv FILE]
//
// --csv FILE: one row per shape, layout, pass and contestant (lockstep, onednn, bound) with its
// time and its ratios to oneDNN in the same layout and to the bound.
#include "lockstep/nn/batch_norm.hpp"
#include "csv.hpp"
#include "lockstep/comm/thread_group.hpp"

#if LOCKSTEP_BENCH_HAS_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

/// Wall-clock milliseconds, or (use_cpu_time) the CPU time of the whole process: with one
/// thread on a machine shared with other jobs, CPU time leaves out the time the scheduler gave
/// to others.
bool use_cpu_time = false;
double now_ms() {
    if (use_cpu_time) {
        timespec ts{};
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
        return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
    }
    return std::chrono::duration<double, std::milli>(clock_type::now().time_since_epoch()).count();
}

/// STREAM copy of `bytes` bytes with `threads` threads (one timed call of the returned function).
struct stream_copy {
    std::vector<float> a, b;
    int threads;
    stream_copy(std::size_t bytes, int t)
        : a(bytes / sizeof(float), 1.0f), b(a.size(), 0.0f), threads(t) {}
    void operator()() {
        const auto m = static_cast<std::ptrdiff_t>(a.size());
        float* __restrict dst = b.data();
        const float* __restrict src = a.data();
#if LOCKSTEP_HAS_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads)
#endif
        for (std::ptrdiff_t i = 0; i < m; ++i)
            dst[i] = src[i];
    }
};

struct shape4 {
    std::size_t n, c, h, w;
    std::size_t size() const { return n * c * h * w; }
    std::string name() const {
        return std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) + "x" +
               std::to_string(w);
    }
};

/// One contestant: a name and a call to time.
struct candidate {
    std::function<void()> call;
    double best = 1e30;
};

/// Times every candidate `reps` times, round robin, and keeps each one's best time in ms. Round
/// robin and the best time, because on a shared machine other processes only ever add time and
/// should not favour whoever ran in a quiet moment.
void time_all(std::vector<candidate*> cs, int reps) {
    // Warm-up (first touch, oneDNN's thread pool, caches), in order: each backward needs the
    // forward before it.
    for (int pass = 0; pass < 2; ++pass)
        for (auto* c : cs)
            c->call();
    for (int i = 0; i < reps; ++i)
        for (auto* c : cs) {
            const double a = now_ms();
            c->call();
            c->best = std::min(c->best, now_ms() - a);
        }
}

#if LOCKSTEP_BENCH_HAS_DNNL
/// oneDNN's batch normalization (scale and shift, training) on given data in one layout.
struct onednn_bn {
    dnnl::engine eng{dnnl::engine::kind::cpu, 0};
    dnnl::stream strm{eng};
    dnnl::batch_normalization_forward fwd;
    dnnl::batch_normalization_backward bwd;
    std::unordered_map<int, dnnl::memory> fargs, bargs;

    onednn_bn(const shape4& s, bool nhwc, const std::vector<float>& x, const std::vector<float>& dy,
              std::vector<float>& y, std::vector<float>& dx) {
        using namespace dnnl;
        const memory::dims dims{static_cast<memory::dim>(s.n), static_cast<memory::dim>(s.c),
                                static_cast<memory::dim>(s.h), static_cast<memory::dim>(s.w)};
        const memory::desc md(dims, memory::data_type::f32,
                              nhwc ? memory::format_tag::nhwc : memory::format_tag::nchw);
        const auto flags = normalization_flags::use_scale | normalization_flags::use_shift;
        const batch_normalization_forward::primitive_desc fpd(
            {prop_kind::forward_training, md, 1e-5f, flags}, eng);
        const batch_normalization_backward::primitive_desc bpd(
            {prop_kind::backward, md, md, 1e-5f, flags}, eng, fpd);
        const memory::desc cd({static_cast<memory::dim>(s.c)}, memory::data_type::f32,
                              memory::format_tag::x);
        memory src(md, eng, const_cast<float*>(x.data())), dst(md, eng, y.data());
        memory diff_dst(md, eng, const_cast<float*>(dy.data())), diff_src(md, eng, dx.data());
        memory mean(fpd.mean_desc(), eng), var(fpd.variance_desc(), eng);
        memory scale(cd, eng), shift(cd, eng), dscale(cd, eng), dshift(cd, eng);
        std::fill_n(static_cast<float*>(scale.get_data_handle()), s.c, 1.0f);
        std::fill_n(static_cast<float*>(shift.get_data_handle()), s.c, 0.0f);
        fwd = batch_normalization_forward(fpd);
        bwd = batch_normalization_backward(bpd);
        fargs = {{DNNL_ARG_SRC, src},      {DNNL_ARG_DST, dst},     {DNNL_ARG_MEAN, mean},
                 {DNNL_ARG_VARIANCE, var}, {DNNL_ARG_SCALE, scale}, {DNNL_ARG_SHIFT, shift}};
        bargs = {{DNNL_ARG_SRC, src},           {DNNL_ARG_DIFF_DST, diff_dst},
                 {DNNL_ARG_MEAN, mean},         {DNNL_ARG_VARIANCE, var},
                 {DNNL_ARG_SCALE, scale},       {DNNL_ARG_SHIFT, shift}, // 2.6 needs it
                 {DNNL_ARG_DIFF_SRC, diff_src}, {DNNL_ARG_DIFF_SCALE, dscale},
                 {DNNL_ARG_DIFF_SHIFT, dshift}};
    }
    void forward() {
        fwd.execute(strm, fargs);
        strm.wait();
    }
    void backward() {
        bwd.execute(strm, bargs);
        strm.wait();
    }
};
#endif

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
        d = std::max(d, std::abs(static_cast<double>(a[i]) - b[i]));
    return d;
}

} // namespace

int main(int argc, char** argv) {
    using namespace lockstep;
    bench_csv::writer csv(bench_csv::take_option(argc, argv),
                          {"bench", "shape", "layout", "pass", "threads", "variant", "ms",
                           "ratio_to_onednn", "ratio_to_bound"});
    const int reps = argc > 1 ? std::max(3, std::atoi(argv[1])) : 20;
    const int threads =
        argc > 2 ? std::max(1, std::atoi(argv[2])) : host_system::default_threads(1);
    use_cpu_time = argc > 3 && std::string(argv[3]) == "cpu";
    if (use_cpu_time && threads != 1) {
        std::printf("cpu time is meaningful with one thread only\n");
        return 1;
    }
    const std::vector<shape4> shapes{{32, 64, 56, 56}, {256, 64, 14, 14}};
    std::printf("batch norm, float, forward training and backward; best of %d round-robin runs, "
                "%d thread(s), %s time\n",
                reps, threads, use_cpu_time ? "process CPU" : "wall-clock");
    std::printf("bound = traffic / STREAM-copy bandwidth of a copy of the same size, same "
                "threads (forward 3*S, backward 5*S bytes)\n\n");
    std::printf("%-13s %-6s %-8s %9s %9s %9s %9s %10s %8s %8s\n", "shape", "layout", "pass",
                "lockstep", "oneDNN", "oneDNN", "bound", "lockstep/", "lockstep/", "bound/");
    std::printf("%-13s %-6s %-8s %9s %9s %9s %9s %10s %8s %8s\n", "", "", "", "ms", "same ms",
                "best ms", "ms", "same", "best", "lockstep");
    for (const auto& s : shapes) {
        // the same values in both layouts, so every contestant normalizes the same batch
        std::mt19937 gen(1);
        std::normal_distribution<float> z(0.5f, 2.0f);
        std::vector<float> x[2], dy[2], y[2], dx[2], y_ref[2], dx_ref[2];
        for (int l = 0; l < 2; ++l) {
            for (auto* v : {&x[l], &dy[l], &y[l], &dx[l], &y_ref[l], &dx_ref[l]})
                v->assign(s.size(), 0.0f);
        }
        for (auto& v : x[0])
            v = z(gen);
        for (auto& v : dy[0])
            v = z(gen) - 0.5f;
        const std::size_t hw = s.h * s.w;
        for (std::size_t n = 0; n < s.n; ++n)
            for (std::size_t c = 0; c < s.c; ++c)
                for (std::size_t i = 0; i < hw; ++i) {
                    x[1][(n * hw + i) * s.c + c] = x[0][(n * s.c + c) * hw + i];
                    dy[1][(n * hw + i) * s.c + c] = dy[0][(n * s.c + c) * hw + i];
                }
        const nn::tensor_shape shape[2] = {{s.n, s.c, s.h, s.w}, {s.n, s.h, s.w, s.c}};
        candidate ours[2][2], theirs[2][2], copy;
        double diff[2] = {-1, -1};
        thread_group group(1);
        group.run([&](thread_communicator& comm) {
            const host_system sys(threads);
#if LOCKSTEP_HAS_OPENMP
            omp_set_num_threads(threads); // oneDNN's OpenMP runtime uses the caller's budget
#endif
            nn::batch_norm<float, bn::local, nn::nchw> bn_nchw(s.c, {}, sys);
            nn::batch_norm<float, bn::local, nn::nhwc> bn_nhwc(s.c, {}, sys);
            ours[0][0].call = [&] {
                bn_nchw.forward_train(comm, std::span<const float>(x[0]), shape[0],
                                      std::span<float>(y[0]));
            };
            ours[0][1].call = [&] {
                bn_nchw.backward(comm, std::span<const float>(dy[0]), std::span<float>(dx[0]));
            };
            ours[1][0].call = [&] {
                bn_nhwc.forward_train(comm, std::span<const float>(x[1]), shape[1],
                                      std::span<float>(y[1]));
            };
            ours[1][1].call = [&] {
                bn_nhwc.backward(comm, std::span<const float>(dy[1]), std::span<float>(dx[1]));
            };
            stream_copy sc(s.size() * sizeof(float), threads);
            copy.call = [&] { sc(); };
            std::vector<candidate*> all{&copy, &ours[0][0], &ours[0][1], &ours[1][0], &ours[1][1]};
#if LOCKSTEP_BENCH_HAS_DNNL
            onednn_bn dn_nchw(s, false, x[0], dy[0], y_ref[0], dx_ref[0]);
            onednn_bn dn_nhwc(s, true, x[1], dy[1], y_ref[1], dx_ref[1]);
            theirs[0][0].call = [&] { dn_nchw.forward(); };
            theirs[0][1].call = [&] { dn_nchw.backward(); };
            theirs[1][0].call = [&] { dn_nhwc.forward(); };
            theirs[1][1].call = [&] { dn_nhwc.backward(); };
            for (auto* c : {&theirs[0][0], &theirs[0][1], &theirs[1][0], &theirs[1][1]})
                all.push_back(c);
#endif
            time_all(all, reps);
#if LOCKSTEP_BENCH_HAS_DNNL
            for (int l = 0; l < 2; ++l)
                diff[l] = std::max(max_diff(y[l], y_ref[l]), max_diff(dx[l], dx_ref[l]));
#endif
        });
        const double bytes = static_cast<double>(s.size() * sizeof(float));
        const double bw = 2 * bytes / (copy.best * 1e-3);
        const double bound[2] = {3 * bytes / bw * 1e3, 5 * bytes / bw * 1e3};
        for (int l = 0; l < 2; ++l) {
            for (int pass = 0; pass < 2; ++pass) {
                const double mine = ours[l][pass].best;
                const double same = theirs[l][pass].call ? theirs[l][pass].best : 0.0;
                const double best = theirs[0][pass].call
                                        ? std::min(theirs[0][pass].best, theirs[1][pass].best)
                                        : 0.0;
                std::printf("%-13s %-6s %-8s %9.3f %9.3f %9.3f %9.3f %10.2f %8.2f %8.2f\n",
                            s.name().c_str(), l == 0 ? "nchw" : "nhwc",
                            pass == 0 ? "forward" : "backward", mine, same, best, bound[pass],
                            same > 0 ? mine / same : 0.0, best > 0 ? mine / best : 0.0,
                            bound[pass] / mine);
                const char* layout = l == 0 ? "nchw" : "nhwc";
                const char* pass_name = pass == 0 ? "forward" : "backward";
                const auto to_onednn = [&](double ms) {
                    return same > 0 ? bench_csv::cell(ms / same) : bench_csv::cell("");
                };
                csv.row({"batch_norm", s.name(), layout, pass_name, threads, "lockstep", mine,
                         to_onednn(mine), mine / bound[pass]});
                if (same > 0)
                    csv.row({"batch_norm", s.name(), layout, pass_name, threads, "onednn", same,
                             1.0, same / bound[pass]});
                csv.row({"batch_norm", s.name(), layout, pass_name, threads, "bound", bound[pass],
                         to_onednn(bound[pass]), 1.0});
            }
        }
        std::printf("  (%d threads, STREAM copy %.1f GB/s at %.1f MB; max |lockstep - oneDNN| "
                    "of y and dx: nchw %.2g, nhwc %.2g)\n",
                    threads, bw / 1e9, bytes / 1e6, diff[0], diff[1]);
    }
#if !LOCKSTEP_BENCH_HAS_DNNL
    std::printf("\noneDNN was not found at configure time: its columns are 0.\n");
#endif
    return 0;
}

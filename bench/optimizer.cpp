// bench_optimizer: fused optimizer step time for 25.6 M float parameters (ResNet-50's 161
// tensors) versus its memory-traffic bound at the STREAM-copy bandwidth measured in the same run
// with the same threads. SPDX-License-Identifier: Apache-2.0
//
// Usage: bench_optimizer [repetitions = 20] [threads = all cores] [--csv FILE]
// Prints, per kernel, the bytes it must move per parameter, the best and median time over the
// repetitions, the bandwidth it achieves and bound/time = (bytes / STREAM-copy bandwidth) /
// best time (1.0 = as fast as the memory allows; > 1 is possible when a buffer stays in cache).
// --csv FILE: the same numbers, one row per kernel (the two anchors included).
#include "csv.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/rng.hpp"

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

using namespace lockstep;

namespace {

// ResNet-50's parameter tensors in registration order: 53 convolutions (no bias), 53 BN
// gamma/beta pairs, the fc weight and bias: 161 tensors, 25,557,032 parameters. BN parameters
// and the fc bias get no weight decay and no trust ratio (the usual LARS/LAMB exclusions).
std::vector<tensor_segment> resnet50_segments() {
    std::vector<tensor_segment> s;
    std::size_t off = 0;
    auto add = [&](std::size_t n, bool weight) {
        s.push_back({off, n, weight, weight});
        off += n;
    };
    auto conv_bn = [&](std::size_t out, std::size_t in, std::size_t k) {
        add(out * in * k * k, true);
        add(out, false); // gamma
        add(out, false); // beta
    };
    conv_bn(64, 3, 7);
    std::size_t in = 64;
    const std::size_t blocks[] = {3, 4, 6, 3}, planes[] = {64, 128, 256, 512};
    for (int l = 0; l < 4; ++l)
        for (std::size_t b = 0; b < blocks[l]; ++b) {
            const std::size_t p = planes[l];
            conv_bn(p, in, 1);
            conv_bn(p, p, 3);
            conv_bn(4 * p, p, 1);
            if (b == 0)
                conv_bn(4 * p, in, 1); // downsample
            in = 4 * p;
        }
    add(1000 * 2048, true);
    add(1000, false);
    return s;
}

struct copy_kernel {
    const float* src;
    float* dst;
    void operator()(std::size_t i) const { dst[i] = src[i]; }
};

// a += b: the read-modify-write pattern of the optimizers (12 bytes per element, every written
// line was read first, so no write-allocate traffic beyond what is counted).
struct add_kernel {
    float* a;
    const float* b;
    void operator()(std::size_t i) const { a[i] += b[i]; }
};

struct timing {
    double best = 0, median = 0;
};

// Runs f `reps` times after one warm-up call; best and median wall time in seconds.
timing measure(int reps, const std::function<void()>& f) {
    f();
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
        const auto a = std::chrono::steady_clock::now();
        f();
        const auto b = std::chrono::steady_clock::now();
        t.push_back(std::chrono::duration<double>(b - a).count());
    }
    std::sort(t.begin(), t.end());
    return {t.front(), t[t.size() / 2]};
}

} // namespace

int main(int argc, char** argv) {
    bench_csv::writer csv(bench_csv::take_option(argc, argv),
                          {"bench", "kernel", "bytes_per_param", "threads", "best_ms", "median_ms",
                           "gbps", "bound_ms", "bound_over_time", "rmw_bound_over_time"});
    const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
    const int threads = argc > 2 ? std::atoi(argv[2]) : host_system::default_threads(1);
    const host_system sys(threads);
    const std::vector<tensor_segment> segs = resnet50_segments();
    const std::size_t n = segs.back().offset + segs.back().size;

    buffer<float> w(n, sys), g(n, sys), a(n, sys), b(n, sys);
    const rng_stream rng{2024, 0};
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(n), [&](std::size_t i) {
                         w[i] = 0.05f * (rng.uniform(0, i) - 0.5f);
                         g[i] = 1e-3f * (rng.uniform(1, i) - 0.5f);
                         a[i] = 1.0f;
                         b[i] = 0.0f;
                     });

    // The anchor: STREAM copy (b = a) with the same threads and policy, 8 bytes per element.
    const timing stream = measure(reps, [&] {
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(n),
                         copy_kernel{a.data(), b.data()});
    });
    const double bandwidth = 8.0 * static_cast<double>(n) / stream.best; // bytes / s
    // A second anchor: STREAM copy's 8 counted bytes cost 12 on a write-allocate cache (the
    // destination line is read before it is written); the optimizers update in place, so their
    // counted bytes are all the traffic there is. a += b has their pattern.
    const timing rmw = measure(reps, [&] {
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(n), add_kernel{a.data(), b.data()});
    });
    const double rmw_bandwidth = 12.0 * static_cast<double>(n) / rmw.best;

    std::printf("bench_optimizer: %zu float parameters in %zu tensors (ResNet-50), %d threads, "
                "best/median of %d runs\n",
                n, segs.size(), sys.threads(), reps);
    std::printf("anchor STREAM copy b = a (8 B/elem): best %.2f ms, median %.2f ms = %.2f GB/s\n",
                stream.best * 1e3, stream.median * 1e3, bandwidth * 1e-9);
    std::printf("anchor in-place a += b  (12 B/elem): best %.2f ms, median %.2f ms = %.2f GB/s\n",
                rmw.best * 1e3, rmw.median * 1e3, rmw_bandwidth * 1e-9);
#if defined(__GNUC__) && !defined(__clang__) && !defined(__NO_MATH_ERRNO__)
    std::printf("note: built without -fno-math-errno: GCC cannot vectorize sqrt (Adam, LAMB)\n");
#endif
    std::printf("\n%-18s %5s %9s %9s %7s %9s %11s %11s\n", "kernel", "B/par", "best ms",
                "median ms", "GB/s", "bound ms", "bound/time", "vs a+=b");

    auto report = [&](const char* name, double bytes_per_param, const timing& t) {
        const double bytes = bytes_per_param * static_cast<double>(n);
        const double bound = bytes / bandwidth;
        std::printf("%-18s %5.0f %9.2f %9.2f %7.2f %9.2f %11.3f %11.3f\n", name, bytes_per_param,
                    t.best * 1e3, t.median * 1e3, bytes / t.best * 1e-9, bound * 1e3,
                    bound / t.best, bytes / rmw_bandwidth / t.best);
        csv.row({"optimizer", name, bytes_per_param, sys.threads(), t.best * 1e3, t.median * 1e3,
                 bytes / t.best * 1e-9, bound * 1e3, bound / t.best,
                 bytes / rmw_bandwidth / t.best});
    };
    report("stream copy", 8, stream);
    report("a += b", 12, rmw);

    auto run = [&](const char* name, double bytes, auto& opt) {
        report(name, bytes, measure(reps, [&] { opt.step(w.span(), g.span()); }));
    };
    {
        optim::sgd<float> opt(n, {.lr = 0.1}, sys, segs);
        run("sgd (w, g)", 12, opt); // read w, g; write w
    }
    {
        optim::sgd<float> opt(n, {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4}, sys, segs);
        run("sgd+momentum", 20, opt); // read w, g, m; write w, m
    }
    {
        optim::sgd<float> opt(
            n, {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4, .nesterov = true}, sys, segs);
        run("sgd+nesterov", 20, opt);
    }
    {
        optim::adam<float> opt(n, {.lr = 1e-3}, sys, segs);
        run("adam", 28, opt); // read w, g, m, v; write w, m, v
    }
    {
        optim::adamw<float> opt(n, {.lr = 1e-3, .weight_decay = 0.01}, sys, segs);
        run("adamw", 28, opt);
    }
    {
        // norm pass: read w, g (8); update: read w, g, v, write w, v (20).
        optim::lars<float> opt(n, {.lr = 0.1, .weight_decay = 1e-4}, sys, segs);
        run("lars (2 passes)", 28, opt);
    }
    {
        // moments pass: read w, g, m, v, write m, v, u (28); apply: read w, u, write w (12).
        optim::lamb<float> opt(n, {.lr = 1e-3}, sys, segs);
        run("lamb (2 passes)", 40, opt);
    }
    std::printf(
        "\nbound/time: (bytes / STREAM-copy bandwidth) / best time; 1.0 = the step moves its "
        "bytes at STREAM-copy speed.\nvs a+=b: the same against the in-place anchor "
        "(no write-allocate), the tighter roof for in-place updates.\n");
    return 0;
}

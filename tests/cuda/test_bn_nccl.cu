// nn::batch_norm<bn::global> over NCCL against double references on the concatenated global
// batch: native __half and __nv_bfloat16 storage in NHWC and NCHW, 20000 channels, more than 2^24
// values per channel; a layer on another stream than its communicator's is refused; bn::group's
// statistics run on the layer's stream. Every case needs a GPU (tagged [gpu]); the merges of
// several replicas two or more ([multi_gpu]); the same layers on one replica run with one GPU.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/system/buffer.hpp"

#include "bn_gpu_cases.hpp"
#include "cuda_test_support.hpp"
#include "lockstep/comm/gpu_group.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

using namespace lockstep;
using namespace lockstep_test::bn_gpu;

// Tolerances: bn_gpu_cases.hpp, check_16bit_layer. One replica: the layer's kernels and its
// statistics through NCCL; several: their merge into the global batch's.
TEMPLATE_TEST_CASE("batch_norm<bn::global> with native 16-bit storage on one NCCL replica matches "
                   "a float reference",
                   "[nn][bn][nccl][gpu]", (format_case<__half, nn::nhwc>),
                   (format_case<__half, nn::nchw>), (format_case<__nv_bfloat16, nn::nhwc>),
                   (format_case<__nv_bfloat16, nn::nchw>)) {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group(std::vector<int>{0});
    check_16bit_layer<typename TestType::storage, typename TestType::layout>(group);
}

TEMPLATE_TEST_CASE("batch_norm<bn::global> with native 16-bit storage over NCCL matches a float "
                   "reference",
                   "[nn][bn][nccl][gpu][multi_gpu]", (format_case<__half, nn::nhwc>),
                   (format_case<__half, nn::nchw>), (format_case<__nv_bfloat16, nn::nhwc>),
                   (format_case<__nv_bfloat16, nn::nchw>)) {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    REQUIRE(group.size() >= 2);
    check_16bit_layer<typename TestType::storage, typename TestType::layout>(group);
}

// Tolerances (float data, double reference): mean 1e-5 (|mean| + 1), invstd 1e-4 relative, y and
// dx 1e-4 (1 + |ref|), running statistics 1e-5 (1 + |ref|), dgamma 1e-5 of the sum of |dy xhat|,
// dbeta 1e-5 of the sum of |dy|. A count kept in float would stop at 2^24 and miss them.
namespace {
/// A float bn::global layer of 20000 channels on every replica of `group` (replica r holds 3 + r
/// samples) against the double reference of the whole batch.
void check_20000_channels(gpu_group& group) {
    constexpr std::size_t C = 20000;
    const auto R = static_cast<std::size_t>(group.size());
    std::vector<std::size_t> first(R + 1, 0);
    for (std::size_t r = 0; r < R; ++r)
        first[r + 1] = first[r] + 3 + r;
    const std::size_t N = first[R];
    auto x = [](std::size_t i) {
        return double(static_cast<float>(1.0 + std::sin(0.37 * double(i)) + 1e-4 * double(i % C)));
    };
    auto dy = [](std::size_t i) { return double(static_cast<float>(std::cos(0.11 * double(i)))); };
    std::vector<bn_out> outs(R);
    group.run([&](nccl_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::size_t n = first[r + 1] - first[r];
        std::vector<float> xs(n * C), dys(n * C);
        for (std::size_t k = 0; k < xs.size(); ++k) {
            xs[k] = static_cast<float>(x(first[r] * C + k));
            dys[k] = static_cast<float>(dy(first[r] * C + k));
        }
        outs[r] = run_layer<float, nn::nc>(comm, xs, dys, {n, C}, C);
    });
    const reference ref = make_reference(C, N, [&](std::size_t c, std::size_t k) {
        return std::pair<double, double>(x(k * C + c), dy(k * C + c));
    });
    std::vector<std::size_t> offset(R);
    for (std::size_t r = 0; r < R; ++r)
        offset[r] = first[r] * C;
    check_float_layer(outs, offset, ref, x, dy, [](std::size_t i) { return i % C; });
}
} // namespace

TEST_CASE("batch_norm<bn::global> with 20000 channels on one NCCL replica matches a double "
          "reference",
          "[nn][bn][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group(std::vector<int>{0});
    check_20000_channels(group);
}

TEST_CASE("batch_norm<bn::global> over NCCL with 20000 channels matches a double reference",
          "[nn][bn][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    REQUIRE(group.size() >= 2);
    check_20000_channels(group);
}

namespace {
/// A float bn::global layer of one channel with 4097 x 4097 > 2^24 values over the replicas of
/// `group` (replica r holds rows [4097 r / R, 4097 (r + 1) / R)) against the double reference.
void check_beyond_2_24(gpu_group& group) {
    constexpr std::size_t side = 4097; // 1 x 1 x 4097 x 4097 = 16785409 > 2^24 values
    const auto R = static_cast<std::size_t>(group.size());
    std::vector<std::size_t> row(R + 1); // replica r holds rows [row[r], row[r+1])
    for (std::size_t r = 0; r <= R; ++r)
        row[r] = side * r / R;
    auto x = [](std::size_t i) {
        return double(static_cast<float>(5.0 + 0.5 * std::sin(0.7 * double(i)) +
                                         0.25 * std::cos(1.3e-5 * double(i))));
    };
    auto dy = [](std::size_t i) {
        return double(static_cast<float>(std::sin(0.3 * double(i) + 0.2)));
    };
    std::vector<bn_out> outs(R);
    group.run([&](nccl_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::size_t rows = row[r + 1] - row[r];
        std::vector<float> xs(rows * side), dys(xs.size());
        for (std::size_t k = 0; k < xs.size(); ++k) {
            xs[k] = static_cast<float>(x(row[r] * side + k));
            dys[k] = static_cast<float>(dy(row[r] * side + k));
        }
        outs[r] = run_layer<float, nn::nchw>(comm, xs, dys, {1, 1, rows, side}, 1);
    });
    const reference ref = make_reference(1, side * side, [&](std::size_t, std::size_t k) {
        return std::pair<double, double>(x(k), dy(k));
    });
    std::vector<std::size_t> offset(R);
    for (std::size_t r = 0; r < R; ++r)
        offset[r] = row[r] * side;
    check_float_layer(outs, offset, ref, x, dy, [](std::size_t) { return std::size_t(0); });
}
} // namespace

TEST_CASE("batch_norm<bn::global> with more than 2^24 values per channel on one NCCL replica "
          "matches a double reference",
          "[nn][bn][nccl][gpu][large]") {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group(std::vector<int>{0});
    check_beyond_2_24(group);
}

TEST_CASE("batch_norm<bn::global> over NCCL with more than 2^24 values per channel matches a "
          "double reference",
          "[nn][bn][nccl][gpu][large][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    REQUIRE(group.size() >= 2);
    check_beyond_2_24(group);
}

TEST_CASE("batch_norm on another stream than its communicator's is refused, naming both streams",
          "[nn][bn][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    std::string forward_error, backward_error, layer_stream, comm_stream, construct_error;
    errc forward_code = errc::internal, backward_code = errc::internal;
    errc construct_code = errc::internal;
    gpu_group group(std::vector<int>{0});
    group.run([&](nccl_communicator& comm) {
        cuda_stream other(comm.device());
        try {
            // Built from the communicator with another stream: refused at construction.
            nn::batch_norm<float, bn::global, nn::nc, cuda_system> refused(comm, 4, {},
                                                                           other.system());
        } catch (const error& e) {
            construct_error = e.what();
            construct_code = e.code();
        }
        {
            nn::batch_norm<float, bn::global, nn::nc, cuda_system> layer(4, {}, other.system());
            buffer<float, cuda_system> x(8, comm.system()), y(8, comm.system());
            std::ostringstream a, b;
            a << static_cast<const void*>(other.get());
            b << static_cast<const void*>(comm.system().stream());
            layer_stream = a.str();
            comm_stream = b.str();
            try {
                layer.forward_train(comm, std::span<const float>(x.span()), {2, 4}, y.span());
            } catch (const error& e) {
                forward_error = e.what();
                forward_code = e.code();
            }
            try {
                layer.backward(comm, std::span<const float>(x.span()), y.span());
            } catch (const error& e) {
                backward_error = e.what();
                backward_code = e.code();
            }
            comm.synchronize();
        }
        other.system().synchronize();
    });
    INFO(construct_error);
    CHECK(construct_code == errc::invalid_argument);
    CHECK(construct_error.find("stream " + layer_stream) != std::string::npos);
    INFO(forward_error);
    CHECK(forward_code == errc::invalid_argument);
    CHECK(forward_error.find("stream " + layer_stream) != std::string::npos);
    CHECK(forward_error.find("stream " + comm_stream) != std::string::npos);
    INFO(backward_error);
    CHECK(backward_code == errc::invalid_argument);
    CHECK(backward_error.find("stream " + layer_stream) != std::string::npos);
}

namespace {
void CUDART_CB hold_stream(void*) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// bn::group's statistics run on a split of the layer's communicator: on the layer's own stream,
// or they would read the partial sums before the layer's kernels wrote them. x reaches the layer
// only after the stream was held on the host for 50 ms (until then it is NaN), so statistics on
// an unordered stream would see NaN or stale values. Groups of G consecutive replicas (the last
// one smaller): G = 1 (each replica alone, the one-GPU case) and G = 2 (two replicas or more:
// with one, its group would be that one alone).
template <class Policy>
void check_group_layer(gpu_group& group) {
    constexpr std::size_t C = 5;
    constexpr std::size_t G = Policy::size;
    const auto R = static_cast<std::size_t>(group.size());
    std::vector<std::size_t> first(R + 1, 0);
    for (std::size_t r = 0; r < R; ++r)
        first[r + 1] = first[r] + 3 + r;
    auto x = [](std::size_t i) {
        return double(static_cast<float>(0.5 + std::sin(0.37 * double(i)) + 0.01 * double(i % C)));
    };
    auto dy = [](std::size_t i) { return double(static_cast<float>(std::cos(0.11 * double(i)))); };
    std::vector<bn_out> outs(R);
    group.run([&](nccl_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::size_t n = first[r + 1] - first[r];
        const cuda_system sys = comm.system();
        std::vector<float> xs(n * C), dys(n * C);
        for (std::size_t k = 0; k < xs.size(); ++k) {
            xs[k] = static_cast<float>(x(first[r] * C + k));
            dys[k] = static_cast<float>(dy(first[r] * C + k));
        }
        nn::batch_norm<float, Policy, nn::nc, cuda_system> layer(comm, C);
        const auto source = to_device(xs, sys);
        auto dy_dev = to_device(dys, sys);
        buffer<float, cuda_system> x_dev(xs.size(), sys), y_dev(xs.size(), sys),
            dx_dev(xs.size(), sys);
        LOCKSTEP_CUDA_CHECK(
            cudaMemsetAsync(x_dev.data(), 0xff, xs.size() * sizeof(float), sys.stream()));
        sys.synchronize();
        LOCKSTEP_CUDA_CHECK(cudaLaunchHostFunc(sys.stream(), hold_stream, nullptr));
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(x_dev.data(), source.data(), xs.size() * sizeof(float),
                                            cudaMemcpyDeviceToDevice, sys.stream()));
        layer.forward_train(comm, std::span<const float>(x_dev.span()), {n, C}, y_dev.span());
        layer.backward(comm, std::span<const float>(dy_dev.span()), dx_dev.span());
        comm.synchronize();
        auto widen = [](const std::vector<float>& v) {
            return std::vector<double>(v.begin(), v.end());
        };
        outs[r].y = widen(to_host(std::span<const float>(y_dev.span()), sys));
        outs[r].dx = widen(to_host(std::span<const float>(dx_dev.span()), sys));
        outs[r].mean = widen(to_host(layer.batch_mean(), sys));
        outs[r].invstd = widen(to_host(layer.batch_invstd(), sys));
    });
    for (std::size_t r = 0; r < R; ++r) {
        const std::size_t g0 = r / G * G, g1 = std::min(g0 + G, R);
        const std::size_t rows = first[g1] - first[g0];
        const reference ref = make_reference(C, rows, [&](std::size_t c, std::size_t k) {
            const std::size_t i = (first[g0] + k) * C + c;
            return std::pair<double, double>(x(i), dy(i));
        });
        INFO("replica " << r << " of " << R << ", groups of " << G);
        REQUIRE(outs[r].mean.size() == C);
        for (std::size_t c = 0; c < C; ++c) {
            CHECK(std::abs(outs[r].mean[c] - ref.mean[c]) <= 1e-5 * (1 + std::abs(ref.mean[c])));
            CHECK(std::abs(outs[r].invstd[c] - ref.invstd[c]) <= 1e-4 * ref.invstd[c]);
        }
        const std::size_t n = first[r + 1] - first[r];
        REQUIRE(outs[r].y.size() == n * C);
        for (std::size_t k = 0; k < n * C; ++k) {
            const std::size_t i = first[r] * C + k, c = k % C;
            const double y_ref = ref.y(x(i), c), dx_ref = ref.dx(x(i), dy(i), c);
            REQUIRE(std::abs(outs[r].y[k] - y_ref) <= 1e-4 * (1 + std::abs(y_ref)));
            REQUIRE(std::abs(outs[r].dx[k] - dx_ref) <= 1e-4 * (1 + std::abs(dx_ref)));
        }
    }
}
} // namespace

TEST_CASE("batch_norm<bn::group<1>> over NCCL runs on the layer's stream and matches each "
          "replica's double reference",
          "[nn][bn][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group;
    check_group_layer<bn::group<1>>(group);
}

TEST_CASE("batch_norm<bn::group<2>> over NCCL runs on the layer's stream and matches the "
          "group's double reference",
          "[nn][bn][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    REQUIRE(group.size() >= 2);
    check_group_layer<bn::group<2>>(group);
}

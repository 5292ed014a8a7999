// nn::batch_norm<bn::global> over NCCL against double references on the concatenated global
// batch: native __half and __nv_bfloat16 storage in NHWC and NCHW, 20000 channels, more than 2^24
// values per channel; and a layer on another stream than its communicator's is refused.
// Every case needs a GPU (tagged [gpu]). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/system/buffer.hpp"

#include "bn_gpu_cases.hpp"
#include "cuda_test_support.hpp"
#include "lockstep/comm/gpu_group.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

using namespace lockstep;
using namespace lockstep_test::bn_gpu;

// Tolerances: bn_gpu_cases.hpp, check_16bit_layer.
TEMPLATE_TEST_CASE("batch_norm<bn::global> with native 16-bit storage over NCCL matches a float "
                   "reference",
                   "[nn][bn][nccl][gpu]", (format_case<__half, nn::nhwc>),
                   (format_case<__half, nn::nchw>), (format_case<__nv_bfloat16, nn::nhwc>),
                   (format_case<__nv_bfloat16, nn::nchw>)) {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group;
    check_16bit_layer<typename TestType::storage, typename TestType::layout>(group);
}

// Tolerances (float data, double reference): mean 1e-5 (|mean| + 1), invstd 1e-4 relative, y and
// dx 1e-4 (1 + |ref|), running statistics 1e-5 (1 + |ref|), dgamma 1e-5 of the sum of |dy xhat|,
// dbeta 1e-5 of the sum of |dy|. A count kept in float would stop at 2^24 and miss them.
TEST_CASE("batch_norm<bn::global> over NCCL with 20000 channels matches a double reference",
          "[nn][bn][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    constexpr std::size_t C = 20000;
    gpu_group group;
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

TEST_CASE("batch_norm<bn::global> over NCCL with more than 2^24 values per channel matches a "
          "double reference",
          "[nn][bn][nccl][gpu][large]") {
    if (lockstep_test::skip_without_gpu())
        return;
    constexpr std::size_t side = 4097; // 1 x 1 x 4097 x 4097 = 16785409 > 2^24 values
    gpu_group group;
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

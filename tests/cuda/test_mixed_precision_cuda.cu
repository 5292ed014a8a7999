// Mixed precision on a GPU: the 16-bit casts and the loss scaler's kernels give the host's bits,
// compute_copy works on device buffers, and data_parallel over NCCL with loss scaling on keeps one
// host synchronisation per step. Every case needs a GPU (tagged [gpu]).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/host_sync.hpp"
#include "lockstep/train/compute_copy.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/loss_scaler.hpp"

#include "cuda_test_support.hpp"
#include "gpu_test_net.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace lockstep;
namespace tn = lockstep_test::net;

template <class T>
std::vector<T> to_host(std::span<const T> s, const cuda_system& sys) {
    std::vector<T> h(s.size());
    copy(s, sys, std::span<T>(h), host_system{});
    return h;
}

template <class T>
buffer<T, cuda_system> to_device(const std::vector<T>& h, const cuda_system& sys) {
    buffer<T, cuda_system> d(h.size(), sys);
    copy(std::span<const T>(h), host_system{}, d.span(), sys);
    return d;
}

} // namespace

TEMPLATE_TEST_CASE("16-bit casts on a GPU give the host's bits", "[gpu][mixed]", lockstep::half,
                   lockstep::bfloat16) {
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system dev(0);
    const host_system host{1};
    std::vector<float> src;
    for (int i = -300; i < 9000; ++i)
        src.push_back(std::ldexp(1.0f + 0.37f * float(i % 7), i % 40 - 20) * (i % 2 ? -1 : 1));
    src.push_back(std::numeric_limits<float>::infinity());
    src.push_back(1e-7f);
    src.push_back(70000.0f);
    std::vector<TestType> want(src.size());
    kernels::cast_down(host, std::span<const float>(src), std::span<TestType>(want));
    const auto d_src = to_device(src, dev);
    buffer<TestType, cuda_system> d_low(src.size(), dev);
    kernels::cast_down(dev, std::span<const float>(d_src.span()), d_low.span());
    const auto got = to_host(std::span<const TestType>(d_low.span()), dev);
    for (std::size_t i = 0; i < src.size(); ++i)
        REQUIRE(got[i].bits == want[i].bits);

    const std::vector<double> factor_h{0.25};
    const auto factor = to_device(factor_h, dev);
    std::vector<float> acc_h(src.size(), 1.0f);
    kernels::accumulate_up(host, std::span<const TestType>(want), std::span<float>(acc_h),
                           factor_h.data());
    auto acc = to_device(std::vector<float>(src.size(), 1.0f), dev);
    kernels::accumulate_up(dev, std::span<const TestType>(d_low.span()), acc.span(), factor.data());
    kernels::multiply_by(dev, acc.span(), factor.data());
    for (float& v : acc_h)
        v *= 0.25f;
    CHECK(to_host(std::span<const float>(acc.span()), dev) == acc_h);

    compute_copy<TestType, float, cuda_system> cc(src.size(), dev);
    cc.refresh(std::span<const float>(d_src.span()), 0);
    const auto copied = to_host(std::span<const TestType>(cc.values()), dev);
    for (std::size_t i = 0; i < src.size(); ++i)
        REQUIRE(copied[i].bits == want[i].bits);
}

TEST_CASE("loss_scaler on a GPU: backoff, growth and state round trip", "[gpu][mixed]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_system dev(0);
    const loss_scaling cfg{.init_scale = 1024, .growth_interval = 2};
    loss_scaler<cuda_system> s(cfg, dev);
    CHECK(s.state() == loss_scaler_state{1024, 0});
    CHECK(s.known_scale() == 1024.0);
    // [0] the non-finite count, [1] the skip decision, in device memory.
    buffer<double, cuda_system> status(2, dev);
    buffer<kernels::loss_scale_record, cuda_system> report(1, dev);
    auto step = [&](double non_finite) {
        const std::vector<double> st{non_finite, non_finite > 0 ? 1.0 : 0.0};
        copy(std::span<const double>(st), host_system{}, status.span(), dev);
        s.update(status.data(), status.data() + 1, report.data());
        return s.observe(
            to_host(std::span<const kernels::loss_scale_record>(report.span()), dev)[0], true);
    };
    CHECK(step(0).next == loss_scaler_state{1024, 1});
    const loss_scale_report grown = step(0);
    CHECK(grown.used == 1024);
    CHECK(grown.next == loss_scaler_state{2048, 0});
    CHECK(s.state() == loss_scaler_state{2048, 0});
    CHECK(step(2).next == loss_scaler_state{1024, 0});
    CHECK(s.known_scale() == 1024.0);
    loss_scaler<cuda_system> t(cfg, dev);
    t.restore(s.state());
    CHECK(t.state() == s.state());
    CHECK(to_host(std::span<const double>(t.inverse_device(), 1), dev)[0] == 1.0 / 1024);
}

TEST_CASE("data_parallel over NCCL with loss scaling: scale 1 is bitwise plain training, one "
          "host synchronisation per step",
          "[gpu][mixed][nccl]") {
    if (lockstep_test::skip_without_gpu())
        return;
    using comm_t = nccl_communicator;
    using net_t = tn::test_net<comm_t, bn::global>;
    using trainer_t = data_parallel<net_t, optim::sgd<float, cuda_system>, sync::synchronous,
                                    reduce::bucketed<>, comm_t>;
    constexpr std::size_t batch = 16;
    constexpr int steps = 3;
    auto run = [&](std::optional<loss_scaling> scaling) {
        std::vector<std::vector<float>> params;
        std::vector<std::uint64_t> syncs;
        std::vector<double> scales;
        gpu_group group({.timeout = std::chrono::seconds(60)});
        group.run([&](comm_t& comm) {
            trainer_t trainer(comm, [&](auto& ctx) { return net_t(ctx, batch / comm.size() + 1); },
                              {.lr = 0.05}, {.loss_scale = scaling});
            for (int k = 0; k < steps; ++k) {
                const auto before = host_sync_count();
                const step_result r = trainer.step(batch, [](net_t& n, shard_range sr, auto& ctx) {
                    LOCKSTEP_REQUIRE(ctx.loss_scale_device() != nullptr, errc::internal, ctx.rank(),
                                     "test", "no device loss scale");
                    n.train(sr, ctx);
                });
                const auto used = host_sync_count() - before;
                if (comm.rank() == 0) {
                    syncs.push_back(used);
                    scales.push_back(r.loss_scale);
                }
            }
            if (comm.rank() == 0)
                params.push_back(
                    to_host(std::span<const float>(trainer.parameters()), comm.system()));
        });
        return std::make_tuple(params, syncs, scales);
    };
    const auto [p0, s0, c0] = run(std::nullopt);
    const auto [p1, s1, c1] = run(loss_scaling{.init_scale = 1, .growth_interval = 1000});
    CHECK(p1 == p0);
    CHECK(s1 == s0);
    // One read per step; the first step adds its 3 BN layers' settings checks.
    std::vector<std::uint64_t> expected_syncs(steps, 1);
    expected_syncs[0] += 3;
    CHECK(s1 == expected_syncs);
    CHECK(c1 == std::vector<double>(steps, 1.0));
}

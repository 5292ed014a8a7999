// Tests of nccl_communicator: every collective and element type over all visible GPUs (one host
// thread per replica), checked against a host reference; skipped where no GPU exists.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/system/buffer.hpp" // before the CUDA headers on purpose: copy() must still
                                      // find the cuda_system copies (argument-dependent lookup)
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/policy/compat.hpp"

#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <exception>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace {

using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::host_system;
using lockstep::nccl_communicator;
using lockstep::reduce_op;

static_assert(lockstep::communicator<nccl_communicator>);
static_assert(!lockstep::point_to_point_communicator<nccl_communicator>,
              "no any-source receive over NCCL");
static_assert(std::is_same_v<nccl_communicator::system_type, cuda_system>);
// The synchronous trainer accepts NCCL with every reduction and exact global BN statistics (the
// asynchronous modes are rejected by a static_assert, through the missing recv_any above).
static_assert(lockstep::check_compatible<lockstep::sync::synchronous, lockstep::reduce::bucketed<>,
                                         nccl_communicator, std::tuple<lockstep::bn::global>>());
static_assert(lockstep::check_compatible<lockstep::sync::synchronous,
                                         lockstep::reduce::compressed<lockstep::bfloat16>,
                                         nccl_communicator>());
static_assert(lockstep::nccl_element<float> && lockstep::nccl_element<double> &&
              lockstep::nccl_element<int> && lockstep::nccl_element<std::int64_t> &&
              lockstep::nccl_element<std::uint8_t> && lockstep::nccl_element<__half> &&
              lockstep::nccl_element<__nv_bfloat16>);
static_assert(!lockstep::nccl_element<bool> && !lockstep::nccl_element<short> &&
              !lockstep::nccl_element<host_system>);
static_assert(lockstep::detail::nccl_data_type<long long>() == ncclInt64);
static_assert(lockstep::detail::nccl_data_type<unsigned>() == ncclUint32);
static_assert(lockstep::detail::nccl_data_type<__nv_bfloat16>() == ncclBfloat16);
static_assert(lockstep::detail::nccl_data_type<lockstep::half>() == ncclFloat16 &&
              lockstep::detail::nccl_data_type<lockstep::bfloat16>() == ncclBfloat16);
static_assert(sizeof(lockstep::half) == sizeof(__half) &&
              sizeof(lockstep::bfloat16) == sizeof(__nv_bfloat16));

// Values are small integers (plus eighths for float/double), so every partial sum over up to 16
// replicas is exact in every element type, including half (11-bit significand) and bfloat16
// (8-bit): results must equal the double reference exactly, whatever order NCCL reduces in.
template <class T>
double input_value(int rank, std::size_t i) {
    const int k = static_cast<int>((static_cast<std::size_t>(rank) * 131u + i * 7u) % 17u);
    double v = std::is_signed_v<T> || !std::is_integral_v<T> ? k - 8 : k;
    if constexpr (std::is_floating_point_v<T>)
        v += static_cast<double>(i % 5) * 0.125;
    return v;
}

template <class T>
T make(double v) {
    if constexpr (std::is_same_v<T, lockstep::half> || std::is_same_v<T, lockstep::bfloat16>)
        return T(static_cast<float>(v));
    else if constexpr (std::is_same_v<T, __half>)
        return __float2half(static_cast<float>(v));
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __float2bfloat16(static_cast<float>(v));
    else
        return static_cast<T>(v);
}

template <class T>
double value_of(T x) {
    if constexpr (std::is_same_v<T, lockstep::half> || std::is_same_v<T, lockstep::bfloat16>)
        return static_cast<double>(static_cast<float>(x));
    else if constexpr (std::is_same_v<T, __half>)
        return __half2float(x);
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat162float(x);
    else
        return static_cast<double>(x);
}

template <class T>
buffer<T, cuda_system> device_input(int rank, std::size_t n, const cuda_system& sys) {
    buffer<T, host_system> h(n);
    for (std::size_t i = 0; i < n; ++i)
        h[i] = make<T>(input_value<T>(rank, i));
    buffer<T, cuda_system> d(n, sys);
    lockstep::copy(h, d);
    return d;
}

template <class T>
std::vector<double> to_values(const buffer<T, cuda_system>& d) {
    buffer<T, host_system> h(d.size());
    lockstep::copy(d, h);
    std::vector<double> v(d.size());
    for (std::size_t i = 0; i < d.size(); ++i)
        v[i] = value_of(h[i]);
    return v;
}

using lockstep_test::all_devices;
using lockstep_test::run_replicas;

struct collective_results {
    std::vector<double> sum, max, min, broadcast, gather, reduce;
};

} // namespace

TEST_CASE("nccl_communicator rejects bad device lists without touching NCCL", "[comm][nccl]") {
    const std::vector<int> none;
    CHECK_THROWS_AS(nccl_communicator::init_all(none), lockstep::error);
    const std::vector<int> twice{0, 0}; // duplicate, or missing without a GPU
    try {
        (void)nccl_communicator::init_all(twice);
        FAIL("init_all accepted device 0 twice");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::invalid_argument);
    }
    const std::vector<int> missing{lockstep::cuda_device_count()};
    CHECK_THROWS_AS(nccl_communicator::init_all(missing), lockstep::error);
}

TEMPLATE_TEST_CASE("nccl collectives match the host reference", "[comm][nccl][gpu]", float, double,
                   int, std::int64_t, std::uint8_t, __half, __nv_bfloat16, lockstep::half,
                   lockstep::bfloat16) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    auto comms = all_devices();
    const int size = static_cast<int>(comms.size());
    const int root = size - 1;
    for (std::size_t n :
         {std::size_t{0}, std::size_t{1}, std::size_t{7919}, std::size_t{1} << 18}) {
        CAPTURE(n, size);
        std::vector<collective_results> results(comms.size());
        run_replicas(comms, [&](nccl_communicator& comm) {
            const int r = comm.rank();
            const auto sys = comm.system();
            auto& out = results[static_cast<std::size_t>(r)];
            auto send = device_input<T>(r, n, sys);
            buffer<T, cuda_system> recv(n, sys), gathered(n * static_cast<std::size_t>(size), sys);
            comm.all_reduce(send.span(), recv.span(), reduce_op::sum);
            comm.synchronize();
            out.sum = to_values(recv);
            comm.all_reduce(send.span(), recv.span(), reduce_op::max);
            comm.synchronize();
            out.max = to_values(recv);
            // In place (send aliases recv).
            auto inout = device_input<T>(r, n, sys);
            comm.all_reduce(inout.span(), inout.span(), reduce_op::min);
            comm.synchronize();
            out.min = to_values(inout);
            auto b = device_input<T>(r, n, sys);
            comm.broadcast(b.span(), root);
            comm.all_gather(send.span(), gathered.span());
            comm.synchronize();
            out.broadcast = to_values(b);
            out.gather = to_values(gathered);
            auto red = device_input<T>(r, n, sys); // non-roots keep their own input
            comm.reduce(send.span(), red.span(), reduce_op::sum, 0);
            comm.barrier();
            out.reduce = to_values(red);
        });
        for (int r = 0; r < size; ++r) {
            const auto& out = results[static_cast<std::size_t>(r)];
            REQUIRE(out.sum.size() == n);
            REQUIRE(out.gather.size() == n * static_cast<std::size_t>(size));
            for (std::size_t i = 0; i < n; ++i) {
                double sum = 0, mx = input_value<T>(0, i), mn = mx;
                for (int q = 0; q < size; ++q) {
                    const double v = input_value<T>(q, i);
                    sum += v;
                    mx = std::max(mx, v);
                    mn = std::min(mn, v);
                }
                REQUIRE(out.sum[i] == sum);
                REQUIRE(out.max[i] == mx);
                REQUIRE(out.min[i] == mn);
                REQUIRE(out.broadcast[i] == input_value<T>(root, i));
                REQUIRE(out.reduce[i] == (r == 0 ? sum : input_value<T>(r, i)));
                for (int q = 0; q < size; ++q)
                    REQUIRE(out.gather[static_cast<std::size_t>(q) * n + i] ==
                            input_value<T>(q, i));
            }
        }
    }
}

TEST_CASE("nccl split, point-to-point ring and barrier", "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    auto comms = all_devices();
    const int size = static_cast<int>(comms.size());
    const std::size_t n = 1031;
    std::vector<std::vector<double>> group_sum(comms.size()), from_left(comms.size());
    std::vector<int> sub_rank(comms.size()), sub_size(comms.size());
    run_replicas(comms, [&](nccl_communicator& comm) {
        const int r = comm.rank();
        const auto i = static_cast<std::size_t>(r);
        // Colors by parity, keys reversed: sub-ranks follow descending parent rank.
        nccl_communicator sub = comm.split(r % 2, size - r);
        sub_rank[i] = sub.rank();
        sub_size[i] = sub.size();
        {
            auto x = device_input<float>(r, n, sub.system());
            sub.all_reduce(x.span(), x.span(), reduce_op::sum);
            sub.synchronize();
            group_sum[i] = to_values(x);
        }
        sub.barrier();
        if (size > 1) {
            auto mine = device_input<double>(r, n, comm.system());
            buffer<double, cuda_system> theirs(n, comm.system());
            lockstep::nccl_group group; // send and recv of one replica must not serialise
            comm.send(std::span<const double>(mine.span()), (r + 1) % size);
            comm.recv(theirs.span(), (r + size - 1) % size);
            group.end();
            comm.synchronize();
            from_left[i] = to_values(theirs);
        }
        comm.barrier();
    });
    for (int r = 0; r < size; ++r) {
        const auto i = static_cast<std::size_t>(r);
        int members = 0, above = 0;
        for (int q = r % 2; q < size; q += 2) {
            ++members;
            if (q > r)
                ++above;
        }
        CHECK(sub_size[i] == members);
        CHECK(sub_rank[i] == above);
        for (std::size_t k = 0; k < n; ++k) {
            double sum = 0;
            for (int q = r % 2; q < size; q += 2)
                sum += input_value<float>(q, k);
            REQUIRE(group_sum[i][k] == sum);
            if (size > 1)
                REQUIRE(from_left[i][k] == input_value<double>((r + size - 1) % size, k));
        }
    }
}

TEST_CASE("a failing nccl replica releases its peers", "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    auto comms = all_devices();
    std::vector<lockstep::errc> codes(comms.size(), lockstep::errc::internal);
    std::vector<int> thrown(comms.size(), 0);
    run_replicas(comms, [&](nccl_communicator& comm) {
        const auto i = static_cast<std::size_t>(comm.rank());
        buffer<float, cuda_system> a(64, comm.system()),
            b(comm.rank() == 0 ? 63 : 64, comm.system());
        try {
            comm.all_reduce(std::span<const float>(a.span()), b.span(), reduce_op::sum);
            comm.synchronize();
        } catch (const lockstep::error& e) {
            thrown[i] = 1;
            codes[i] = e.code();
        }
    });
    CHECK(thrown[0] == 1);
    CHECK(codes[0] == lockstep::errc::shape_mismatch);
    for (std::size_t r = 1; r < comms.size(); ++r) {
        CHECK(thrown[r] == 1);
        CHECK(codes[r] == lockstep::errc::peer_failure);
    }
    for (auto& c : comms)
        CHECK(c.aborted());
}

TEST_CASE("host memory passed to an nccl collective is rejected, not crashed on",
          "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    auto comms = all_devices();
    std::vector<lockstep::errc> codes(comms.size(), lockstep::errc::internal);
    run_replicas(comms, [&](nccl_communicator& comm) {
        const auto i = static_cast<std::size_t>(comm.rank());
        std::vector<float> host(16, 1.0f); // a std::vector: host memory
        buffer<float, cuda_system> dev(16, comm.system());
        try {
            if (comm.rank() == 0)
                comm.all_reduce(std::span<const float>(host), std::span<float>(host),
                                reduce_op::sum);
            else
                comm.all_reduce(std::span<const float>(dev.span()), dev.span(), reduce_op::sum);
            comm.synchronize();
        } catch (const lockstep::error& e) {
            codes[i] = e.code();
        }
    });
    CHECK(codes[0] == lockstep::errc::invalid_argument);
    for (std::size_t r = 1; r < comms.size(); ++r)
        CHECK(codes[r] == lockstep::errc::peer_failure);
}

// Tests of nccl_communicator and gpu_group: every collective and element type over all visible
// GPUs (one host thread per replica), checked against a host reference; failures, stream
// adoption and the polling waits. The [gpu] cases are skipped where no GPU exists, the
// [multi_gpu] ones (claims about several replicas) where fewer than two do.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/system/buffer.hpp" // before the CUDA headers on purpose: copy() must still
                                      // find the cuda_system copies (argument-dependent lookup)
#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/policy/compat.hpp"

#include "comm/collective_suite.hpp"
#include "cuda_test_support.hpp"
#include "device_delay.cuh"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using lockstep::buffer;
using lockstep::cuda_system;
using lockstep::gpu_group;
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

struct collective_results {
    std::vector<double> sum, max, min, broadcast, gather, reduce;
};

/// The code of the lockstep::error that make() throws, or errc::internal when it throws none.
template <class F>
lockstep::errc code_of(F make) {
    try {
        make();
    } catch (const lockstep::error& e) {
        return e.code();
    }
    return lockstep::errc::internal;
}

} // namespace

TEST_CASE("nccl_communicator rejects bad device lists without touching NCCL", "[comm][nccl]") {
    const std::vector<int> none;
    CHECK(code_of([&] { (void)nccl_communicator::init_all(none); }) ==
          lockstep::errc::invalid_argument);
    const std::vector<int> twice{0, 0}; // duplicate, or missing without a GPU
    try {
        (void)nccl_communicator::init_all(twice);
        FAIL("init_all accepted device 0 twice");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::invalid_argument);
    }
    const std::vector<int> missing{lockstep::cuda_device_count()};
    CHECK(code_of([&] { (void)nccl_communicator::init_all(missing); }) ==
          lockstep::errc::invalid_argument);
}

TEMPLATE_TEST_CASE("nccl collectives match the host reference", "[comm][nccl][gpu][multi_gpu]",
                   float, double, int, std::int64_t, std::uint8_t, __half, __nv_bfloat16,
                   lockstep::half, lockstep::bfloat16) {
    using T = TestType;
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    const int size = group.size();
    const int root = size - 1;
    for (std::size_t n :
         {std::size_t{0}, std::size_t{1}, std::size_t{7919}, std::size_t{1} << 18}) {
        CAPTURE(n, size);
        std::vector<collective_results> results(static_cast<std::size_t>(size));
        group.run([&](nccl_communicator& comm) {
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

// The collective suite's half and bfloat16 checks, with values that use the whole 16-bit
// significand: NCCL reduces in its own order and rounds every partial sum to 16 bits, so sums
// are checked within the suite's any-order bound (float16_bound: n * (u * sum|x| + t) of the
// double sum); max, min, all_gather and broadcast are exact, and every reduction's result must
// have the same bits on every replica.
TEMPLATE_TEST_CASE("nccl half and bfloat16 collectives pass the suite's 16-bit checks",
                   "[comm][nccl][gpu][multi_gpu]", lockstep::half, lockstep::bfloat16) {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    std::vector<lockstep::testing::suite_report> reports(static_cast<std::size_t>(group.size()));
    group.run([&](nccl_communicator& comm) {
        auto& rep = reports[static_cast<std::size_t>(comm.rank())];
        rep.rank = comm.rank();
        rep.size = comm.size();
        lockstep::testing::check_float16<TestType>(
            comm, rep, {.rank_order_sums = false, .rank_order_float16 = false});
    });
    for (const auto& r : reports) {
        INFO(r.text());
        CHECK(r.rank >= 0);
        CHECK(r.failed == 0);
        CHECK(r.checks > 20);
    }
}

TEMPLATE_TEST_CASE("nccl reduce_scatter matches the host reference for equal, uneven and empty "
                   "counts, in place too",
                   "[comm][nccl][gpu][multi_gpu]", float, double, int, std::int64_t, std::uint8_t,
                   __half, lockstep::bfloat16) {
    using T = TestType;
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    const int size = group.size();
    const std::size_t ranks = static_cast<std::size_t>(size);
    // Equal counts (ncclReduceScatter): 0, 1, a prime; uneven (one ncclReduce per rank): a prime
    // total spread over the ranks, and zeros for every odd rank.
    std::vector<std::vector<std::size_t>> layouts;
    for (const std::size_t each : {std::size_t{0}, std::size_t{1}, std::size_t{1009}})
        layouts.emplace_back(ranks, each);
    std::vector<std::size_t> spread(ranks), zeros(ranks);
    for (std::size_t r = 0; r < ranks; ++r) {
        spread[r] = 7919 / ranks + (r < 7919 % ranks ? 1 : 0);
        zeros[r] = r % 2 == 1 ? 0 : 101 * (r + 1);
    }
    layouts.push_back(spread);
    layouts.push_back(zeros);
    for (const auto& counts : layouts) {
        std::vector<std::size_t> offsets(ranks + 1, 0);
        for (std::size_t r = 0; r < ranks; ++r)
            offsets[r + 1] = offsets[r] + counts[r];
        const std::size_t total = offsets[ranks];
        CAPTURE(total, size, counts[0]);
        std::vector<std::vector<std::vector<double>>> got(ranks); // [rank][op or in place]
        group.run([&](nccl_communicator& comm) {
            const std::size_t r = static_cast<std::size_t>(comm.rank());
            const auto sys = comm.system();
            auto send = device_input<T>(comm.rank(), total, sys);
            for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
                buffer<T, cuda_system> recv(counts[r], sys);
                comm.reduce_scatter(send.span(), recv.span(), std::span<const std::size_t>(counts),
                                    op);
                comm.synchronize();
                got[r].push_back(to_values(recv));
            }
            auto inout = device_input<T>(comm.rank(), total, sys);
            comm.reduce_scatter(inout.span(), inout.span().subspan(offsets[r], counts[r]),
                                std::span<const std::size_t>(counts), reduce_op::sum);
            comm.synchronize();
            const std::vector<double> all = to_values(inout);
            got[r].emplace_back(all.begin() + static_cast<std::ptrdiff_t>(offsets[r]),
                                all.begin() + static_cast<std::ptrdiff_t>(offsets[r + 1]));
            if (std::all_of(counts.begin(), counts.end(),
                            [&](std::size_t c) { return c == counts[0]; })) {
                buffer<T, cuda_system> recv(counts[r], sys);
                comm.reduce_scatter(send.span(), recv.span(), reduce_op::max);
                comm.synchronize();
                got[r].push_back(to_values(recv));
            }
        });
        for (std::size_t r = 0; r < ranks; ++r) {
            REQUIRE(got[r].size() >= 4);
            for (std::size_t i = 0; i < counts[r]; ++i) {
                const std::size_t at = offsets[r] + i;
                double sum = 0, mx = input_value<T>(0, at), mn = mx;
                for (int q = 0; q < size; ++q) {
                    const double v = input_value<T>(q, at);
                    sum += v;
                    mx = std::max(mx, v);
                    mn = std::min(mn, v);
                }
                REQUIRE(got[r][0][i] == sum);
                REQUIRE(got[r][1][i] == mx);
                REQUIRE(got[r][2][i] == mn);
                REQUIRE(got[r][3][i] == sum); // in place
                if (got[r].size() == 5)
                    REQUIRE(got[r][4][i] == mx); // the equal-count form
            }
        }
    }
}

TEST_CASE("nccl reduce_scatter refuses counts that do not fit before NCCL is entered",
          "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const std::vector<int> one{0};
    auto comms = nccl_communicator::init_all(one);
    auto& comm = comms[0];
    buffer<float, cuda_system> send(4, comm.system()), recv(3, comm.system());
    const std::vector<std::size_t> counts{4};
    try {
        comm.reduce_scatter(send.span(), recv.span(), std::span<const std::size_t>(counts),
                            reduce_op::sum);
        FAIL("a receive span of 3 for a count of 4 was accepted");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::shape_mismatch);
        CHECK(std::string(e.what()).find("reduce_scatter #0") != std::string::npos);
    }
}

TEST_CASE("nccl split, point-to-point ring and barrier", "[comm][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group replicas;
    const int size = replicas.size();
    const auto count = static_cast<std::size_t>(size);
    const std::size_t n = 1031;
    std::vector<std::vector<double>> group_sum(count), from_left(count);
    std::vector<int> sub_rank(count), sub_size(count);
    std::vector<int> queued_after_barrier(count, -1); // sub's and comm's, summed
    const auto queued = [](const nccl_communicator& c) {
        int q = 0;
        for (const lockstep::flight_entry& e : c.trace().entries())
            q += e.state == lockstep::op_state::queued ? 1 : 0;
        return q;
    };
    replicas.run([&](nccl_communicator& comm) {
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
        // barrier() waits as synchronize() does: its recorder marks every operation done.
        const int sub_queued = queued(sub);
        {
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
        queued_after_barrier[i] = sub_queued + queued(comm);
    });
    REQUIRE(size >= 2);
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
        CHECK(queued_after_barrier[i] == 0);
        for (std::size_t k = 0; k < n; ++k) {
            double sum = 0;
            for (int q = r % 2; q < size; q += 2)
                sum += input_value<float>(q, k);
            REQUIRE(group_sum[i][k] == sum);
            REQUIRE(from_left[i][k] == input_value<double>((r + size - 1) % size, k));
        }
    }
}

TEST_CASE("a failing nccl replica releases its peers", "[comm][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    const auto count = static_cast<std::size_t>(group.size());
    REQUIRE(count >= 2);
    std::vector<lockstep::errc> codes(count, lockstep::errc::internal);
    std::vector<int> thrown(count, 0), aborted(count, 0);
    group.run([&](nccl_communicator& comm) {
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
        aborted[i] = comm.aborted() ? 1 : 0;
    });
    CHECK(thrown[0] == 1);
    CHECK(codes[0] == lockstep::errc::shape_mismatch);
    for (std::size_t r = 1; r < count; ++r) {
        CHECK(thrown[r] == 1);
        CHECK(codes[r] == lockstep::errc::peer_failure);
    }
    for (std::size_t r = 0; r < count; ++r)
        CHECK(aborted[r] == 1);
}

TEST_CASE("aborting one communicator of a replica aborts its splits and its parent",
          "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group(std::vector<int>{0});
    lockstep::cuda_stream side(0);
    // Recorded on the replica's thread, checked here (Catch2 assertions on the main thread only).
    struct first_run {
        bool compute_on_parent_stream = false, side_on_side_stream = false;
        bool compute_aborted = false, side_aborted = false, side_handle_null = false;
        lockstep::errc enqueue_code = lockstep::errc::internal; // errc::internal: none thrown
    } a;
    struct second_run {
        bool on_side_stream = false, sub_aborted = false, parent_aborted = false;
        lockstep::errc barrier_code = lockstep::errc::internal;
    } b;
    group.run([&](nccl_communicator& comm) {
        nccl_communicator on_compute = comm.split(0, comm.rank());
        nccl_communicator on_side = comm.split(0, comm.rank(), side.get());
        // A split runs on its parent's stream unless given another.
        a.compute_on_parent_stream = on_compute.system().stream() == comm.system().stream();
        a.side_on_side_stream = on_side.system().stream() == side.get();
        auto x = device_input<float>(0, 17, comm.system());
        on_side.all_reduce(x.span(), x.span(), reduce_op::sum);
        on_side.synchronize();

        comm.abort();
        a.compute_aborted = on_compute.aborted();
        a.side_aborted = on_side.aborted();
        a.side_handle_null = on_side.native_handle() == nullptr;
        a.enqueue_code = code_of([&] { on_side.all_reduce(x.span(), x.span(), reduce_op::sum); });
    });
    CHECK(a.compute_on_parent_stream);
    CHECK(a.side_on_side_stream);
    CHECK(a.compute_aborted);
    CHECK(a.side_aborted);
    CHECK(a.side_handle_null);
    // An all_reduce on a split of an aborted communicator is refused, not enqueued.
    CHECK(a.enqueue_code == lockstep::errc::communication);
    group.run([&](nccl_communicator& comm) {
        nccl_communicator sub = comm.split(0, comm.rank(), side.get());
        nccl_communicator subsub = sub.split(0, sub.rank());
        b.on_side_stream = subsub.system().stream() == side.get();
        subsub.abort(); // a split's abort reaches its parent and its parent's parent
        b.sub_aborted = sub.aborted();
        b.parent_aborted = comm.aborted();
        b.barrier_code = code_of([&] { comm.barrier(); });
    });
    CHECK(b.on_side_stream);
    CHECK(b.sub_aborted);
    CHECK(b.parent_aborted);
    CHECK(b.barrier_code == lockstep::errc::communication); // its own abort, not a peer's
    lockstep::cuda_device_guard guard(0);
    CHECK(cudaStreamQuery(side.get()) == cudaSuccess); // adopted, not destroyed
}

TEST_CASE("a failing nccl replica aborts the splits of every replica",
          "[comm][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    const auto count = static_cast<std::size_t>(group.size());
    REQUIRE(count >= 2);
    std::vector<int> split_aborted(count, 0);
    std::vector<lockstep::errc> codes(count, lockstep::errc::internal);
    group.run([&](nccl_communicator& comm) {
        const auto i = static_cast<std::size_t>(comm.rank());
        nccl_communicator sub = comm.split(0, comm.rank());
        buffer<float, cuda_system> a(64, comm.system()),
            b(comm.rank() == 0 ? 63 : 64, comm.system());
        try {
            comm.all_reduce(std::span<const float>(a.span()), b.span(), reduce_op::sum);
            comm.synchronize();
        } catch (const lockstep::error&) {
        }
        split_aborted[i] = sub.aborted() ? 1 : 0;
        try {
            sub.barrier();
        } catch (const lockstep::error& e) {
            codes[i] = e.code();
        }
    });
    CHECK(codes[0] == lockstep::errc::communication);
    for (std::size_t r = 0; r < count; ++r) {
        CHECK(split_aborted[r] == 1);
        if (r > 0)
            CHECK(codes[r] == lockstep::errc::peer_failure);
    }
}

TEST_CASE("the unique-id constructor leaves the replica's device current", "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    // The last device, made current after device 0 was: with one GPU both are device 0 and the
    // check only confirms the device (a guard restoring the previous device shows with two).
    const int device = lockstep::cuda_device_count() - 1;
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    nccl_communicator comm(id, 1, 0, device);
    int current = -1;
    REQUIRE(cudaGetDevice(&current) == cudaSuccess);
    CHECK(current == comm.device());
    CHECK(comm.device() == device);
    comm.barrier();
}

// Its own CTest test (test_nccl_init_timeout, hidden from the default run): the abandoned
// ncclCommInitRank stays on its helper thread, waiting for the rank that never comes, until the
// process ends.
TEST_CASE("joining by id fails with errc::timeout when a rank never joins",
          "[.][init_timeout][comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    const auto start = std::chrono::steady_clock::now();
    try {
        nccl_communicator comm(id, 2, 0, 0, {.timeout = std::chrono::milliseconds(1500)});
        FAIL("rank 0 of 2 was made without rank 1");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::timeout);
        CHECK_THAT(e.what(), Catch::Contains("ncclCommInitRank did not return within 1500 ms"));
    }
    // Bounded by the timeout, not by NCCL (which would wait for rank 1 forever).
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
}

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 26, 0),
              "lockstep needs NCCL 2.26 (NCCL_LAUNCH_ORDER_IMPLICIT)");

// The headers are checked when compiling; the library is checked when a communicator is made,
// since another libnccl.so.2 may be loaded at run time. Runs without a GPU (ncclGetVersion
// needs none).
TEST_CASE("an NCCL library older than 2.26 loaded at run time is refused, naming both versions",
          "[comm][nccl]") {
    using lockstep::detail::nccl_runtime_problem;
    CHECK(nccl_runtime_problem(NCCL_VERSION(2, 26, 0)).empty());
    CHECK(nccl_runtime_problem(NCCL_VERSION(2, 28, 9)).empty());
    const std::string old = nccl_runtime_problem(NCCL_VERSION(2, 21, 5));
    CHECK_THAT(old, Catch::Contains("version 2.21.5"));
    CHECK_THAT(old, Catch::Contains("lockstep needs 2.26.0 or newer"));
    CHECK_THAT(old, Catch::Contains("compiled against " + std::to_string(NCCL_MAJOR) + "." +
                                    std::to_string(NCCL_MINOR) + "."));
    CHECK_THAT(nccl_runtime_problem(0), Catch::Contains("of unknown version"));
    int loaded = 0;
    REQUIRE(ncclGetVersion(&loaded) == ncclSuccess);
    INFO("the NCCL library this test loaded: " << loaded);
    CHECK(lockstep::detail::loaded_nccl_problem() == nccl_runtime_problem(loaded));
    CHECK(lockstep::detail::loaded_nccl_problem().empty());
}

// nccl_communicator::shrink's ncclCommRevoke is looked up by name in the library loaded at run
// time, so a program built against 2.28's headers still loads with 2.26 or 2.27, where only a
// shrink is refused. Runs without a GPU (dlsym and ncclGetVersion need none).
TEST_CASE("ncclCommRevoke is found at run time in an NCCL 2.28.7 or newer", "[comm][nccl]") {
    const auto& api = lockstep::detail::nccl_fault_api::loaded();
    int loaded = 0;
    REQUIRE(ncclGetVersion(&loaded) == ncclSuccess);
    INFO("the NCCL library this test loaded: " << loaded);
    if (loaded >= NCCL_VERSION(2, 28, 7)) { // the first with ncclCommRevoke
        CHECK(api.revoke != nullptr);
        CHECK(api.problem().empty());
    } else {
        CHECK_THAT(api.problem(), Catch::Contains("2.28.7 or newer"));
    }
}

TEST_CASE("lockstep's communicators run with NCCL's implicit launch order; destroy_all ends "
          "init_all's ranks together",
          "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    std::vector<int> devices(static_cast<std::size_t>(lockstep::cuda_device_count()));
    std::iota(devices.begin(), devices.end(), 0);
    auto comms = nccl_communicator::init_all(devices);
    // Set before NCCL's first launch in this process (CTest starts the test without it).
    const char* order = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
    REQUIRE(order != nullptr);
    CHECK(std::string(order) == "1");
    nccl_communicator::destroy_all(comms);
    CHECK(comms.empty());
}

namespace {

/// The code each replica of `group` ends with when replica 0 passes host memory (a std::vector)
/// to an all_reduce and the others device memory; errc::internal where nothing was thrown.
std::vector<lockstep::errc> host_memory_codes(gpu_group& group) {
    std::vector<lockstep::errc> codes(static_cast<std::size_t>(group.size()),
                                      lockstep::errc::internal);
    group.run([&](nccl_communicator& comm) {
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
    return codes;
}

} // namespace

TEST_CASE("host memory passed to an nccl collective is rejected, not crashed on",
          "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group(std::vector<int>{0});
    CHECK(host_memory_codes(group) ==
          std::vector<lockstep::errc>{lockstep::errc::invalid_argument});
}

TEST_CASE("partially overlapping send and recv are refused before NCCL", "[comm][nccl][gpu]") {
    // NCCL's result is undefined for them; the in-place forms and disjoint spans pass.
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group(std::vector<int>{0}, {.timeout = std::chrono::seconds(60)});
    std::vector<std::string> refused;
    std::vector<int> accepted(3, 0);
    group.run([&](nccl_communicator& comm) {
        buffer<float, cuda_system> a(65, comm.system());
        const std::span<float> all = a.span();
        const auto message = [](auto&& call) {
            try {
                call();
            } catch (const lockstep::error& e) {
                return std::string(lockstep::to_string(e.code())) + ": " + e.what();
            }
            return std::string("accepted");
        };
        // One rank: in place and disjoint run, shifted by one element does not.
        accepted[0] = message([&] {
                          comm.all_reduce(std::span<const float>(all.first(32)), all.first(32),
                                          reduce_op::sum);
                          comm.all_gather(std::span<const float>(all.first(32)), all.first(32));
                          comm.reduce(std::span<const float>(all.first(32)), all.subspan(32, 32),
                                      reduce_op::sum, 0);
                          comm.synchronize();
                      }) == "accepted";
        // The first refusal aborts the communicator: one case per run.
        refused.push_back(message([&] {
            comm.all_reduce(std::span<const float>(all.first(64)), all.subspan(1, 64),
                            reduce_op::sum);
        }));
    });
    CHECK(accepted[0] == 1);
    REQUIRE(refused.size() == 1);
    CHECK(lockstep_test::contains(refused[0], "invalid_argument"));
    CHECK(lockstep_test::contains(refused[0], "send and recv overlap"));
}

TEST_CASE("a collective no peer matches fails gpu_group::run at teardown",
          "[comm][nccl][gpu][multi_gpu]") {
    // Replica 0 enqueues one all_reduce more than the others and returns: the streams never go
    // idle; the drain before destroy times out, and run() rethrows that instead of returning.
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group({.timeout = std::chrono::seconds(3)});
    try {
        group.run([&](nccl_communicator& comm) {
            buffer<float, cuda_system> a(16, comm.system());
            comm.all_reduce(std::span<const float>(a.span()), a.span(), reduce_op::sum);
            if (comm.rank() == 0)
                comm.all_reduce(std::span<const float>(a.span()), a.span(), reduce_op::sum);
        });
        FAIL("run() returned although replica 0's last all_reduce was never matched");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::timeout);
    }
}

TEST_CASE("host memory passed by one nccl replica fails its peers with errc::peer_failure",
          "[comm][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group;
    const std::vector<lockstep::errc> codes = host_memory_codes(group);
    REQUIRE(codes.size() >= 2);
    CHECK(codes[0] == lockstep::errc::invalid_argument);
    for (std::size_t r = 1; r < codes.size(); ++r)
        CHECK(codes[r] == lockstep::errc::peer_failure);
}

namespace {

static_assert(noexcept(std::declval<nccl_communicator&>().abort()), "abort() must never throw");

/// A CUDA event of one device, destroyed with the scope (tests only).
class test_event {
public:
    explicit test_event(int device) : device_(device) {
        lockstep::cuda_device_guard guard(device_);
        LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    }
    test_event(const test_event&) = delete;
    test_event& operator=(const test_event&) = delete;
    ~test_event() { (void)cudaEventDestroy(event_); }
    cudaEvent_t get() const noexcept { return event_; }
    void record(cudaStream_t stream) const {
        lockstep::cuda_device_guard guard(device_);
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(event_, stream));
    }

private:
    int device_;
    cudaEvent_t event_ = nullptr;
};

} // namespace

TEST_CASE("gpu_group rejects bad devices and parameters without touching NCCL", "[comm][nccl]") {
    const int available = lockstep::cuda_device_count();
    CHECK(code_of([] { gpu_group g(std::vector<int>{}); }) == lockstep::errc::invalid_argument);
    CHECK(code_of([&] { gpu_group g(std::vector<int>{available}); }) ==
          lockstep::errc::invalid_argument);
    CHECK(code_of([] { gpu_group g(std::vector<int>{0, 0}); }) == lockstep::errc::invalid_argument);
    CHECK(code_of([] { gpu_group g(std::vector<int>{-1}); }) == lockstep::errc::invalid_argument);
    if (available == 0) {
        CHECK(code_of([] { gpu_group g; }) == lockstep::errc::cuda);
    } else {
        CHECK(code_of([] { gpu_group g({.timeout = std::chrono::milliseconds(0)}); }) ==
              lockstep::errc::invalid_argument);
        const std::vector<cudaStream_t> too_many(static_cast<std::size_t>(available) + 1, nullptr);
        CHECK(code_of([&] { gpu_group g({.streams = too_many}); }) ==
              lockstep::errc::invalid_argument);
    }
}

TEST_CASE("gpu_group runs one replica per GPU on its device", "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group({.timeout = std::chrono::seconds(90)});
    REQUIRE(group.size() == lockstep::cuda_device_count());
    const auto count = static_cast<std::size_t>(group.size());
    const std::size_t n = 4099;
    std::vector<std::vector<double>> sums(count);
    std::vector<int> current(count, -1), device(count, -2), own_stream(count, 0);
    std::vector<long long> timeout_ms(count, 0);
    group.run([&](nccl_communicator& comm) {
        const auto i = static_cast<std::size_t>(comm.rank());
        LOCKSTEP_CUDA_CHECK(cudaGetDevice(&current[i]));
        device[i] = comm.device();
        own_stream[i] = comm.adopted_stream() ? 0 : 1;
        timeout_ms[i] = comm.options().timeout.count();
        auto x = device_input<float>(comm.rank(), n, comm.system());
        comm.all_reduce(x.span(), x.span(), reduce_op::sum);
        comm.synchronize();
        sums[i] = to_values(x);
    });
    for (std::size_t r = 0; r < count; ++r) {
        CHECK(device[r] == group.devices()[r]);
        CHECK(current[r] == device[r]);
        CHECK(own_stream[r] == 1);
        CHECK(timeout_ms[r] == 90000);
        REQUIRE(sums[r].size() == n);
        for (std::size_t i = 0; i < n; ++i) {
            double sum = 0;
            for (int q = 0; q < group.size(); ++q)
                sum += input_value<float>(q, i);
            REQUIRE(sums[r][i] == sum);
        }
    }
}

namespace {

/// What run_with_quitter saw: the quitter's rank, each replica's lockstep::error code
/// (errc::internal: none) and completed collectives, and what run() threw.
struct quit_outcome {
    int quitter = -1;
    std::vector<lockstep::errc> codes;
    std::vector<int> completed;
    bool returned = false;       ///< run() returned instead of throwing
    bool lockstep_error = false; ///< run() threw a lockstep::error (not the cause)
    std::string what;            ///< what run()'s exception says
};

/// Every replica of `group` runs all_reduces; after 3 the last replica throws a
/// std::runtime_error (after 200 ms, so the others are blocked in synchronize() (even ranks) or
/// wait() (odd ranks) for it).
quit_outcome run_with_quitter(gpu_group& group) {
    const auto count = static_cast<std::size_t>(group.size());
    quit_outcome out{.quitter = group.size() - 1,
                     .codes = std::vector<lockstep::errc>(count, lockstep::errc::internal),
                     .completed = std::vector<int>(count, 0)};
    try {
        group.run([&](nccl_communicator& comm) {
            const int r = comm.rank();
            const auto i = static_cast<std::size_t>(r);
            buffer<float, cuda_system> x(1024, comm.system());
            test_event done(comm.device());
            try {
                for (int step = 0; step < 1000; ++step) {
                    if (r == out.quitter && step == 3) {
                        std::this_thread::sleep_for(std::chrono::milliseconds(200));
                        throw std::runtime_error("replica " + std::to_string(r) + " gave up");
                    }
                    comm.all_reduce(x.span(), x.span(), reduce_op::sum);
                    if (r % 2 == 0) {
                        comm.synchronize();
                    } else {
                        done.record(comm.system().stream());
                        comm.wait(done.get(), "all_reduce done");
                    }
                    ++out.completed[i];
                }
            } catch (const lockstep::error& e) {
                out.codes[i] = e.code();
                throw;
            }
        });
        out.returned = true;
    } catch (const std::runtime_error& e) {
        out.lockstep_error = dynamic_cast<const lockstep::error*>(&e) != nullptr;
        out.what = e.what();
    }
    return out;
}

/// run() rethrew the quitter's own exception, after its 3 collectives.
void check_cause_rethrown(const quit_outcome& out) {
    CHECK_FALSE(out.returned);
    CHECK_FALSE(out.lockstep_error);
    CHECK(out.what == "replica " + std::to_string(out.quitter) + " gave up");
    CHECK(out.completed[static_cast<std::size_t>(out.quitter)] == 3);
}

} // namespace

TEST_CASE("a gpu_group replica that throws mid-run makes run() rethrow the cause",
          "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    gpu_group group(std::vector<int>{0}, {.timeout = std::chrono::seconds(60)});
    check_cause_rethrown(run_with_quitter(group));
}

TEST_CASE("a gpu_group replica that throws mid-run fails every replica; run() rethrows the cause",
          "[comm][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    gpu_group group({.timeout = std::chrono::seconds(60)});
    const quit_outcome out = run_with_quitter(group);
    REQUIRE(group.size() >= 2);
    check_cause_rethrown(out);
    for (int r = 0; r < group.size(); ++r) {
        if (r == out.quitter)
            continue;
        CAPTURE(r);
        CHECK(out.codes[static_cast<std::size_t>(r)] == lockstep::errc::peer_failure);
        CHECK(out.completed[static_cast<std::size_t>(r)] >= 3);
    }
}

TEST_CASE("nccl communicators adopt the caller's streams and never destroy them",
          "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const int devices = lockstep::cuda_device_count();
    std::vector<lockstep::cuda_stream> owned;
    std::vector<cudaStream_t> streams;
    for (int d = 0; d < devices; ++d) {
        owned.emplace_back(d);
        streams.push_back(owned.back().get());
    }
    const auto count = static_cast<std::size_t>(devices);
    const std::size_t n = 333;
    std::vector<int> adopted(count, 0), same_stream(count, 0);
    std::vector<std::vector<double>> sums(count);
    gpu_group group({.streams = streams});
    group.run([&](nccl_communicator& comm) {
        const auto i = static_cast<std::size_t>(comm.rank());
        adopted[i] = comm.adopted_stream() ? 1 : 0;
        same_stream[i] = comm.system().stream() == streams[i] ? 1 : 0;
        auto x = device_input<double>(comm.rank(), n, comm.system());
        comm.all_reduce(x.span(), x.span(), reduce_op::sum);
        test_event reduced(comm.device());
        reduced.record(streams[i]); // the caller's stream orders the collective
        comm.wait(reduced.get(), "reduced");
        sums[i] = to_values(x);
    });
    for (std::size_t r = 0; r < count; ++r) {
        CHECK(adopted[r] == 1);
        CHECK(same_stream[r] == 1);
        REQUIRE(sums[r].size() == n);
        for (std::size_t i = 0; i < n; ++i) {
            double sum = 0;
            for (int q = 0; q < devices; ++q)
                sum += input_value<double>(q, i);
            REQUIRE(sums[r][i] == sum);
        }
        // The communicators are gone; the adopted streams still work.
        lockstep::cuda_device_guard guard(static_cast<int>(r));
        CHECK(cudaStreamQuery(streams[r]) == cudaSuccess);
    }
}

TEST_CASE("a null stream is refused before NCCL", "[comm][nccl][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const std::vector<int> zero{0};
    const std::vector<cudaStream_t> null_stream{nullptr};
    try {
        (void)nccl_communicator::init_all(zero, {}, null_stream);
        FAIL("a null stream was adopted");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::invalid_argument);
    }
}

TEST_CASE("a stream of another device is refused before NCCL", "[comm][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    const std::vector<int> zero{0};
    lockstep::cuda_stream on_device_1(1);
    const std::vector<cudaStream_t> wrong{on_device_1.get()};
    try {
        (void)nccl_communicator::init_all(zero, {}, wrong);
        FAIL("a stream of device 1 was adopted for device 0");
    } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::invalid_argument);
        CHECK(e.replica() == 0);
        const std::string what = e.what();
        CHECK(what.find("device 1") != std::string::npos);
        CHECK(what.find("device 0") != std::string::npos);
    }
}

// The device timing behind report_stragglers_every (stream_gap_timer): the gap between two
// collectives is the stream's time between them, here a 20 ms delay kernel, within 20 % (and
// at least the delay: the kernel ends no earlier); collectives enqueued while the stream is
// captured into a CUDA graph add no gap; off, nothing is timed.
TEST_CASE("nccl_communicator times its stream between collectives on the device",
          "[comm][nccl][gpu][straggler]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const int device[] = {0};
    auto comms = nccl_communicator::init_all(device);
    nccl_communicator& comm = comms[0];
    buffer<float, cuda_system> x(1, comm.system());
    const auto reduce = [&] {
        comm.all_reduce(std::span<const float>(x.span()), x.span(), reduce_op::sum);
    };
    constexpr std::chrono::milliseconds delay{20};
    reduce();
    lockstep_test::device_delay(comm.system().stream(), delay);
    reduce();
    comm.synchronize();
    CHECK(comm.device_between_ns() == 0); // off
    comm.time_between_on_device();
    reduce();
    lockstep_test::device_delay(comm.system().stream(), delay);
    reduce();
    comm.synchronize();
    const std::int64_t one = comm.device_between_ns();
    CHECK(one >= std::chrono::nanoseconds(delay).count());
    CHECK(static_cast<double>(one) == Approx(1e6 * delay.count()).epsilon(0.2));
    // Captured: no event is recorded, so the delay between the captured collectives is no gap.
    const cudaStream_t stream = comm.system().stream();
    LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    reduce();
    lockstep_test::device_delay(stream, delay);
    reduce();
    cudaGraph_t graph = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    LOCKSTEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    comm.synchronize();
    CHECK(comm.device_between_ns() == one);
    LOCKSTEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
    LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
    // After the capture, the next pair is timed again.
    reduce();
    lockstep_test::device_delay(stream, delay);
    reduce();
    comm.synchronize();
    CHECK(static_cast<double>(comm.device_between_ns() - one) ==
          Approx(1e6 * delay.count()).epsilon(0.2));
}

// nccl_communicator with one process per rank (the rank launcher, run with --ranks 2 and 3; on one
// GPU the ranks are separate NCCL hosts over its socket transport): the collective suite on every
// element type, 16-bit floats, uneven reduce_scatter and all_to_all included, in NCCL's fold
// order; point-to-point; splits onto a side stream. Every case needs a GPU (tagged [gpu]).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "comm/collective_suite.hpp"
#include "nccl_rank_support.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace {

using namespace lockstep;
using lockstep::testing::suite_options;
using lockstep::testing::suite_report;
using lockstep_test::nccl_ranks::aborting_on_failure;
using lockstep_test::nccl_ranks::rank_communicator;

/// NCCL reduces in its own order (ring or tree over the ranks): float sums are checked within
/// the suite's any-order bound ((n - 1) eps sum |x|), 16-bit sums within float16_bound's
/// (n roundings to 16 bits: NCCL rounds after every addition); integers, max, min and copies
/// exactly; every reduction's bits equal on every rank (the suite hashes them across ranks).
/// Small counts: a collective costs milliseconds between processes sharing one GPU.
constexpr suite_options nccl_order{.rank_order_sums = false,
                                   .large_count = 4099,
                                   .medium_count = 1009,
                                   .rank_order_float16 = false};

suite_report new_report(const nccl_communicator& comm) {
    suite_report rep;
    rep.rank = comm.rank();
    rep.size = comm.size();
    return rep;
}

void require_passed(const suite_report& rep, std::size_t min_checks) {
    INFO(rep.text());
    CHECK(rep.failed == 0);
    CHECK(rep.checks >= min_checks);
}

} // namespace

TEMPLATE_TEST_CASE("NCCL ranks: the collective suite for one element type in NCCL's fold order",
                   "[comm][nccl][ranks][gpu]", float, double, int, std::int64_t, std::uint8_t) {
    auto comm = rank_communicator();
    suite_report rep = new_report(comm);
    aborting_on_failure(comm, [&] {
        lockstep::testing::check_barrier(comm, rep);
        // all_reduce, broadcast and reduce from every root, all_gather, reduce_scatter over
        // every layout of scatter_layouts (uneven, zero counts, in place), all_to_all.
        lockstep::testing::check_type<TestType>(comm, rep, nccl_order, true);
    });
    require_passed(rep, 50);
}

TEMPLATE_TEST_CASE("NCCL ranks: half and bfloat16 collectives within NCCL's 16-bit rounding, the "
                   "same bits on every rank",
                   "[comm][nccl][ranks][gpu]", lockstep::half, lockstep::bfloat16) {
    auto comm = rank_communicator();
    suite_report rep = new_report(comm);
    aborting_on_failure(comm,
                        [&] { lockstep::testing::check_float16<TestType>(comm, rep, nccl_order); });
    require_passed(rep, 20);
}

TEST_CASE("NCCL ranks: the suite's split into even and odd ranks, and a barrier",
          "[comm][nccl][ranks][gpu]") {
    auto comm = rank_communicator();
    suite_report rep = new_report(comm);
    aborting_on_failure(comm, [&] {
        lockstep::testing::check_split(comm, rep, nccl_order);
        lockstep::testing::check_barrier(comm, rep);
    });
    require_passed(rep, 10);
}

// Values are exact copies: compared bit for bit with what the sender made.
TEST_CASE("NCCL ranks: send and recv around a ring, several messages in order",
          "[comm][nccl][ranks][gpu]") {
    auto comm = rank_communicator();
    const int n = comm.size(), me = comm.rank();
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    constexpr std::size_t count = 1031;
    constexpr int messages = 3;
    const auto payload = [&](int from, int k) {
        std::vector<double> v(count);
        for (std::size_t i = 0; i < count; ++i)
            v[i] = lockstep::testing::input_value<double>(from * 8 + k, i);
        return v;
    };
    std::vector<std::vector<double>> got;
    aborting_on_failure(comm, [&] {
        const cuda_system sys = comm.system();
        std::vector<buffer<double, cuda_system>> out, in;
        for (int k = 0; k < messages; ++k) {
            out.push_back(lockstep::testing::to_system(comm, payload(me, k)));
            in.emplace_back(count, sys);
        }
        {
            // One rank's sends and receives must not serialise against its peer's.
            nccl_group group;
            for (int k = 0; k < messages; ++k) {
                comm.send(std::span<const double>(out[k].span()), next);
                comm.recv(in[k].span(), prev);
            }
            group.end();
        }
        comm.synchronize();
        for (int k = 0; k < messages; ++k)
            got.push_back(lockstep::testing::to_host(in[k]));
        comm.barrier();
    });
    for (int k = 0; k < messages; ++k) {
        INFO("message " << k << " from rank " << prev);
        CHECK(got[static_cast<std::size_t>(k)] == payload(prev, k));
    }
}

// A split onto a side stream runs its collectives there, ordered with nothing on the parent's
// stream: all ranks in one group with reversed keys, and even/odd groups; the parent keeps
// working between them. Tolerances as in the suite cases above.
TEST_CASE("NCCL ranks: splits onto a side stream run the suite's collectives there",
          "[comm][nccl][ranks][gpu]") {
    auto comm = rank_communicator();
    const int n = comm.size(), me = comm.rank();
    suite_report rep = new_report(comm);
    int all_rank = -1, all_size = -1, half_rank = -1, half_size = -1;
    bool on_side = false;
    aborting_on_failure(comm, [&] {
        // Declared before the splits: an adopted stream must outlive them.
        cuda_stream side(comm.device());
        nccl_communicator all = comm.split(0, n - me, side.get());
        nccl_communicator half = comm.split(me % 2, me, side.get());
        all_rank = all.rank();
        all_size = all.size();
        half_rank = half.rank();
        half_size = half.size();
        on_side = all.system().stream() == side.get() && half.system().stream() == side.get();

        suite_report all_rep = new_report(all);
        lockstep::testing::check_all_reduce<float>(all, all_rep, {1, 1009}, nccl_order);
        lockstep::testing::check_all_reduce<float>(comm, rep, {1009}, nccl_order); // the parent
        lockstep::testing::check_reduce_scatter<float>(all, all_rep, nccl_order, 1009);
        lockstep::testing::check_all_to_all<int>(all, all_rep, {1, 257});
        lockstep::testing::check_broadcast<double>(all, all_rep, {1009});
        suite_report half_rep = new_report(half);
        lockstep::testing::check_all_reduce<float>(half, half_rep, {1009}, nccl_order);
        lockstep::testing::check_all_gather<int>(half, half_rep, {1009});
        all.synchronize();
        half.synchronize();
        comm.barrier();
        for (auto& f : all_rep.failures)
            f = "split(0) on the side stream: " + f;
        for (auto& f : half_rep.failures)
            f = "split(" + std::to_string(me % 2) + ") on the side stream: " + f;
        rep.merge(all_rep);
        rep.merge(half_rep);
    });
    CHECK(on_side);
    CHECK(all_size == n);
    CHECK(all_rank == n - 1 - me); // keys n - rank: reversed
    int members = 0, before = 0;
    for (int r = me % 2; r < n; r += 2) {
        ++members;
        before += r < me ? 1 : 0;
    }
    CHECK(half_size == members);
    CHECK(half_rank == before);
    require_passed(rep, 10);
}

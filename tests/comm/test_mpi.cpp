// Tests of mpi_communicator under mpiexec (CTest runs them with 2 and 3 ranks), with its own
// Catch2 main. SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "collective_suite.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/thread_group.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

using lockstep::errc;
using lockstep::mpi_communicator;
using lockstep::reduce_op;

namespace {

// Counts: empty, one, a prime, and one above MPICH's eager limit (rendezvous protocol).
const std::vector<std::size_t> message_counts{0, 1, 7919, (1u << 18) + 3};
constexpr reduce_op ops[] = {reduce_op::sum, reduce_op::max, reduce_op::min};

// Inputs differ per rank and element. Floating values are multiples of 1/4 below 2^6 and
// integers are small (int64 ones are offset by 2^33 to use the upper half), so every partial
// sum is exact and the reference does not depend on the order MPI reduces in; uint8 sums wrap
// modulo 256 in every order alike, and half of them are above 127 (MPICH 4.0.2 compares
// unsigned types as signed in MPI_MAX/MPI_MIN; lockstep works around it).
template <class T>
T input(int rank, std::size_t i) {
    const auto v = static_cast<std::int64_t>((std::size_t(rank) * 131 + i * 29 + i / 7) % 97) - 48;
    if constexpr (std::is_floating_point_v<T>)
        return static_cast<T>(v) * T(0.25);
    else if constexpr (std::is_same_v<T, std::uint8_t>)
        return static_cast<T>((v + 256) % 256);
    else if constexpr (sizeof(T) == 8)
        return static_cast<T>(v + (std::int64_t{rank} << 33));
    else
        return static_cast<T>(v);
}

template <class T>
std::vector<T> inputs(int rank, std::size_t n) {
    std::vector<T> x(n);
    for (std::size_t i = 0; i < n; ++i)
        x[i] = input<T>(rank, i);
    return x;
}

// The serial reference: a naive loop over the replicas (double for floating types, the
// element type's own wrap-around for uint8).
template <class T>
std::vector<T> reference(reduce_op op, int ranks, std::size_t n) {
    using acc_t = std::conditional_t<std::is_floating_point_v<T>, double, T>;
    std::vector<T> out(n);
    for (std::size_t i = 0; i < n; ++i) {
        acc_t acc = input<T>(0, i);
        for (int r = 1; r < ranks; ++r) {
            const acc_t x = input<T>(r, i);
            acc = op == reduce_op::sum   ? static_cast<acc_t>(acc + x)
                  : op == reduce_op::max ? std::max(acc, x)
                                         : std::min(acc, x);
        }
        out[i] = static_cast<T>(acc);
    }
    return out;
}

// "" when a and b are equal, else the first differing element (a short message even for
// vectors of 2^18 elements, which Catch would print in full).
template <class T>
std::string differences(const std::vector<T>& a, const std::vector<T>& b) {
    if (a.size() != b.size())
        return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
    for (std::size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
            return "element " + std::to_string(i) + " of " + std::to_string(a.size()) + ": " +
                   std::to_string(+a[i]) + " vs " + std::to_string(+b[i]);
    return "";
}

// True when the bytes of x are identical on every process of `group` (a raw MPI_Allgather of a
// 64-bit FNV-1a hash, independent of the communicator under test).
template <class T>
bool same_on_every_rank(const std::vector<T>& x, MPI_Comm group) {
    std::uint64_t h = 1469598103934665603ull;
    const auto* p = reinterpret_cast<const unsigned char*>(x.data());
    for (std::size_t i = 0; i < x.size() * sizeof(T); ++i)
        h = (h ^ p[i]) * 1099511628211ull;
    int n = 0;
    MPI_Comm_size(group, &n);
    std::vector<std::uint64_t> all(static_cast<std::size_t>(n));
    MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, group);
    return std::all_of(all.begin(), all.end(), [&](std::uint64_t v) { return v == h; });
}

// Runs a test body that calls collectives. An unexpected exception (or a failed REQUIRE) on one
// rank would leave the others waiting in their next collective, so it ends the whole job with
// the error printed instead; CHECKs record failures and keep every rank in step.
template <class F>
void in_step(mpi_communicator& comm, F&& body) {
    try {
        body();
    } catch (const std::exception& e) {
        comm.abort(e);
    } catch (...) {
        std::fprintf(stderr, "replica %d: a REQUIRE failed; ending the job\n", comm.rank());
        comm.abort(2);
    }
}

template <class F>
errc code_of(F&& f) {
    try {
        f();
    } catch (const lockstep::error& e) {
        UNSCOPED_INFO(e.what());
        return e.code();
    }
    return errc::internal; // "did not throw"
}

} // namespace

TEST_CASE("mpi_communicator passes the collective suite", "[comm][mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    lockstep::testing::suite_report rep;
    // MPI reduces in an order of its choosing, so float sums are checked within the bound of
    // any summation order (collective_suite.hpp, reduction_matches); the rest is exact, and
    // half/bfloat16 sums (folded by lockstep in rank order) are the rank-order reference's bits.
    in_step(comm, [&] {
        rep = lockstep::testing::run_collective_suite(comm, {.rank_order_sums = false});
    });
    INFO(rep.text());
    CHECK(rep.failed == 0);
    CHECK(rep.checks > 200); // the whole suite ran
}

TEST_CASE("exact reductions above the eager limit, in place at the root and in all_gather",
          "[comm][mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    const int p = comm.size();
    const std::size_t n = message_counts.back();
    in_step(comm, [&] {
        for (const reduce_op op : ops) {
            INFO(to_string(op));
            // uint8 max/min go through lockstep's own MPI operator (MPICH bug workaround).
            auto bytes = inputs<std::uint8_t>(comm.rank(), n);
            comm.all_reduce(std::span<const std::uint8_t>(bytes), std::span<std::uint8_t>(bytes),
                            op);
            CHECK(differences(bytes, reference<std::uint8_t>(op, p, n)).empty());
            const auto send = inputs<float>(comm.rank(), n);
            std::vector<float> recv(n);
            comm.all_reduce(std::span<const float>(send), std::span<float>(recv), op);
            CHECK(differences(recv, reference<float>(op, p, n)).empty());
            CHECK(same_on_every_rank(recv, MPI_COMM_WORLD));
        }
        for (int root = 0; root < p; ++root) {
            auto data = inputs<double>(comm.rank(), n);
            comm.reduce(std::span<const double>(data), std::span<double>(data), reduce_op::sum,
                        root);
            if (comm.rank() == root)
                CHECK(differences(data, reference<double>(reduce_op::sum, p, n)).empty());
            else // a non-root's buffer is its send buffer: untouched
                CHECK(differences(data, inputs<double>(comm.rank(), n)).empty());
        }
        // In place: this rank's input already sits in its own slot.
        const auto mine = inputs<std::int64_t>(comm.rank(), n);
        std::vector<std::int64_t> slots(n * p, 3), expected;
        std::copy(mine.begin(), mine.end(), slots.begin() + comm.rank() * n);
        comm.all_gather(std::span<const std::int64_t>(slots.data() + comm.rank() * n, n),
                        std::span<std::int64_t>(slots));
        for (int r = 0; r < p; ++r) {
            const auto x = inputs<std::int64_t>(r, n);
            expected.insert(expected.end(), x.begin(), x.end());
        }
        CHECK(differences(slots, expected).empty());
    });
}

TEST_CASE("thread_group and mpi_communicator agree on the same inputs", "[comm][mpi][thread]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    const int p = comm.size(), r = comm.rank();
    const std::size_t n = 4099;
    using lockstep::testing::input_value;
    in_step(comm, [&] {
        for (const reduce_op op : ops) {
            INFO(to_string(op));
            // The same replicas' inputs, reduced by MPI across processes and by p threads here.
            std::vector<float> f(n), f_threads(n);
            std::vector<int> k(n), k_threads(n);
            for (std::size_t i = 0; i < n; ++i) {
                f[i] = input_value<float>(r, i);
                k[i] = input_value<int>(r, i);
            }
            comm.all_reduce(std::span<const float>(f), std::span<float>(f), op);
            comm.all_reduce(std::span<const int>(k), std::span<int>(k), op);
            lockstep::thread_group group(p);
            group.run([&](lockstep::thread_communicator& t) {
                std::vector<float> tf(n);
                std::vector<int> tk(n);
                for (std::size_t i = 0; i < n; ++i) {
                    tf[i] = input_value<float>(t.rank(), i);
                    tk[i] = input_value<int>(t.rank(), i);
                }
                t.all_reduce(std::span<const float>(tf), std::span<float>(tf), op);
                t.all_reduce(std::span<const int>(tk), std::span<int>(tk), op);
                if (t.rank() == r) {
                    f_threads = tf;
                    k_threads = tk;
                }
            });
            CHECK(differences(k, k_threads).empty());
            // Max, min and any sum of two floats have one correctly rounded result; sums of
            // more replicas depend on the order, within the bound of reduction_matches.
            if (op != reduce_op::sum || p == 2) {
                CHECK(differences(f, f_threads).empty());
            } else {
                std::size_t outside = 0;
                for (std::size_t i = 0; i < n; ++i)
                    outside += !lockstep::testing::reduction_matches(f[i], f_threads[i], p, i, op,
                                                                     {.rank_order_sums = false});
                CHECK(outside == 0);
            }
        }
    });
}

TEST_CASE("split builds sub-groups ranked by key", "[comm][mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    in_step(comm, [&] {
        const int p = comm.size(), r = comm.rank();
        // Colour by parity, keys reversed: the highest world rank of a colour gets sub-rank 0.
        mpi_communicator sub = comm.split(r % 2, -r);
        std::vector<int> members;
        for (int q = 0; q < p; ++q)
            if (q % 2 == r % 2)
                members.push_back(q);
        std::reverse(members.begin(), members.end());
        CHECK(sub.size() == static_cast<int>(members.size()));
        CHECK(members[static_cast<std::size_t>(sub.rank())] == r);
        CHECK(sub.system().threads() == comm.system().threads());

        std::vector<double> x{double(r), 1.0}, sum(2);
        sub.all_reduce(std::span<const double>(x), std::span<double>(sum), reduce_op::sum);
        double expected = 0;
        for (int q : members)
            expected += q;
        CHECK(sum == std::vector<double>{expected, double(members.size())});
        int root_value = r;
        sub.broadcast(std::span<int>(&root_value, 1), 0);
        CHECK(root_value == members.front());

        // The parent still works after the split, and a moved communicator keeps working.
        mpi_communicator moved = std::move(sub);
        // NOLINTBEGIN(bugprone-use-after-move): the moved-from communicator is checked
        CHECK(sub.native() == MPI_COMM_NULL);
        CHECK(code_of([&] { sub.barrier(); }) == errc::invalid_argument);
        // NOLINTEND(bugprone-use-after-move)
        moved.barrier();
        comm.barrier();

        // A split's errors name it: their ranks are the split's, not the parent's.
        mpi_communicator all = comm.split(0, -r);
        std::vector<float> y(static_cast<std::size_t>(10 + r), 1.0f);
        try {
            all.all_reduce(std::span<const float>(y), std::span<float>(y), reduce_op::sum);
            FAIL_CHECK("mismatched counts did not throw");
        } catch (const lockstep::error& e) {
            INFO(e.what());
            CHECK(e.code() == errc::count_mismatch);
            CHECK(std::string(e.what()).find("replica " + std::to_string(p - 1 - r) +
                                             ": all_reduce #1 in split(color=0)") !=
                  std::string::npos);
        }
        mpi_communicator nested = all.split(1, 0);
        CHECK(code_of([&] {
                  nested.all_reduce(std::span<const float>(y), std::span<float>(y), reduce_op::sum);
              }) == errc::count_mismatch);
        try {
            nested.all_reduce(std::span<const float>(y), std::span<float>(y), reduce_op::sum);
        } catch (const lockstep::error& e) {
            CHECK(std::string(e.what()).find(" in split(color=0) / split(color=1)") !=
                  std::string::npos);
        }
    });
}

TEST_CASE("send/recv ring, recv_any and a wrongly sized message", "[comm][mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    in_step(comm, [&] {
        const int p = comm.size(), r = comm.rank();
        const int next = (r + 1) % p, prev = (r + p - 1) % p;
        for (const std::size_t n : message_counts) {
            // Even ranks send first, odd ranks receive first: no cycle of blocked senders even
            // when the message is too large to be buffered.
            const auto mine = inputs<float>(r, n);
            std::vector<float> got(n, -1.0f);
            if (r % 2 == 0) {
                comm.send(std::span<const float>(mine), next, 11);
                comm.recv(std::span<float>(got), prev, 11);
            } else {
                comm.recv(std::span<float>(got), prev, 11);
                comm.send(std::span<const float>(mine), next, 11);
            }
            CHECK(differences(got, inputs<float>(prev, n)).empty());
        }

        // Every other rank sends its inputs to rank 0, which takes them in arrival order.
        if (r != 0) {
            const auto mine = inputs<std::int64_t>(r, 5);
            comm.send(std::span<const std::int64_t>(mine), 0, 12);
        } else {
            std::set<int> sources;
            for (int k = 1; k < p; ++k) {
                std::vector<std::int64_t> got(5);
                const int s = comm.recv_any(std::span<std::int64_t>(got), 12);
                CHECK(got == inputs<std::int64_t>(s, 5));
                sources.insert(s);
            }
            CHECK(sources.size() == static_cast<std::size_t>(p - 1));
            CHECK(*sources.begin() == 1);
        }

        // A message of the wrong size is an error naming both counts; it is consumed, so the
        // next message arrives intact. A message of another element type is refused the same
        // way, also when its bytes would fill the buffer (3 ints into 3 floats), and the
        // buffer is not written.
        if (r == 0) {
            const std::vector<int> five{1, 2, 3, 4, 5}, three{7, 8, 9};
            const std::vector<std::uint8_t> odd_bytes{1, 2, 3};
            comm.send(std::span<const int>(five), 1, 13);
            comm.send(std::span<const std::uint8_t>(odd_bytes), 1, 13);
            comm.send(std::span<const int>(three), 1, 13);
            comm.send(std::span<const int>(three), 1, 13);
        } else if (r == 1) {
            std::vector<int> four(4);
            CHECK(code_of([&] { comm.recv(std::span<int>(four), 0, 13); }) == errc::count_mismatch);
            CHECK(code_of([&] { comm.recv_any(std::span<int>(four), 13); }) ==
                  errc::shape_mismatch);
            std::vector<float> as_floats{-1.0f, -1.0f, -1.0f};
            std::string what;
            try {
                comm.recv(std::span<float>(as_floats), 0, 13);
            } catch (const lockstep::error& e) {
                CHECK(e.code() == errc::shape_mismatch);
                what = e.what();
            }
            CHECK_THAT(what, Catch::Contains("holds 3 int elements (12 bytes) but the receive "
                                             "buffer holds 3 float elements; the message was "
                                             "discarded"));
            CHECK(as_floats == std::vector<float>{-1.0f, -1.0f, -1.0f});
            std::vector<int> three(3);
            comm.recv(std::span<int>(three), 0, 13);
            CHECK(three == std::vector<int>{7, 8, 9});
        }
        CHECK(code_of([&] { comm.send(std::span<const int>(), p, 0); }) == errc::invalid_argument);
        CHECK(code_of([&] { comm.send(std::span<const int>(), 0, -1); }) == errc::invalid_argument);
        comm.barrier();
    });
}

TEST_CASE("replicas that disagree get an error on every rank, then continue",
          "[comm][mpi][failure]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    in_step(comm, [&] {
        const int p = comm.size(), r = comm.rank();
        // Different counts: count_mismatch on every rank, naming the collective, its sequence
        // number and the smallest and largest count.
        std::vector<float> x(static_cast<std::size_t>(10 + r), 1.0f);
        try {
            comm.all_reduce(std::span<const float>(x), std::span<float>(x), reduce_op::sum);
            FAIL_CHECK("mismatched counts did not throw");
        } catch (const lockstep::error& e) {
            const std::string what = e.what();
            INFO(what);
            CHECK(e.code() == errc::count_mismatch);
            CHECK(e.replica() == r);
            CHECK(what.find("all_reduce #" + std::to_string(comm.sequence())) != std::string::npos);
            CHECK(what.find("min 10, max " + std::to_string(9 + p)) != std::string::npos);
        }
        std::vector<int> y(static_cast<std::size_t>(r == 0 ? 3 : 4));
        CHECK(code_of([&] { comm.broadcast(std::span<int>(y), 0); }) == errc::count_mismatch);
        std::vector<int> gathered(y.size() * static_cast<std::size_t>(p));
        CHECK(code_of([&] {
                  comm.all_gather(std::span<const int>(y), std::span<int>(gathered));
              }) == errc::count_mismatch);
        // Types, roots and reductions must agree too.
        std::vector<double> d(4, 1.0);
        std::vector<float> f(4, 1.0f);
        CHECK(code_of([&] {
                  if (r == 0)
                      comm.broadcast(std::span<double>(d), 0);
                  else
                      comm.broadcast(std::span<float>(f), 0);
              }) == errc::shape_mismatch);
        CHECK(code_of([&] { comm.broadcast(std::span<float>(f), r == 0 ? 0 : 1); }) ==
              errc::invalid_argument);
        CHECK(code_of([&] {
                  comm.all_reduce(std::span<const float>(f), std::span<float>(f),
                                  r == 0 ? reduce_op::max : reduce_op::min);
              }) == errc::invalid_argument);
        // Different collectives: shape_mismatch, the thread group's code for the same mistake.
        CHECK(code_of([&] {
                  if (r == 0)
                      comm.barrier();
                  else
                      comm.broadcast(std::span<float>(f), 0);
              }) == errc::shape_mismatch);
        // One replica's own arguments are invalid: it reports them, the others are released.
        std::vector<float> small(r == 0 ? 3 : 4);
        CHECK(code_of([&] {
                  comm.all_reduce(std::span<const float>(f), std::span<float>(small),
                                  reduce_op::sum);
              }) == (r == 0 ? errc::invalid_argument : errc::peer_failure));

        // all_to_all: unequal counts, a count that is not whole blocks, and one replica's
        // overlapping spans (it reports them, the others are released).
        std::vector<int> blocks(static_cast<std::size_t>(p * (r == 0 ? 2 : 3)));
        std::vector<int> received(blocks.size());
        CHECK(code_of([&] {
                  comm.all_to_all(std::span<const int>(blocks), std::span<int>(received));
              }) == errc::count_mismatch);
        std::vector<int> uneven(static_cast<std::size_t>(p + 1)), uneven_out(uneven.size());
        CHECK(code_of([&] {
                  comm.all_to_all(std::span<const int>(uneven), std::span<int>(uneven_out));
              }) == errc::invalid_argument);
        std::vector<int> even(static_cast<std::size_t>(2 * p)), even_out(even.size());
        CHECK(code_of([&] {
                  comm.all_to_all(std::span<const int>(even),
                                  r == 0 ? std::span<int>(even) : std::span<int>(even_out));
              }) == (r == 0 ? errc::invalid_argument : errc::peer_failure));
        // all_to_all on replica 0, all_to_all_others on the others: verification tells them
        // apart before any data moves.
        CHECK(code_of([&] {
                  if (r == 0)
                      comm.all_to_all(std::span<const int>(even), std::span<int>(even_out));
                  else
                      comm.all_to_all_others(std::span<const int>(even), std::span<int>(even_out));
              }) == errc::shape_mismatch);

        // reduce_scatter: equal totals but different per-rank counts (caught by the counts'
        // hash), and one replica's counts that do not sum to its send size.
        const std::size_t ranks = static_cast<std::size_t>(p);
        std::vector<float> scatter_in(2 * ranks, 1.0f);
        std::vector<std::size_t> counts(ranks, 2);
        if (r == 0) {
            counts[0] = 1;
            counts[ranks - 1] += 1;
        }
        std::vector<float> scatter_out(counts[static_cast<std::size_t>(r)]);
        try {
            comm.reduce_scatter(std::span<const float>(scatter_in), std::span<float>(scatter_out),
                                std::span<const std::size_t>(counts), reduce_op::sum);
            FAIL_CHECK("mismatched per-rank counts did not throw");
        } catch (const lockstep::error& e) {
            const std::string what = e.what();
            INFO(what);
            CHECK(e.code() == errc::count_mismatch);
            CHECK(what.find("reduce_scatter #" + std::to_string(comm.sequence())) !=
                  std::string::npos);
            CHECK(what.find("different per-rank counts") != std::string::npos);
        }
        std::vector<std::size_t> short_counts(ranks, r == 0 ? 1 : 2);
        std::vector<float> two(2);
        CHECK(code_of([&] {
                  comm.reduce_scatter(std::span<const float>(scatter_in),
                                      std::span<float>(two).first(short_counts[0]),
                                      std::span<const std::size_t>(short_counts), reduce_op::sum);
              }) == (r == 0 ? errc::invalid_argument : errc::peer_failure));
        CHECK(code_of([&] {
                  comm.reduce_scatter(std::span<const float>(scatter_in),
                                      std::span<float>(two).first(r == 0 ? 1 : 2), reduce_op::max);
              }) == (r == 0 ? errc::invalid_argument : errc::peer_failure));

        // The communicator is still in step afterwards.
        std::vector<int> one{r};
        comm.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
        CHECK(one[0] == p * (p - 1) / 2);
    });
}

TEST_CASE("reduce_op values outside the enumerators are refused and mismatches name the tag",
          "[comm][mpi][failure]") {
    const bool verify = GENERATE(true, false);
    CAPTURE(verify);
    mpi_communicator comm(MPI_COMM_WORLD, {.verify = verify});
    in_step(comm, [&] {
        const int p = comm.size(), r = comm.rank();
        const auto bad = static_cast<reduce_op>(7);
        std::vector<float> f(4, 1.0f), g(4, 0.0f);
        const std::size_t ranks = static_cast<std::size_t>(p);
        std::vector<float> scatter_in(2 * ranks, 1.0f), scatter_out(2);
        // Every rank passes it: every rank refuses it, naming the value, before MPI sees it.
        for (const std::string kind : {"all_reduce", "reduce", "reduce_scatter"}) {
            try {
                if (kind == "all_reduce")
                    comm.all_reduce(std::span<const float>(f), std::span<float>(g), bad);
                else if (kind == "reduce")
                    comm.reduce(std::span<const float>(f), std::span<float>(g), bad, 0);
                else
                    comm.reduce_scatter(std::span<const float>(scatter_in),
                                        std::span<float>(scatter_out), bad);
                FAIL_CHECK(kind << " with reduce_op 7 did not throw");
            } catch (const lockstep::error& e) {
                const std::string what = e.what();
                INFO(what);
                CHECK(e.code() == errc::invalid_argument);
                CHECK(e.replica() == r);
                CHECK(what.find(kind + " #") != std::string::npos);
                CHECK(what.find("reduce_op value 7") != std::string::npos);
            }
        }
        CHECK(g == std::vector<float>(4, 0.0f));
        if (verify) {
            // Only rank 0 passes it: rank 0 refuses it, the others are released.
            CHECK(code_of([&] {
                      comm.all_reduce(std::span<const float>(f), std::span<float>(g),
                                      r == 0 ? bad : reduce_op::sum);
                  }) == (r == 0 ? errc::invalid_argument : errc::peer_failure));
            // A count mismatch names the collective's tag.
            std::vector<float> x(static_cast<std::size_t>(10 + r), 1.0f);
            try {
                comm.all_reduce(std::span<const float>(x), std::span<float>(x), reduce_op::sum,
                                "bucket 7");
                FAIL_CHECK("mismatched counts did not throw");
            } catch (const lockstep::error& e) {
                const std::string what = e.what();
                INFO(what);
                CHECK(e.code() == errc::count_mismatch);
                CHECK(what.find("all_reduce #" + std::to_string(comm.sequence()) +
                                " ('bucket 7'): replicas passed different counts") !=
                      std::string::npos);
            }
        }
        // The communicator is still in step afterwards.
        std::vector<int> one{r};
        comm.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
        CHECK(one[0] == p * (p - 1) / 2);
    });
}

TEST_CASE("a null or oversized span on rank 0 is an error on every rank, then the collectives "
          "continue",
          "[comm][mpi][failure]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    in_step(comm, [&] {
        const int p = comm.size(), r = comm.rank();
        const auto n = static_cast<std::size_t>(p);
        std::vector<float> good(4 * n, 1.0f), out(4 * n);
        float* const null = nullptr;
        const errc expected = r == 0 ? errc::invalid_argument : errc::peer_failure;
        // Rank 0 passes a null buffer with a non-zero count to each collective in turn.
        const auto mine = [&](std::span<float> s) {
            return r == 0 ? std::span<float>(null, s.size()) : s;
        };
        CHECK(code_of([&] {
                  comm.all_reduce(std::span<const float>(mine(good)), std::span<float>(out),
                                  reduce_op::sum);
              }) == expected);
        CHECK(code_of([&] { comm.broadcast(mine(good), 1 % p); }) == expected);
        CHECK(code_of([&] { comm.all_gather(std::span<const float>(good).first(4), mine(out)); }) ==
              expected);
        CHECK(code_of([&] {
                  comm.all_to_all(std::span<const float>(mine(good)), std::span<float>(out));
              }) == expected);
        CHECK(code_of([&] {
                  comm.reduce(std::span<const float>(mine(good)), std::span<float>(out),
                              reduce_op::sum, 0);
              }) == expected);
        // An all_gather of 2^63 elements per rank: refused, not silently skipped.
        CHECK(code_of([&] {
                  comm.all_gather(
                      std::span<const float>(good.data(), r == 0 ? std::size_t(1) << 63 : 4),
                      std::span<float>(out));
              }) == expected);
        CHECK_FALSE(comm.broken());
        // reduce_scatter: equal totals but different per-rank counts (caught by the counts'
        // hash), and one replica's counts that do not sum to its send size.
        const std::size_t ranks = static_cast<std::size_t>(p);
        std::vector<float> scatter_in(2 * ranks, 1.0f);
        std::vector<std::size_t> counts(ranks, 2);
        if (r == 0) {
            counts[0] = 1;
            counts[ranks - 1] += 1;
        }
        std::vector<float> scatter_out(counts[static_cast<std::size_t>(r)]);
        try {
            comm.reduce_scatter(std::span<const float>(scatter_in), std::span<float>(scatter_out),
                                std::span<const std::size_t>(counts), reduce_op::sum);
            FAIL_CHECK("mismatched per-rank counts did not throw");
        } catch (const lockstep::error& e) {
            const std::string what = e.what();
            INFO(what);
            CHECK(e.code() == errc::count_mismatch);
            CHECK(what.find("reduce_scatter #" + std::to_string(comm.sequence())) !=
                  std::string::npos);
            CHECK(what.find("different per-rank counts") != std::string::npos);
        }
        std::vector<std::size_t> short_counts(ranks, r == 0 ? 1 : 2);
        std::vector<float> two(2);
        CHECK(code_of([&] {
                  comm.reduce_scatter(std::span<const float>(scatter_in),
                                      std::span<float>(two).first(short_counts[0]),
                                      std::span<const std::size_t>(short_counts), reduce_op::sum);
              }) == (r == 0 ? errc::invalid_argument : errc::peer_failure));
        CHECK(code_of([&] {
                  comm.reduce_scatter(std::span<const float>(scatter_in),
                                      std::span<float>(two).first(r == 0 ? 1 : 2), reduce_op::max);
              }) == (r == 0 ? errc::invalid_argument : errc::peer_failure));

        // The communicator is still in step afterwards.
        std::vector<int> one{r};
        comm.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
        CHECK(one[0] == p * (p - 1) / 2);
    });
}

TEST_CASE("a receive nobody answers times out and breaks only its communicator",
          "[comm][mpi][failure]") {
    mpi_communicator world(MPI_COMM_WORLD);
    in_step(world, [&] {
        // Rank 0's own communicator: nobody sends to it, so its recv times out.
        mpi_communicator comm(MPI_COMM_WORLD,
                              {.timeout = std::chrono::milliseconds(300),
                               .on_failure = lockstep::mpi_failure_action::throw_error});
        CHECK(comm.timeout() == std::chrono::milliseconds(300));
        if (comm.rank() == 0) {
            std::vector<float> v(3);
            try {
                comm.recv(std::span<float>(v), 1 % comm.size(), 7);
                FAIL_CHECK("recv returned without a message");
            } catch (const lockstep::error& e) {
                INFO(e.what());
                CHECK(e.code() == errc::timeout);
                CHECK(std::string(e.what()).find("tag 7") != std::string::npos);
                CHECK(std::string(e.what()).find("300 ms") != std::string::npos);
            }
            CHECK(comm.broken());
            CHECK(code_of([&] { comm.send(std::span<const float>(v), 1 % comm.size(), 7); }) ==
                  errc::timeout); // refused at once with the first failure's code
        }
        CHECK_THROWS_AS(comm.set_timeout(std::chrono::milliseconds(0)), lockstep::error);
        // The world communicator is unaffected.
        world.barrier();
    });
}

TEST_CASE("a timeout of milliseconds::max() waits for a late rank instead of timing out",
          "[comm][mpi][failure]") {
    // now + max() overflowed into the past: every wait timed out at once.
    mpi_communicator world(MPI_COMM_WORLD);
    in_step(world, [&] {
        mpi_communicator comm(MPI_COMM_WORLD,
                              {.timeout = std::chrono::milliseconds::max(),
                               .on_failure = lockstep::mpi_failure_action::throw_error});
        if (comm.rank() == comm.size() - 1)
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        std::vector<int> one{comm.rank()};
        CHECK(code_of([&] {
                  comm.barrier();
                  comm.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
              }) == errc::internal); // internal: did not throw
        CHECK(one[0] == comm.size() * (comm.size() - 1) / 2);
    });
}

TEST_CASE("without verification the collectives still agree with the reference", "[comm][mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD, {.verify = false});
    in_step(comm, [&] {
        CHECK_FALSE(comm.verifying());
        for (const std::size_t n : message_counts) {
            const auto send = inputs<float>(comm.rank(), n);
            std::vector<float> recv(n);
            comm.all_reduce(std::span<const float>(send), std::span<float>(recv), reduce_op::sum);
            CHECK(differences(recv, reference<float>(reduce_op::sum, comm.size(), n)).empty());
        }
        const std::int64_t before = comm.sequence();
        comm.barrier();
        CHECK(comm.sequence() == before + 1);
    });
}

// A rank that verifies exchanges a signature its peers never send, so the data of one collective
// would pair with the signature of another: the constructor compares verify (and, when it is on,
// check_call_sites) and refuses a difference on every rank, naming each rank's value.
TEST_CASE("verify or check_call_sites differing across ranks is refused at construction",
          "[comm][mpi]") {
    int r = 0, p = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    std::string others;
    for (int j = 1; j < p; ++j)
        others += (j == 1 ? "" : ", ") + std::to_string(j);
    for (const bool sites : {false, true}) {
        INFO((sites ? "check_call_sites" : "verify") << " true on rank 0 only");
        lockstep::mpi_communicator_params params;
        params.verify = sites || r == 0;
        params.check_call_sites = sites && r == 0;
        std::string what;
        try {
            mpi_communicator comm(MPI_COMM_WORLD, params);
        } catch (const lockstep::error& e) {
            CHECK(e.code() == errc::invalid_argument);
            CHECK(e.replica() == r);
            what = e.what();
        }
        CHECK_THAT(what, Catch::Contains(std::string("mpi_communicator_params::") +
                                         (sites ? "check_call_sites" : "verify") +
                                         " differs across replicas: true on replica(s) 0, false "
                                         "on replica(s) " +
                                         others + ". Every replica must pass the same"));
    }
    // Without verification check_call_sites does nothing, so it may differ.
    lockstep::mpi_communicator_params params;
    params.verify = false;
    params.check_call_sites = r == 0;
    mpi_communicator comm(MPI_COMM_WORLD, params);
    CHECK(comm.size() == p);
}

// A reduce_scatter with the given counts, in place or into a separate recv: this rank's slice
// matches the naive reference, and send keeps this rank's values outside the slice (everywhere
// when out of place).
template <class T>
void reduce_scatter_counts(mpi_communicator& comm, const std::vector<std::size_t>& counts,
                           bool in_place) {
    const int p = comm.size(), r = comm.rank();
    std::size_t total = 0, offset = 0;
    for (int j = 0; j < p; ++j) {
        if (j == r)
            offset = total;
        total += counts[static_cast<std::size_t>(j)];
    }
    const std::size_t mine = counts[static_cast<std::size_t>(r)];
    const auto in = inputs<T>(r, total);
    std::vector<T> send = in, other(mine, T(7));
    const std::span<T> recv =
        in_place ? std::span<T>(send).subspan(offset, mine) : std::span<T>(other);
    comm.reduce_scatter(std::span<const T>(send), recv, std::span<const std::size_t>(counts),
                        reduce_op::sum);
    const auto all = reference<T>(reduce_op::sum, p, total);
    INFO("rank " << r << ", " << total << " elements of " << sizeof(T) << " bytes, this rank "
                 << mine << " from " << offset << (in_place ? ", in place" : ""));
    CHECK(differences(std::vector<T>(recv.begin(), recv.end()),
                      std::vector<T>(all.begin() + static_cast<std::ptrdiff_t>(offset),
                                     all.begin() + static_cast<std::ptrdiff_t>(offset + mine))) ==
          "");
    if (in_place)
        std::copy(in.begin() + static_cast<std::ptrdiff_t>(offset),
                  in.begin() + static_cast<std::ptrdiff_t>(offset + mine),
                  send.begin() + static_cast<std::ptrdiff_t>(offset));
    CHECK(differences(send, in).empty()); // the rest of send still holds this rank's values
}

// In place, the result goes through the communicator's scratch, which is kept between calls:
// sizes that shrink and grow again and element types of different widths share it. Each call's
// result matches the naive reference and the rest of send keeps this rank's own values.
template <class T>
void in_place_reduce_scatter(mpi_communicator& comm, std::size_t per_rank) {
    std::vector<std::size_t> counts(static_cast<std::size_t>(comm.size()));
    for (std::size_t j = 0; j < counts.size(); ++j)
        counts[j] = per_rank + j;
    reduce_scatter_counts<T>(comm, counts, true);
}

TEST_CASE("in-place reduce_scatter reuses its scratch across sizes and types", "[comm][mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    in_step(comm, [&] {
        for (const std::size_t n : {std::size_t{5}, std::size_t{70000}, std::size_t{3},
                                    std::size_t{150000}, std::size_t{1}}) {
            in_place_reduce_scatter<float>(comm, n);
            in_place_reduce_scatter<double>(comm, n);
            in_place_reduce_scatter<std::int64_t>(comm, n);
            in_place_reduce_scatter<int>(comm, n);
        }
    });
}

TEST_CASE("a large reduce_scatter runs in pieces, in place and out of place", "[comm][mpi]") {
    // Sends beyond twice the communicator's piece (1 MiB) are cut into pieces whose counts are
    // their overlap with each rank's slice: one owner (as in most of ZeRO's buckets), slices
    // whose boundaries fall inside pieces, and equal counts; totals that are not multiples of
    // the piece.
    mpi_communicator comm(MPI_COMM_WORLD);
    in_step(comm, [&] {
        const auto p = static_cast<std::size_t>(comm.size());
        const auto layouts = [&](std::size_t bytes) {
            const std::size_t total = (3 << 20) / bytes + 17;
            std::vector<std::vector<std::size_t>> out;
            std::vector<std::size_t> one(p, 0);
            one[p - 1] = total; // the last rank owns everything
            out.push_back(one);
            std::vector<std::size_t> uneven(p);
            std::size_t left = total;
            for (std::size_t j = 0; j + 1 < p; ++j) {
                uneven[j] = total / (p + 1) + 12345 * j;
                left -= uneven[j];
            }
            uneven[p - 1] = left;
            out.push_back(uneven);
            out.emplace_back(p, total / p + 3);
            return out;
        };
        for (const bool in_place : {true, false}) {
            for (const auto& counts : layouts(sizeof(float)))
                reduce_scatter_counts<float>(comm, counts, in_place);
            for (const auto& counts : layouts(sizeof(double)))
                reduce_scatter_counts<double>(comm, counts, in_place);
            for (const auto& counts : layouts(sizeof(int)))
                reduce_scatter_counts<int>(comm, counts, in_place);
        }
    });
}

TEST_CASE("reduce_scatter with an empty recv pointing into send", "[comm][mpi]") {
    // Even ranks receive nothing; their recv is an empty span at their (empty) slice of send,
    // which lies inside send (before an odd rank's slice), or at send's start for rank 0. Both
    // with and without verification, equal counts (all zero) and uneven ones.
    for (const bool verify : {true, false}) {
        mpi_communicator comm(MPI_COMM_WORLD, {.verify = verify});
        in_step(comm, [&] {
            const int p = comm.size(), r = comm.rank();
            std::vector<std::size_t> counts(static_cast<std::size_t>(p));
            std::size_t total = 0, offset = 0;
            for (int j = 0; j < p; ++j) {
                counts[static_cast<std::size_t>(j)] = j % 2 == 0 ? 0 : 3 + j;
                if (j == r)
                    offset = total;
                total += counts[static_cast<std::size_t>(j)];
            }
            const std::size_t mine = counts[static_cast<std::size_t>(r)];
            const auto in = inputs<float>(r, total);
            const auto all = reference<float>(reduce_op::sum, p, total);
            for (const bool in_place : {false, true}) {
                INFO("verify " << verify << ", in place " << in_place << ", rank " << r);
                std::vector<float> send = in, other(mine, -1.0f);
                const std::span<float> recv = in_place || mine == 0
                                                  ? std::span<float>(send).subspan(offset, mine)
                                                  : std::span<float>(other);
                comm.reduce_scatter(std::span<const float>(send), recv,
                                    std::span<const std::size_t>(counts), reduce_op::sum);
                const std::vector<float> got(recv.begin(), recv.end());
                const std::vector<float> want(all.begin() + static_cast<std::ptrdiff_t>(offset),
                                              all.begin() +
                                                  static_cast<std::ptrdiff_t>(offset + mine));
                CHECK(differences(got, want).empty());
                if (!in_place || mine == 0)
                    CHECK(send == in); // nothing was written into send
            }
            // Every count zero: every recv is empty and points at send's start.
            std::vector<float> none(4, 1.0f);
            const std::vector<std::size_t> zeros(static_cast<std::size_t>(p), 0);
            comm.reduce_scatter(std::span<const float>(none.data(), 0),
                                std::span<float>(none.data(), 0),
                                std::span<const std::size_t>(zeros), reduce_op::sum);
            comm.reduce_scatter(std::span<const float>(none.data(), 0),
                                std::span<float>(none.data(), 0), reduce_op::max);
            CHECK(none == std::vector<float>(4, 1.0f));
        });
    }
}

TEST_CASE("environment and system report what MPI provides", "[comm][mpi]") {
    lockstep::mpi_environment again; // MPI is already initialised: a no-op
    CHECK_FALSE(again.owns());
    CHECK(again.thread_level() >= MPI_THREAD_FUNNELED);
    mpi_communicator comm(MPI_COMM_WORLD);
    // Every test rank runs on this one node, so the cores are divided among all of them (CTest
    // sets OMP_NUM_THREADS=1, which is then the budget of each process).
    CHECK(comm.system().threads() == lockstep::host_system::process_threads(comm.size()));
    if (lockstep::host_system::omp_env_threads() == 0)
        CHECK(comm.system().threads() ==
              std::max(1, lockstep::host_system::hardware_threads() / comm.size()));
    else
        CHECK(comm.system().threads() == lockstep::host_system::omp_env_threads());
    int world = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    CHECK(comm.size() == world);
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

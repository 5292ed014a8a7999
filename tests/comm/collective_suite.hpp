// tests/comm/collective_suite.hpp: the backend-agnostic collective test body (every collective,
// type, reduction and count against a serial reference). SPDX-License-Identifier: Apache-2.0
#pragma once

// Called inside every replica (a thread or a process). Catch2 assertions are not thread-safe,
// so the suite records failures in a suite_report; the test REQUIREs on the reports after the
// replicas have finished (thread_group) or per process (MPI).
//
// Inputs differ per rank: element i of rank r is input_value<T>(r, i), a hash of (r, i). Each
// replica computes the reference for all ranks itself, from size() alone. Reference sums are
// formed in rank order 0, 1, ..., size()-1 in T arithmetic; a backend that reduces in rank
// order (thread_group) must match them bit for bit (suite_options::rank_order_sums), any other
// backend within the recursive-summation bound stated at reduction_matches(). Integer results
// and max/min are exact on every backend. Every result is also hashed and the hashes compared
// across replicas: results must be bitwise identical on every replica.
//
// half and bfloat16 (check_float16): inputs are input_value<float> rounded to 16 bits. A
// rank-order backend (suite_options::rank_order_float16) must return round16(the float fold in
// rank order) bit for bit; every backend's sums must lie within float16_bound() of the exact
// (double) sum; max/min and copies are exact.

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace lockstep::testing {

/// What a backend promises about its reductions, and how big "large" is.
struct suite_options {
    /// true: float/double sums equal the rank-order reference bit for bit.
    bool rank_order_sums = true;
    /// The large count of all_reduce (not a multiple of any chunk or line size).
    std::size_t large_count = (std::size_t{1} << 20) + 3;
    /// The largest count of the other collectives.
    std::size_t medium_count = 65537;
    /// true: half/bfloat16 sums equal round16(the float fold in rank order) bit for bit (one
    /// rounding); false: within float16_bound's any-order bound (NCCL, hierarchical levels).
    bool rank_order_float16 = true;
};

/// Whether the suite runs the half/bfloat16 checks on C (specialise to false for a
/// communicator that does not reduce 16-bit floats).
template <class C>
inline constexpr bool float16_collectives = true;

/// The checks one replica made and the ones that failed (at most max_failures kept).
struct suite_report {
    int rank = -1;
    int size = 0;
    std::size_t checks = 0;
    std::size_t failed = 0;
    std::vector<std::string> failures;
    static constexpr std::size_t max_failures = 40;

    /// Counts one check; keeps `what` when it failed.
    void check(bool ok, const std::string& what) {
        ++checks;
        if (ok)
            return;
        ++failed;
        if (failures.size() < max_failures)
            failures.push_back("[rank " + std::to_string(rank) + " of " + std::to_string(size) +
                               "] " + what);
    }
    /// Appends another report's checks (a sub-group's) to this one.
    void merge(const suite_report& o) {
        checks += o.checks;
        failed += o.failed;
        for (const auto& f : o.failures)
            if (failures.size() < max_failures)
                failures.push_back(f);
    }
    /// All failures, one per line.
    std::string text() const {
        std::string s;
        for (const auto& f : failures)
            s += f + "\n";
        if (failed > failures.size())
            s += "... and " + std::to_string(failed - failures.size()) + " more\n";
        return s;
    }
};

namespace detail {

inline std::uint64_t splitmix64(std::uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

template <class T>
std::string type_name() {
    if constexpr (std::is_same_v<T, float>)
        return "float";
    else if constexpr (std::is_same_v<T, double>)
        return "double";
    else if constexpr (std::is_same_v<T, int>)
        return "int";
    else if constexpr (std::is_same_v<T, std::int64_t>)
        return "int64";
    else if constexpr (std::is_same_v<T, std::uint8_t>)
        return "uint8";
    else if constexpr (std::is_same_v<T, half>)
        return "half";
    else if constexpr (std::is_same_v<T, bfloat16>)
        return "bfloat16";
    else
        return "T" + std::to_string(sizeof(T));
}

template <class T>
std::string show(T v) {
    std::ostringstream os;
    os.precision(std::numeric_limits<T>::max_digits10);
    if constexpr (sizeof(T) == 1)
        os << static_cast<int>(v);
    else
        os << v;
    return os.str();
}

/// The bits of one element as an unsigned integer of its size (1, 2, 4 or 8 bytes).
template <class T>
auto element_bits(T v) {
    if constexpr (sizeof(T) == 1)
        return std::bit_cast<std::uint8_t>(v);
    else if constexpr (sizeof(T) == 2)
        return std::bit_cast<std::uint16_t>(v);
    else if constexpr (sizeof(T) == 4)
        return std::bit_cast<std::uint32_t>(v);
    else
        return std::bit_cast<std::uint64_t>(v);
}

template <class T>
bool same_bits(T a, T b) {
    return element_bits(a) == element_bits(b);
}

/// FNV-1a over the elements' bits, one element per step (a word at a time: a sanitizer checks
/// one access per element, not one per byte).
template <class T>
std::uint64_t hash_bytes(const std::vector<T>& v) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (const T& x : v)
        h = (h ^ static_cast<std::uint64_t>(element_bits(x))) * 0x100000001b3ull;
    return h;
}

template <class C, class T>
concept carries = requires(C& c, std::span<const T> s, std::span<T> r) {
    c.all_reduce(s, r, reduce_op::sum);
    c.broadcast(r, 0);
    c.all_gather(s, r);
};

} // namespace detail

/// Element i of rank r's input: differs per rank and per element; floats use their whole
/// mantissa (so the summation order shows in the bits); integer sums cannot overflow.
template <class T>
T input_value(int rank, std::size_t i) {
    const std::uint64_t h = detail::splitmix64((static_cast<std::uint64_t>(rank) << 40) ^
                                               static_cast<std::uint64_t>(i));
    if constexpr (std::is_floating_point_v<T>)
        return static_cast<T>(static_cast<double>(h >> 11) * 0x1.0p-52 - 1.0);
    else if constexpr (std::is_same_v<T, std::uint8_t>)
        return static_cast<T>(h & 0xff);
    else if constexpr (sizeof(T) >= 8)
        return static_cast<T>(h % (std::uint64_t{1} << 41)) - (T{1} << 40);
    else
        return static_cast<T>(static_cast<int>(h % 2001) - 1000);
}

/// op over ranks 0..n-1 of input_value(r, i), in rank order, in T arithmetic.
template <class T>
T reference_reduce(int n, std::size_t i, reduce_op op) {
    T acc = input_value<T>(0, i);
    for (int r = 1; r < n; ++r) {
        const T v = input_value<T>(r, i);
        switch (op) {
        case reduce_op::sum:
            acc = static_cast<T>(acc + v);
            break;
        case reduce_op::max:
            acc = acc < v ? v : acc;
            break;
        case reduce_op::min:
            acc = v < acc ? v : acc;
            break;
        }
    }
    return acc;
}

/// Whether `got` is an acceptable reduction at element i. Exact for integers and max/min, and
/// for float sums of a rank-order backend; otherwise |got - ref| <= (n-1) * eps * sum_r |x_r|
/// (the bound of any summation order is (n-1) * eps/2 * sum |x_r| from the exact sum, and the
/// rank-order reference is within the same bound).
template <class T>
bool reduction_matches(T got, T ref, int n, std::size_t i, reduce_op op, const suite_options& opt) {
    if (detail::same_bits(got, ref))
        return true;
    if constexpr (std::is_floating_point_v<T>) {
        if (op != reduce_op::sum || opt.rank_order_sums)
            return false;
        double abs_sum = 0;
        for (int r = 0; r < n; ++r)
            abs_sum += std::fabs(static_cast<double>(input_value<T>(r, i)));
        const double bound =
            (n - 1) * static_cast<double>(std::numeric_limits<T>::epsilon()) * abs_sum;
        return std::fabs(static_cast<double>(got) - static_cast<double>(ref)) <= bound;
    }
    return false;
}

/// Copies host elements into a new buffer of comm's system.
template <class T, communicator C>
auto to_system(const C& comm, const std::vector<T>& host) {
    buffer<T, typename C::system_type> b(host.size(), comm.system());
    lockstep::copy(std::span<const T>(host), host_system{}, b.span(), b.system());
    return b;
}

/// Copies a buffer (of any system) into host memory.
template <class T, class S>
std::vector<T> to_host(const buffer<T, S>& b) {
    std::vector<T> host(b.size());
    lockstep::copy(std::span<const T>(b.data(), b.size()), b.system(), std::span<T>(host),
                   host_system{});
    return host;
}

/// Gathers one int per replica (through comm's memory).
template <communicator C>
std::vector<int> gather_ints(C& comm, const std::vector<int>& mine) {
    auto send = to_system(comm, mine);
    buffer<int, typename C::system_type> recv(mine.size() * static_cast<std::size_t>(comm.size()),
                                              comm.system());
    comm.all_gather(std::span<const int>(send.data(), send.size()), recv.span());
    return to_host(recv);
}

/// Checks that `result` has the same bytes on every replica.
template <communicator C, class T>
void check_identical(C& comm, suite_report& rep, const std::vector<T>& result,
                     const std::string& what) {
    const std::uint64_t h = detail::hash_bytes(result);
    const std::vector<int> mine{static_cast<int>(h & 0xffffffffu), static_cast<int>(h >> 32)};
    const std::vector<int> all = gather_ints(comm, mine);
    bool same = true;
    for (int r = 0; r < comm.size(); ++r)
        same = same && all[2 * r] == all[0] && all[2 * r + 1] == all[1];
    rep.check(same, what + ": the result differs between replicas (hashes differ)");
}

/// The first element where got differs from expected(i), as a failure message ("" if none).
template <class T, class Expected, class Matches>
std::string first_mismatch(const std::vector<T>& got, std::size_t offset, std::size_t n,
                           Expected expected, Matches matches) {
    for (std::size_t i = 0; i < n; ++i) {
        const T want = expected(i);
        if (!matches(got[offset + i], want, i))
            return "element " + std::to_string(i) + " is " + detail::show(got[offset + i]) +
                   ", expected " + detail::show(want);
    }
    return {};
}

/// all_reduce for every reduction and count, out of place and in place, against
/// reference_reduce(). The buffers of one count are allocated once and rewritten before every
/// call: under ThreadSanitizer a fresh allocation of the large count costs more than the
/// collective (the runtime remaps the shadow of every large block it frees, so each new block
/// faults in its pages again).
template <class T, communicator C>
void check_all_reduce(C& comm, suite_report& rep, const std::vector<std::size_t>& counts,
                      const suite_options& opt) {
    const int n = comm.size(), me = comm.rank();
    for (const std::size_t count : counts) {
        std::vector<T> in(count), got(count);
        for (std::size_t i = 0; i < count; ++i)
            in[i] = input_value<T>(me, i);
        buffer<T, typename C::system_type> send(count, comm.system()), recv(count, comm.system());
        for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
            for (const bool in_place : {false, true}) {
                if (in_place && op != reduce_op::sum)
                    continue;
                const std::string what = "all_reduce<" + detail::type_name<T>() + "> " +
                                         std::string(to_string(op)) + " count " +
                                         std::to_string(count) + (in_place ? " in place" : "");
                lockstep::copy(std::span<const T>(in), host_system{}, send.span(), send.system());
                std::fill(got.begin(), got.end(), T{});
                lockstep::copy(std::span<const T>(got), host_system{}, recv.span(), recv.system());
                auto& out = in_place ? send : recv;
                comm.all_reduce(std::span<const T>(send.data(), count), out.span(), op);
                lockstep::copy(std::span<const T>(out.data(), count), out.system(),
                               std::span<T>(got), host_system{});
                const std::string bad = first_mismatch(
                    got, 0, count, [&](std::size_t i) { return reference_reduce<T>(n, i, op); },
                    [&](T g, T w, std::size_t i) {
                        return reduction_matches(g, w, n, i, op, opt);
                    });
                rep.check(bad.empty(), what + ": " + bad);
                check_identical(comm, rep, got, what);
            }
        }
    }
}

/// broadcast from every root, for every count.
template <class T, communicator C>
void check_broadcast(C& comm, suite_report& rep, const std::vector<std::size_t>& counts) {
    const int me = comm.rank();
    for (int root = 0; root < comm.size(); ++root) {
        for (const std::size_t count : counts) {
            const std::string what = "broadcast<" + detail::type_name<T>() + "> root " +
                                     std::to_string(root) + " count " + std::to_string(count);
            std::vector<T> in(count);
            for (std::size_t i = 0; i < count; ++i)
                in[i] = input_value<T>(me, i);
            auto data = to_system(comm, in);
            comm.broadcast(data.span(), root);
            const std::vector<T> got = to_host(data);
            const std::string bad = first_mismatch(
                got, 0, count, [&](std::size_t i) { return input_value<T>(root, i); },
                [](T g, T w, std::size_t) { return detail::same_bits(g, w); });
            rep.check(bad.empty(), what + ": " + bad);
        }
    }
}

/// all_gather for every count: slice r of the result is rank r's input.
template <class T, communicator C>
void check_all_gather(C& comm, suite_report& rep, const std::vector<std::size_t>& counts) {
    const int n = comm.size(), me = comm.rank();
    for (const std::size_t count : counts) {
        const std::string what =
            "all_gather<" + detail::type_name<T>() + "> count " + std::to_string(count);
        std::vector<T> in(count);
        for (std::size_t i = 0; i < count; ++i)
            in[i] = input_value<T>(me, i);
        auto send = to_system(comm, in);
        auto recv = to_system(comm, std::vector<T>(count * static_cast<std::size_t>(n), T{}));
        comm.all_gather(std::span<const T>(send.data(), count), recv.span());
        const std::vector<T> got = to_host(recv);
        for (int r = 0; r < n; ++r) {
            const std::string bad = first_mismatch(
                got, static_cast<std::size_t>(r) * count, count,
                [&](std::size_t i) { return input_value<T>(r, i); },
                [](T g, T w, std::size_t) { return detail::same_bits(g, w); });
            rep.check(bad.empty(), what + ", slice of rank " + std::to_string(r) + ": " + bad);
        }
    }
}

/// all_to_all for every block count: block r of the result is block rank() of rank r's input.
/// Results differ per replica by design, so instead of one common hash every replica checks
/// the hash each peer reports against the hash of what that peer must hold.
template <class T, all_to_all_communicator C>
void check_all_to_all(C& comm, suite_report& rep, const std::vector<std::size_t>& blocks) {
    const int n = comm.size(), me = comm.rank();
    const std::size_t ranks = static_cast<std::size_t>(n);
    for (const std::size_t block : blocks) {
        const std::string what =
            "all_to_all<" + detail::type_name<T>() + "> block " + std::to_string(block);
        std::vector<T> in(block * ranks);
        for (std::size_t i = 0; i < in.size(); ++i)
            in[i] = input_value<T>(me, i);
        // Rank q's result: block r is rank r's elements [q * block, (q + 1) * block).
        const auto expected = [&](int q) {
            std::vector<T> v(block * ranks);
            for (std::size_t r = 0; r < ranks; ++r)
                for (std::size_t k = 0; k < block; ++k)
                    v[r * block + k] = input_value<T>(static_cast<int>(r),
                                                      static_cast<std::size_t>(q) * block + k);
            return v;
        };
        auto send = to_system(comm, in);
        auto recv = to_system(comm, std::vector<T>(block * ranks, T{}));
        comm.all_to_all(std::span<const T>(send.data(), send.size()), recv.span());
        const std::vector<T> got = to_host(recv);
        const std::vector<T> want = expected(me);
        for (int r = 0; r < n; ++r) {
            const std::string bad = first_mismatch(
                got, static_cast<std::size_t>(r) * block, block,
                [&](std::size_t k) { return want[static_cast<std::size_t>(r) * block + k]; },
                [](T g, T w, std::size_t) { return detail::same_bits(g, w); });
            rep.check(bad.empty(), what + ", block from rank " + std::to_string(r) + ": " + bad);
        }
        rep.check(to_host(send) == in, what + ": the send buffer changed");
        const std::uint64_t h = detail::hash_bytes(got);
        const std::vector<int> hashes =
            gather_ints(comm, {static_cast<int>(h & 0xffffffffu), static_cast<int>(h >> 32)});
        for (int q = 0; q < n; ++q) {
            const std::uint64_t hq = detail::hash_bytes(expected(q));
            const bool right =
                hashes[2 * static_cast<std::size_t>(q)] == static_cast<int>(hq & 0xffffffffu) &&
                hashes[2 * static_cast<std::size_t>(q) + 1] == static_cast<int>(hq >> 32);
            rep.check(right, what + ": rank " + std::to_string(q) +
                                 " reports the hash of another result than its blocks");
        }
    }
}

/// reduce to every root, for every reduction and count; the other replicas' recv stays as
/// it was.
template <class T, communicator C>
void check_reduce(C& comm, suite_report& rep, const std::vector<std::size_t>& counts,
                  const suite_options& opt) {
    const int n = comm.size(), me = comm.rank();
    const T sentinel = static_cast<T>(77);
    for (int root = 0; root < n; ++root) {
        for (const std::size_t count : counts) {
            std::vector<T> in(count);
            for (std::size_t i = 0; i < count; ++i)
                in[i] = input_value<T>(me, i);
            for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
                const std::string what = "reduce<" + detail::type_name<T>() + "> " +
                                         std::string(to_string(op)) + " root " +
                                         std::to_string(root) + " count " + std::to_string(count);
                auto send = to_system(comm, in);
                auto recv = to_system(comm, std::vector<T>(count, sentinel));
                comm.reduce(std::span<const T>(send.data(), count), recv.span(), op, root);
                const std::vector<T> got = to_host(recv);
                const std::string bad =
                    me == root ? first_mismatch(
                                     got, 0, count,
                                     [&](std::size_t i) { return reference_reduce<T>(n, i, op); },
                                     [&](T g, T w, std::size_t i) {
                                         return reduction_matches(g, w, n, i, op, opt);
                                     })
                               : first_mismatch(
                                     got, 0, count, [&](std::size_t) { return sentinel; },
                                     [](T g, T w, std::size_t) { return detail::same_bits(g, w); });
                rep.check(bad.empty(), what + (me == root ? ": " : ", non-root recv: ") + bad);
            }
        }
    }
}

/// The per-rank counts reduce_scatter is tested with on a group of n: equal counts (0, 1, a
/// prime), a prime total not divisible by n (spread as evenly as possible), uneven counts with
/// zeros for some ranks, and an uneven large total (beyond the 4 KiB stash of thread_group).
inline std::vector<std::vector<std::size_t>> scatter_layouts(int n, std::size_t large) {
    const std::size_t ranks = static_cast<std::size_t>(n);
    std::vector<std::vector<std::size_t>> out;
    for (const std::size_t each : {std::size_t{0}, std::size_t{1}, std::size_t{13}})
        out.emplace_back(ranks, each);
    for (const std::size_t total : {std::size_t{13}, std::size_t{1009}}) {
        std::vector<std::size_t> c(ranks);
        for (std::size_t r = 0; r < ranks; ++r)
            c[r] = total / ranks + (r < total % ranks ? 1 : 0);
        out.push_back(c);
    }
    std::vector<std::size_t> zeros(ranks);
    for (std::size_t r = 0; r < ranks; ++r)
        zeros[r] = (r % 2 == 1 || (r + 1 == ranks && ranks > 2)) ? 0 : 37 * (r + 1) + r;
    out.push_back(zeros);
    std::vector<std::size_t> big(ranks);
    std::size_t left = large;
    for (std::size_t r = 0; r + 1 < ranks; ++r) {
        big[r] = large * (r + 1) / (ranks * (ranks + 1) / 2);
        left -= big[r];
    }
    big[ranks - 1] = left;
    out.push_back(big);
    return out;
}

/// reduce_scatter for every reduction and layout (scatter_layouts), through the counted form,
/// the equal-count form where counts are equal, and in place (sum). Each replica checks its
/// slice against the rank-order reference (reduction_matches) and, for float sums, against a
/// double-precision sum; it must equal the same slice of all_reduce's result (bit for bit on a
/// rank-order backend), and with equal counts an all_gather of the slices must give every
/// replica the same bits.
template <class T, communicator C>
void check_reduce_scatter(C& comm, suite_report& rep, const suite_options& opt, std::size_t large) {
    const int n = comm.size(), me = comm.rank();
    const std::size_t ranks = static_cast<std::size_t>(n);
    for (const std::vector<std::size_t>& counts : scatter_layouts(n, large)) {
        std::size_t total = 0, offset = 0;
        for (std::size_t r = 0; r < ranks; ++r) {
            if (r == static_cast<std::size_t>(me))
                offset = total;
            total += counts[r];
        }
        const std::size_t mine = counts[static_cast<std::size_t>(me)];
        const bool equal = std::all_of(counts.begin(), counts.end(),
                                       [&](std::size_t c) { return c == counts[0]; });
        std::string layout = "{";
        for (std::size_t r = 0; r < ranks; ++r)
            layout += (r == 0 ? "" : ", ") + std::to_string(counts[r]);
        layout += "}";
        std::vector<T> in(total);
        for (std::size_t i = 0; i < total; ++i)
            in[i] = input_value<T>(me, i);
        for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
            // all_reduce of the same inputs: reduce_scatter's slices must be its slices.
            auto whole_send = to_system(comm, in);
            auto whole = to_system(comm, std::vector<T>(total, T{}));
            comm.all_reduce(std::span<const T>(whole_send.data(), total), whole.span(), op);
            const std::vector<T> all = to_host(whole);
            for (const int form : {0, 1, 2}) { // counted, equal-count, counted in place
                if (form == 1 && !equal)
                    continue;
                if (form == 2 && op != reduce_op::sum)
                    continue;
                const std::string what = "reduce_scatter<" + detail::type_name<T>() + "> " +
                                         std::string(to_string(op)) + " counts " + layout +
                                         (form == 1   ? " equal-count form"
                                          : form == 2 ? " in place"
                                                      : "");
                auto send = to_system(comm, in);
                auto recv = to_system(comm, std::vector<T>(mine, static_cast<T>(77)));
                const std::span<const T> s(send.data(), total);
                const std::span<T> out =
                    form == 2 ? send.span().subspan(offset, mine) : recv.span();
                if (form == 1)
                    comm.reduce_scatter(s, out, op);
                else
                    comm.reduce_scatter(s, out, std::span<const std::size_t>(counts), op);
                std::vector<T> got = to_host(form == 2 ? send : recv);
                if (form == 2)
                    got = std::vector<T>(got.begin() + static_cast<std::ptrdiff_t>(offset),
                                         got.begin() + static_cast<std::ptrdiff_t>(offset + mine));
                else
                    rep.check(to_host(send) == in, what + ": the send buffer changed");
                const std::string bad = first_mismatch(
                    got, 0, mine,
                    [&](std::size_t i) { return reference_reduce<T>(n, offset + i, op); },
                    [&](T g, T w, std::size_t i) {
                        return reduction_matches(g, w, n, offset + i, op, opt);
                    });
                rep.check(bad.empty(), what + ": " + bad);
                if constexpr (std::is_floating_point_v<T>) {
                    std::string far;
                    for (std::size_t i = 0; i < mine && far.empty() && op == reduce_op::sum; ++i) {
                        double exact = 0, abs_sum = 0;
                        for (int r = 0; r < n; ++r) {
                            exact += static_cast<double>(input_value<T>(r, offset + i));
                            abs_sum +=
                                std::fabs(static_cast<double>(input_value<T>(r, offset + i)));
                        }
                        const double bound =
                            n * static_cast<double>(std::numeric_limits<T>::epsilon()) * abs_sum;
                        if (std::fabs(static_cast<double>(got[i]) - exact) > bound)
                            far = "element " + std::to_string(i) + " is " + detail::show(got[i]) +
                                  ", the double-precision sum " + detail::show(exact);
                    }
                    rep.check(far.empty(), what + " against double precision: " + far);
                }
                const std::string apart = first_mismatch(
                    got, 0, mine, [&](std::size_t i) { return all[offset + i]; },
                    [&](T g, T w, std::size_t i) {
                        return reduction_matches(g, w, n, offset + i, op, opt);
                    });
                rep.check(apart.empty(), what + ": differs from all_reduce's slice: " + apart);
                if (equal) {
                    auto mine_buf = to_system(comm, got);
                    auto gathered = to_system(comm, std::vector<T>(total, T{}));
                    comm.all_gather(std::span<const T>(mine_buf.data(), mine), gathered.span());
                    const std::vector<T> g = to_host(gathered);
                    if (opt.rank_order_sums)
                        rep.check(detail::hash_bytes(g) == detail::hash_bytes(all),
                                  what + ": reduce_scatter then all_gather is not all_reduce's "
                                         "bits");
                    check_identical(comm, rep, g, what + " then all_gather");
                }
            }
        }
    }
}

/// Element i of rank r's 16-bit input: input_value<float>(r, i) rounded to W.
template <class W>
W input16(int rank, std::size_t i) {
    return W(input_value<float>(rank, i));
}

/// op over ranks 0..n-1 of input16(r, i), folded in float in rank order and rounded once.
template <class W>
W reference16(int n, std::size_t i, reduce_op op) {
    float acc = static_cast<float>(input16<W>(0, i));
    for (int r = 1; r < n; ++r) {
        const float v = static_cast<float>(input16<W>(r, i));
        if (op == reduce_op::sum)
            acc += v;
        else if (op == reduce_op::max)
            acc = acc < v ? v : acc;
        else
            acc = v < acc ? v : acc;
    }
    return W(acc);
}

/// The largest distance of a 16-bit sum at element i from the exact (double) sum of the n
/// inputs, with u = W::unit_roundoff, t = half W's smallest subnormal (the absolute rounding
/// error near zero) and S = sum_r |x_r|:
/// - rank order (one rounding of the float fold f): |f - exact| <= (n-1) 2^-24 S, so
///   |got - exact| <= u |exact| + t + n 2^-23 S;
/// - any order or per-level rounding (at most n roundings to 16 bits, each of a partial sum
///   bounded by S): n (u S + t).
template <class W>
double float16_bound(int n, std::size_t i, bool rank_order, double& exact) {
    const double t = std::is_same_v<W, half> ? std::ldexp(1.0, -25) : std::ldexp(1.0, -134);
    double abs_sum = 0;
    exact = 0;
    for (int r = 0; r < n; ++r) {
        const double x = static_cast<float>(input16<W>(r, i));
        exact += x;
        abs_sum += std::fabs(x);
    }
    if (rank_order)
        return W::unit_roundoff * std::fabs(exact) + t + n * std::ldexp(1.0, -23) * abs_sum;
    return n * (W::unit_roundoff * abs_sum + t);
}

template <class W>
std::string show16(W x) {
    std::ostringstream os;
    os.precision(9);
    os << static_cast<float>(x) << " (bits 0x" << std::hex << x.bits << ")";
    return os.str();
}

/// The first element i < m where got[i] is not an acceptable op-reduction of element
/// offset + i: the rank-order reference bit for bit, or for sums of an any-order backend within
/// float16_bound; for every backend's sums also within float16_bound of the double sum.
template <class W>
std::string mismatch16(const std::vector<W>& got, std::size_t offset, std::size_t m, int n,
                       reduce_op op, const suite_options& opt) {
    for (std::size_t i = 0; i < m; ++i) {
        const W want = reference16<W>(n, offset + i, op);
        const bool same = detail::same_bits(got[i], want);
        if (op != reduce_op::sum && !same)
            return "element " + std::to_string(i) + " is " + show16(got[i]) + ", expected " +
                   show16(want);
        if (op != reduce_op::sum)
            continue;
        double exact = 0;
        const double bound = float16_bound<W>(n, offset + i, opt.rank_order_float16, exact);
        const double err = std::fabs(static_cast<double>(static_cast<float>(got[i])) - exact);
        if ((opt.rank_order_float16 && !same) || !(err <= bound))
            return "element " + std::to_string(i) + " is " + show16(got[i]) + ", rank-order " +
                   "reference " + show16(want) + ", double sum " + std::to_string(exact) +
                   " (error " + std::to_string(err) + ", bound " + std::to_string(bound) + ")";
    }
    return {};
}

/// Every collective on half or bfloat16: all_reduce (out of place and in place), reduce_scatter
/// (every scatter_layouts layout; in place; all_gather of equal slices gives all_reduce's bits
/// on a rank-order backend), reduce to every root (non-roots' recv untouched), all_gather and
/// broadcast (exact copies). Every reduction result is checked for equal bits across replicas.
template <class W, communicator C>
void check_float16(C& comm, suite_report& rep, const suite_options& opt) {
    const int n = comm.size(), me = comm.rank();
    const std::string tn = detail::type_name<W>();
    const auto input = [&](int r, std::size_t count) {
        std::vector<W> v(count);
        for (std::size_t i = 0; i < count; ++i)
            v[i] = input16<W>(r, i);
        return v;
    };
    const auto ops = {reduce_op::sum, reduce_op::max, reduce_op::min};
    // 5003 elements pass the thread group's 4 KiB stash (its chunked path).
    const std::vector<std::size_t> counts{0, 1, 1009, 5003};
    for (const std::size_t count : counts) {
        const std::vector<W> in = input(me, count);
        for (const reduce_op op : ops) {
            for (const bool in_place : {false, true}) {
                if (in_place && op != reduce_op::sum)
                    continue;
                const std::string what = "all_reduce<" + tn + "> " + std::string(to_string(op)) +
                                         " count " + std::to_string(count) +
                                         (in_place ? " in place" : "");
                auto send = to_system(comm, in);
                auto recv = to_system(comm, std::vector<W>(count, W(0.0f)));
                auto& out = in_place ? send : recv;
                comm.all_reduce(std::span<const W>(send.data(), count), out.span(), op);
                const std::vector<W> got = to_host(out);
                const std::string bad = mismatch16(got, 0, count, n, op, opt);
                rep.check(bad.empty(), what + ": " + bad);
                check_identical(comm, rep, got, what);
            }
        }
    }
    for (const std::vector<std::size_t>& layout : scatter_layouts(n, 5003)) {
        std::size_t total = 0, offset = 0;
        for (int r = 0; r < n; ++r) {
            if (r == me)
                offset = total;
            total += layout[static_cast<std::size_t>(r)];
        }
        const std::size_t mine = layout[static_cast<std::size_t>(me)];
        const bool equal = std::all_of(layout.begin(), layout.end(),
                                       [&](std::size_t c) { return c == layout[0]; });
        std::string described = "{";
        for (std::size_t r = 0; r < layout.size(); ++r)
            described += (r == 0 ? "" : ", ") + std::to_string(layout[r]);
        described += "}";
        const std::vector<W> in = input(me, total);
        for (const reduce_op op : ops) {
            auto whole_send = to_system(comm, in);
            auto whole = to_system(comm, std::vector<W>(total, W(0.0f)));
            comm.all_reduce(std::span<const W>(whole_send.data(), total), whole.span(), op);
            const std::vector<W> all = to_host(whole);
            for (const bool in_place : {false, true}) {
                if (in_place && op != reduce_op::sum)
                    continue;
                const std::string what = "reduce_scatter<" + tn + "> " +
                                         std::string(to_string(op)) + " counts " + described +
                                         (in_place ? " in place" : "");
                auto send = to_system(comm, in);
                auto recv = to_system(comm, std::vector<W>(mine, W(77.0f)));
                const std::span<W> out = in_place ? send.span().subspan(offset, mine) : recv.span();
                comm.reduce_scatter(std::span<const W>(send.data(), total), out,
                                    std::span<const std::size_t>(layout), op);
                std::vector<W> got = to_host(in_place ? send : recv);
                if (in_place)
                    got = std::vector<W>(got.begin() + static_cast<std::ptrdiff_t>(offset),
                                         got.begin() + static_cast<std::ptrdiff_t>(offset + mine));
                const std::string bad = mismatch16(got, offset, mine, n, op, opt);
                rep.check(bad.empty(), what + ": " + bad);
                if (!equal)
                    continue;
                auto slice = to_system(comm, got);
                auto gathered = to_system(comm, std::vector<W>(total, W(0.0f)));
                comm.all_gather(std::span<const W>(slice.data(), mine), gathered.span());
                const std::vector<W> g = to_host(gathered);
                check_identical(comm, rep, g, what + " then all_gather");
                if (opt.rank_order_float16)
                    rep.check(detail::hash_bytes(g) == detail::hash_bytes(all),
                              what + ": reduce_scatter then all_gather is not all_reduce's bits");
            }
        }
    }
    const W sentinel(77.0f);
    for (int root = 0; root < n; ++root) {
        const std::vector<W> in = input(me, 1009);
        for (const reduce_op op : ops) {
            const std::string what = "reduce<" + tn + "> " + std::string(to_string(op)) + " root " +
                                     std::to_string(root) + " count 1009";
            auto send = to_system(comm, in);
            auto recv = to_system(comm, std::vector<W>(1009, sentinel));
            comm.reduce(std::span<const W>(send.data(), 1009), recv.span(), op, root);
            const std::vector<W> got = to_host(recv);
            if (me == root) {
                const std::string bad = mismatch16(got, 0, 1009, n, op, opt);
                rep.check(bad.empty(), what + ": " + bad);
            } else {
                rep.check(got == std::vector<W>(1009, sentinel), what + ": non-root recv changed");
            }
        }
    }
    for (const std::size_t count : counts) {
        const std::vector<W> in = input(me, count);
        auto send = to_system(comm, in);
        auto recv = to_system(comm, std::vector<W>(count * static_cast<std::size_t>(n), W(0.0f)));
        comm.all_gather(std::span<const W>(send.data(), count), recv.span());
        std::vector<W> want;
        for (int r = 0; r < n; ++r) {
            const std::vector<W> x = input(r, count);
            want.insert(want.end(), x.begin(), x.end());
        }
        rep.check(to_host(recv) == want,
                  "all_gather<" + tn + "> count " + std::to_string(count) + ": not the inputs");
        for (int root = 0; root < n; ++root) {
            auto data = to_system(comm, in);
            comm.broadcast(data.span(), root);
            rep.check(to_host(data) == input(root, count),
                      "broadcast<" + tn + "> root " + std::to_string(root) + " count " +
                          std::to_string(count) + ": not root's input");
        }
    }
}

/// all_to_all_others for every block count: block r != rank() of the result is block rank() of
/// rank r's input, and the own block keeps what recv held before (a sentinel), untouched.
template <class T, all_to_all_others_communicator C>
void check_all_to_all_others(C& comm, suite_report& rep, const std::vector<std::size_t>& blocks) {
    const int n = comm.size(), me = comm.rank();
    const std::size_t ranks = static_cast<std::size_t>(n);
    const T sentinel = input_value<T>(n + 7, 3);
    for (const std::size_t block : blocks) {
        const std::string what =
            "all_to_all_others<" + detail::type_name<T>() + "> block " + std::to_string(block);
        std::vector<T> in(block * ranks);
        for (std::size_t i = 0; i < in.size(); ++i)
            in[i] = input_value<T>(me, i);
        auto send = to_system(comm, in);
        auto recv = to_system(comm, std::vector<T>(block * ranks, sentinel));
        comm.all_to_all_others(std::span<const T>(send.data(), send.size()), recv.span());
        const std::vector<T> got = to_host(recv);
        for (int r = 0; r < n; ++r) {
            const std::string bad = first_mismatch(
                got, static_cast<std::size_t>(r) * block, block,
                [&](std::size_t k) {
                    return r == me ? sentinel
                                   : input_value<T>(r, static_cast<std::size_t>(me) * block + k);
                },
                [](T g, T w, std::size_t) { return detail::same_bits(g, w); });
            rep.check(bad.empty(),
                      what + (r == me ? ", own block (untouched)" : ", block from rank ") +
                          (r == me ? std::string() : std::to_string(r)) + ": " + bad);
        }
        rep.check(to_host(send) == in, what + ": the send buffer changed");
    }
}

/// Every collective for one element type.
template <class T, communicator C>
void check_type(C& comm, suite_report& rep, const suite_options& opt, bool with_large) {
    std::vector<std::size_t> counts{0, 1, 1009, opt.medium_count};
    std::vector<std::size_t> reduce_counts{0, 1, 1009};
    if (with_large)
        reduce_counts.push_back(opt.large_count);
    check_all_reduce<T>(comm, rep, reduce_counts, opt);
    check_broadcast<T>(comm, rep, counts);
    check_all_gather<T>(comm, rep, counts);
    check_reduce<T>(comm, rep, {0, 1, 1009}, opt);
    check_reduce_scatter<T>(comm, rep, opt, opt.medium_count);
    if constexpr (all_to_all_communicator<C>)
        check_all_to_all<T>(comm, rep, {0, 1, 1009, 4099});
    if constexpr (all_to_all_others_communicator<C>)
        check_all_to_all_others<T>(comm, rep, {0, 1, 1009, 4099});
}

/// Every collective for every element type comm carries (float, double, int always; int64
/// and uint8 where the backend accepts them; half and bfloat16 unless float16_collectives<C>
/// is false).
template <communicator C>
void check_all_types(C& comm, suite_report& rep, const suite_options& opt, bool with_large) {
    check_type<float>(comm, rep, opt, with_large);
    check_type<double>(comm, rep, opt, with_large);
    check_type<int>(comm, rep, opt, with_large);
    if constexpr (detail::carries<C, std::int64_t>)
        check_type<std::int64_t>(comm, rep, opt, with_large);
    if constexpr (detail::carries<C, std::uint8_t>)
        check_type<std::uint8_t>(comm, rep, opt, with_large);
    if constexpr (float16_collectives<C>) {
        check_float16<half>(comm, rep, opt);
        check_float16<bfloat16>(comm, rep, opt);
    }
}

/// barrier: returns, repeatedly, on every replica. It counts no check: reaching the checks
/// after it is the test (that it waits is a backend-specific test).
template <communicator C>
void check_barrier(C& comm, suite_report&) {
    for (int k = 0; k < 3; ++k)
        comm.barrier();
}

/// split into even and odd ranks (keys reverse the order), then collectives on the sub-group;
/// the two sub-groups run different sequences of collectives at the same time.
template <communicator C>
void check_split(C& comm, suite_report& rep, const suite_options& opt) {
    const int n = comm.size(), me = comm.rank();
    const int color = me % 2;
    C sub = comm.split(color, -me);
    std::vector<int> expected_members; // parent ranks in sub-group rank order
    for (int r = n - 1; r >= 0; --r)
        if (r % 2 == color)
            expected_members.push_back(r);
    const auto pos = std::find(expected_members.begin(), expected_members.end(), me);
    rep.check(sub.size() == static_cast<int>(expected_members.size()),
              "split: sub-group size " + std::to_string(sub.size()) + ", expected " +
                  std::to_string(expected_members.size()));
    rep.check(sub.rank() == static_cast<int>(pos - expected_members.begin()),
              "split: sub-group rank " + std::to_string(sub.rank()) + ", expected " +
                  std::to_string(pos - expected_members.begin()));
    if (sub.size() != static_cast<int>(expected_members.size()))
        return;

    const std::vector<int> members = gather_ints(sub, {me});
    rep.check(members == expected_members, "split: all_gather of parent ranks in the sub-group "
                                           "is not the parent ranks of colour " +
                                               std::to_string(color) + " by descending rank");
    if (color == 1)
        check_broadcast<double>(sub, rep, {3, 1009}); // only the odd group
    suite_report sub_rep;
    sub_rep.rank = sub.rank();
    sub_rep.size = sub.size();
    check_all_reduce<float>(sub, sub_rep, {1, 1009, 4099}, opt);
    check_all_reduce<int>(sub, sub_rep, {1009}, opt);
    check_reduce<double>(sub, sub_rep, {1009}, opt);
    check_all_gather<int>(sub, sub_rep, {1009});
    check_reduce_scatter<float>(sub, sub_rep, opt, 4099);
    check_broadcast<float>(sub, sub_rep, {1009});
    if constexpr (all_to_all_communicator<C>)
        check_all_to_all<int>(sub, sub_rep, {1, 1009});
    for (auto& f : sub_rep.failures)
        f = "split(colour " + std::to_string(color) + ") " + f;
    rep.merge(sub_rep);
}

/// Point-to-point: a ring exchange, FIFO order of messages with one tag, and recv_any
/// collecting one message from every other rank.
template <point_to_point_communicator C>
void check_point_to_point(C& comm, suite_report& rep) {
    const int n = comm.size(), me = comm.rank();
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const std::size_t count = 257;
    const auto payload = [&](int from, int k) {
        std::vector<float> v(count);
        for (std::size_t i = 0; i < count; ++i)
            v[i] = input_value<float>(from * 8 + k, i);
        return v;
    };
    for (int k = 0; k < 3; ++k) { // three messages with one tag: received in order
        auto out = to_system(comm, payload(me, k));
        comm.send(std::span<const float>(out.data(), count), next, 11);
    }
    for (int k = 0; k < 3; ++k) {
        auto in = to_system(comm, std::vector<float>(count, 0.0f));
        comm.recv(in.span(), prev, 11);
        const std::vector<float> want = payload(prev, k);
        rep.check(to_host(in) == want,
                  "ring recv from rank " + std::to_string(prev) + ": message " + std::to_string(k) +
                      " of tag 11 is not the one sent " + std::to_string(k) + "th");
    }
    comm.barrier();
    if (me != 0) {
        std::vector<int> v(count);
        for (std::size_t i = 0; i < count; ++i)
            v[i] = me * 1000 + static_cast<int>(i);
        auto out = to_system(comm, v);
        comm.send(std::span<const int>(out.data(), count), 0, 23);
    } else {
        std::vector<int> seen(static_cast<std::size_t>(n), 0);
        for (int k = 1; k < n; ++k) {
            auto in = to_system(comm, std::vector<int>(count, -1));
            const int src = comm.recv_any(in.span(), 23);
            const bool valid = src > 0 && src < n;
            rep.check(valid, "recv_any returned source " + std::to_string(src));
            if (!valid)
                continue;
            ++seen[static_cast<std::size_t>(src)];
            const std::vector<int> got = to_host(in);
            bool right = true;
            for (std::size_t i = 0; i < count; ++i)
                right = right && got[i] == src * 1000 + static_cast<int>(i);
            rep.check(right,
                      "recv_any: the data is not what rank " + std::to_string(src) + " sent");
        }
        for (int r = 1; r < n; ++r)
            rep.check(seen[static_cast<std::size_t>(r)] == 1,
                      "recv_any received " + std::to_string(seen[static_cast<std::size_t>(r)]) +
                          " messages from rank " + std::to_string(r) + ", expected 1");
    }
    comm.barrier();
}

/// The whole suite on one replica: every collective x type x reduction x count, broadcast and
/// reduce from every root, split, and point-to-point where the backend has it.
/// ensures: the returned report lists every failed check of this replica.
template <communicator C>
suite_report run_collective_suite(C& comm, const suite_options& opt = {}) {
    suite_report rep;
    rep.rank = comm.rank();
    rep.size = comm.size();
    check_barrier(comm, rep);
    check_all_types(comm, rep, opt, true);
    check_split(comm, rep, opt);
    if constexpr (point_to_point_communicator<C>)
        check_point_to_point(comm, rep);
    check_barrier(comm, rep);
    return rep;
}

} // namespace lockstep::testing

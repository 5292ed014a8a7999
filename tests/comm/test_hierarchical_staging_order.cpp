// hierarchical_communicator's staging order, on the host: every inter-node step's staging is
// reserved before the intra-node part enqueues the collective that step waits for (the CUDA
// staging allocates pinned memory only then). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/system/host_system.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace {

/// A stand-in for a device system (host memory underneath), so that the test's staging below
/// is the one hierarchical_communicator picks.
struct recording_system {
    static constexpr bool is_host = false;
};

/// What happened, in order: "reserve", "enqueue <op>" (the intra-node part), "inter" (an
/// inter-node step), and the reserve/need sizes.
struct order_log {
    std::vector<std::string> events;
    std::size_t reserved_out = 0, reserved_in = 0;
    std::vector<std::string> violations;
    void clear() { *this = order_log{}; }
};
order_log the_log;

/// One replica as a whole group (rank 0 of 1): each collective copies send to recv and, for the
/// intra-node part, logs its enqueue.
template <class System, bool Logged>
struct solo_comm {
    using system_type = System;
    System system() const { return {}; }
    int rank() const { return 0; }
    int size() const { return 1; }

    void log(const char* op) {
        if constexpr (Logged)
            the_log.events.push_back(std::string("enqueue ") + op);
    }
    template <class T>
    static void copy(std::span<const T> send, std::span<T> recv) {
        if (!send.empty() && send.data() != recv.data())
            std::memmove(recv.data(), send.data(), send.size_bytes());
    }
    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> s, std::span<T> r,
                    lockstep::reduce_op) {
        log("all_reduce");
        copy<T>(s, r);
    }
    template <class T>
    void broadcast(std::span<T>, int) {
        log("broadcast");
    }
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> s, std::span<T> r) {
        log("all_gather");
        copy<T>(s, r);
    }
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> s, std::span<T> r, lockstep::reduce_op,
                int) {
        log("reduce");
        copy<T>(s, r);
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> s, std::span<T> r,
                        std::span<const std::size_t>, lockstep::reduce_op) {
        log("reduce_scatter");
        copy<T>(s, r);
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> s, std::span<T> r,
                        lockstep::reduce_op) {
        log("reduce_scatter");
        copy<T>(s, r);
    }
    template <class T>
    void all_to_all(std::span<const std::type_identity_t<T>> s, std::span<T> r) {
        log("all_to_all");
        copy<T>(s, r);
    }
    void barrier() { log("barrier"); }
    solo_comm split(int, int) { return {}; }
    void synchronize() {}
};

using intra_comm = solo_comm<recording_system, true>;
using inter_comm = solo_comm<lockstep::host_system, false>;
static_assert(lockstep::communicator<intra_comm> && lockstep::communicator<inter_comm>);

} // namespace

namespace lockstep::detail {

template <>
inline constexpr bool hierarchical_systems_supported<recording_system, host_system> = true;

/// The contract of the CUDA staging, recorded: reserve() sizes the pinned slots; inter() needs
/// them sized (out.size(), plus in.size() when `in` is not inside `out`).
template <>
class hierarchical_staging<recording_system, host_system> {
public:
    template <class T, class Intra>
    std::span<T> scratch(Intra&, int slot, std::size_t n) {
        std::vector<std::uint64_t>& s = slot == 0 ? scratch0_ : scratch1_;
        s.resize(std::max(s.size(), (n * sizeof(T) + 7) / 8));
        return std::span<T>(reinterpret_cast<T*>(s.data()), n);
    }
    template <class T, class Intra>
    void copy(Intra&, std::span<T> dst, std::span<const T> src) {
        if (!src.empty())
            std::memcpy(dst.data(), src.data(), src.size_bytes());
    }
    template <class T, class Intra>
    void reserve(Intra&, std::size_t out_n, std::size_t in_n) {
        the_log.events.emplace_back("reserve");
        the_log.reserved_out = std::max(the_log.reserved_out, out_n * sizeof(T));
        the_log.reserved_in = std::max(the_log.reserved_in, in_n * sizeof(T));
    }
    template <class T, class Intra, class F>
    void inter(Intra&, std::span<const T> in, std::span<T> out, F&& f) {
        const auto* in_at = reinterpret_cast<const char*>(in.data());
        const auto* out_at = reinterpret_cast<const char*>(out.data());
        const bool nested =
            !in.empty() && in_at >= out_at && in_at + in.size_bytes() <= out_at + out.size_bytes();
        const std::size_t need_in = nested ? 0 : in.size_bytes();
        if (the_log.reserved_out < out.size_bytes() || the_log.reserved_in < need_in)
            the_log.violations.push_back("inter needs " + std::to_string(out.size_bytes()) + "+" +
                                         std::to_string(need_in) + " bytes, reserved " +
                                         std::to_string(the_log.reserved_out) + "+" +
                                         std::to_string(the_log.reserved_in));
        the_log.events.emplace_back("inter");
        f(in, out);
    }
    template <class T, class Intra, class F>
    void on_host(Intra&, std::span<const T> in, std::span<T> out, F&& f) {
        f(in, out);
    }

private:
    std::vector<std::uint64_t> scratch0_, scratch1_;
};

} // namespace lockstep::detail

namespace {

using hier = lockstep::hierarchical_communicator<intra_comm, inter_comm>;

/// Runs one collective from a fresh log and checks the order: a reserve before the first
/// intra-node enqueue, large enough for every inter-node step.
void check_order(const char* name, const std::function<void()>& call) {
    the_log.clear();
    call();
    CAPTURE(name);
    std::string seen;
    for (const auto& e : the_log.events)
        seen += e + "; ";
    CAPTURE(seen);
    const auto first = [&](const std::string& prefix) {
        return std::find_if(the_log.events.begin(), the_log.events.end(),
                            [&](const std::string& e) { return e.rfind(prefix, 0) == 0; });
    };
    REQUIRE(first("inter") != the_log.events.end());
    REQUIRE(first("enqueue") != the_log.events.end());
    CHECK(first("reserve") < first("enqueue"));
    for (const auto& v : the_log.violations) {
        CAPTURE(v);
        CHECK(v.empty());
    }
}

} // namespace

TEST_CASE("hierarchical_communicator reserves its staging before the intra-node enqueue",
          "[comm][hierarchical]") {
    hier comm(intra_comm{}, inter_comm{});
    std::vector<float> a(37, 1.0f), b(37, 0.0f);
    std::vector<double> big(3 * hier::sharded_from, 2.0);
    check_order("all_reduce", [&] {
        comm.all_reduce(std::span<const float>(a), std::span<float>(b), lockstep::reduce_op::sum);
    });
    check_order("all_reduce (in place, larger)", [&] {
        comm.all_reduce(std::span<const double>(big), std::span<double>(big),
                        lockstep::reduce_op::sum);
    });
    check_order("broadcast", [&] { comm.broadcast(std::span<float>(a), 0); });
    check_order("all_gather",
                [&] { comm.all_gather(std::span<const float>(a), std::span<float>(b)); });
    check_order("reduce", [&] {
        comm.reduce(std::span<const float>(a), std::span<float>(b), lockstep::reduce_op::max, 0);
    });
    check_order("reduce_scatter", [&] {
        comm.reduce_scatter(std::span<const float>(a), std::span<float>(b),
                            lockstep::reduce_op::sum);
    });
    check_order("all_to_all",
                [&] { comm.all_to_all(std::span<const float>(a), std::span<float>(b)); });
}

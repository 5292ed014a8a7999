// lockstep/comm/simulated_link.hpp: simulated_link<Communicator>, a communicator that runs another
// one's collectives and then idles for the wire time of a modelled network link.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/tag_forwarding.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

namespace lockstep {

/// The operations the link model tells apart.
enum class link_op {
    all_reduce,
    reduce,
    broadcast,
    all_gather,
    barrier,
    point_to_point,
    reduce_scatter
};

/// The name of a link operation, e.g. "all_reduce".
constexpr std::string_view to_string(link_op op) noexcept {
    switch (op) {
    case link_op::all_reduce:
        return "all_reduce";
    case link_op::reduce:
        return "reduce";
    case link_op::broadcast:
        return "broadcast";
    case link_op::all_gather:
        return "all_gather";
    case link_op::barrier:
        return "barrier";
    case link_op::point_to_point:
        return "point_to_point";
    case link_op::reduce_scatter:
        return "reduce_scatter";
    }
    return "unknown";
}

/// The link every replica is modelled to sit behind (designated initialisers:
/// `{.latency = std::chrono::microseconds(20), .bandwidth = 1.25e9}` is 10 Gb/s Ethernet).
struct simulated_link_params {
    /// Paid once by every collective and every message (a link crossing, not per hop).
    std::chrono::microseconds latency{0};
    /// Bytes per second each replica's link carries in each direction. > 0.
    double bandwidth = 1.25e9;
    /// Each call's wire time is multiplied by (1 + jitter * u), u uniform in [0, 1) from a
    /// counter-based hash (SplitMix64) of (seed, rank, call index): deterministic, different per
    /// replica. >= 0.
    double jitter = 0.0;
    /// The key of the jitter stream.
    std::uint64_t seed = 0;
    /// The rank (of the communicator given at construction) whose wire times are multiplied by
    /// slow_factor: a straggler. -1: none.
    int slow_rank = -1;
    /// >= 1 when slow_rank is set.
    double slow_factor = 1.0;
};

namespace detail {
/// A uniform double in [0, 1) from (seed, rank, call): SplitMix64's finaliser over the three
/// keys (comm/ sits beside kernels/, so it does not use kernels' Philox for this).
inline double jitter_uniform(std::uint64_t seed, std::uint64_t rank, std::uint64_t call) {
    std::uint64_t z = seed;
    for (const std::uint64_t k : {rank, call}) {
        z += 0x9e3779b97f4a7c15ull + k;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
    }
    return static_cast<double>(z >> 11) * 0x1.0p-53;
}
} // namespace detail

/// The modelled wire time of one operation over `size` replicas, jitter and slow rank aside:
/// latency + wire bytes / bandwidth, with wire bytes per replica (bytes = this replica's send
/// bytes, recv bytes for all_gather):
/// - all_reduce: 2 (n-1)/n x bytes (ring: reduce-scatter, then all-gather);
/// - all_gather: (n-1)/n x recv bytes (ring);
/// - reduce_scatter: (n-1)/n x send bytes (ring);
/// - reduce and broadcast: bytes (a pipelined chain from or to the root);
/// - barrier: latency only; point_to_point: bytes.
/// A group of one replica crosses no link: 0.
inline std::chrono::nanoseconds link_wire_time(const simulated_link_params& p, link_op op,
                                               std::size_t bytes, int size) noexcept {
    if (size <= 1)
        return std::chrono::nanoseconds(0);
    const double n = size, b = static_cast<double>(bytes);
    double wire = 0;
    switch (op) {
    case link_op::all_reduce:
        wire = 2 * (n - 1) / n * b;
        break;
    case link_op::all_gather:
    case link_op::reduce_scatter:
        wire = (n - 1) / n * b;
        break;
    case link_op::reduce:
    case link_op::broadcast:
    case link_op::point_to_point:
        wire = b;
        break;
    case link_op::barrier:
        break;
    }
    return std::chrono::duration_cast<std::chrono::nanoseconds>(p.latency) +
           std::chrono::nanoseconds(static_cast<std::int64_t>(wire / p.bandwidth * 1e9));
}

/// Wraps a communicator (held by reference, or owned when constructed from an rvalue) and makes
/// each of its operations take at least the wire time of a modelled link (link_wire_time, times
/// this replica's jitter and slow factor):
/// - A collective first agrees on its start, the latest entry time over the replicas (an
///   all_reduce max of one double through the wrapped communicator; the replicas share one
///   steady clock, i.e. run on one machine), runs the wrapped collective, then sleeps until
///   start + wire time. The sleep is sleep_until, not spinning: like a real NIC moving data,
///   the idle replica leaves its cores to compute (other threads, other replicas).
/// - Each replica sleeps its own wire time; a slower replica (slow_rank, jitter) delays its
///   peers at their next collective with it, where they wait for it inside the wrapped
///   communicator, with that communicator's timeout.
/// - send sleeps for the message's wire time, then sends (so the message arrives no earlier
///   than the link allows); recv and recv_any (also with on_timeout, where the wrapped one is a
///   named_timeout_communicator) are the wrapped ones. split is not delayed.
/// Results are the wrapped communicator's, bit for bit, and everything it checks still holds:
/// mismatched calls, peer failures and timeouts throw the same lockstep::error (the sequence
/// numbers in its messages count the start agreements too). Each collective takes a
/// collective_tag (default: its caller's call site) and hands it to the wrapped collective when
/// that takes one, so named calls and call-site checks (thread_group_params::check_call_sites)
/// see the caller, not this file; the start agreement is tagged "simulated_link.start". A
/// one-replica group is not delayed.
/// Models communicator, and point_to_point_communicator when the wrapped one does. A handle is
/// used by one thread at a time; movable, not copyable.
template <communicator Communicator>
class simulated_link {
public:
    using inner_type = Communicator;
    using system_type = typename Communicator::system_type;
    using params = simulated_link_params;
    using clock = std::chrono::steady_clock;

    /// The link's collectives run on no core of the replicas while they idle (they sleep out
    /// the wire time), so overlapping them with compute pays, as with a real network.
    static constexpr bool collectives_use_compute_cores = false;

    /// Wraps `inner` by reference. requires: inner outlives this link; p valid (bandwidth > 0,
    /// jitter >= 0, slow_factor >= 1, -1 <= slow_rank < inner.size()).
    explicit simulated_link(Communicator& inner, params p = {})
        : inner_(&inner), params_(p), stamp_(1, inner.system()) {
        validate();
        slow_ = p.slow_rank >= 0 && p.slow_rank == inner.rank();
    }
    /// Wraps `inner` and owns it (e.g. a split of another communicator).
    explicit simulated_link(Communicator&& inner, params p = {})
        : owned_(std::make_unique<Communicator>(std::move(inner))), inner_(owned_.get()),
          params_(p), stamp_(1, inner_->system()) {
        validate();
        slow_ = p.slow_rank >= 0 && p.slow_rank == inner_->rank();
    }
    simulated_link(simulated_link&&) noexcept = default;
    simulated_link& operator=(simulated_link&&) noexcept = default;
    simulated_link(const simulated_link&) = delete;
    simulated_link& operator=(const simulated_link&) = delete;

    int rank() const { return inner_->rank(); }
    int size() const { return inner_->size(); }
    system_type system() const { return inner_->system(); }
    Communicator& inner() noexcept { return *inner_; }
    /// The inner communicator's flight_recorder: every call is forwarded, and recorded, there,
    /// each collective after the link's own one-element all_reduce (the common start time).
    decltype(auto) trace() const requires requires(const Communicator& c) { c.trace(); }
    { return inner_->trace(); }
    const params& parameters() const noexcept { return params_; }
    /// Whether this replica is the slow one.
    bool slow() const noexcept { return slow_; }

    /// This replica's wire time of an operation of `bytes` that is its `call`-th: the model
    /// (link_wire_time) times (1 + jitter * u(call)) and slow_factor on the slow rank.
    std::chrono::nanoseconds wire_time(link_op op, std::size_t bytes, std::uint64_t call) const {
        const auto base = link_wire_time(params_, op, bytes, size());
        double factor = slow_ ? params_.slow_factor : 1.0;
        if (params_.jitter > 0)
            factor *= 1.0 + params_.jitter *
                                detail::jitter_uniform(params_.seed,
                                                       static_cast<std::uint64_t>(rank()), call);
        return std::chrono::nanoseconds(
            static_cast<std::int64_t>(static_cast<double>(base.count()) * factor));
    }
    /// Operations delayed so far (the call index of the next one).
    std::uint64_t calls() const noexcept { return calls_; }
    /// The sum of the wire times modelled so far, and the time spent sleeping for them.
    std::chrono::nanoseconds modelled() const noexcept { return modelled_; }
    std::chrono::nanoseconds idled() const noexcept { return idled_; }

    /// The collectives. tag: see collective_tag; forwarded when the wrapped collective takes
    /// one (else dropped).
    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                    collective_tag tag = {}) {
        collective(link_op::all_reduce, send.size_bytes(),
                   [&] { detail::with_tag(*inner_, tag).all_reduce(send, recv, op); });
    }
    template <class T>
    void broadcast(std::span<T> data, int root, collective_tag tag = {}) {
        collective(link_op::broadcast, data.size_bytes(),
                   [&] { detail::with_tag(*inner_, tag).broadcast(data, root); });
    }
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    collective_tag tag = {}) {
        collective(link_op::all_gather, recv.size_bytes(),
                   [&] { detail::with_tag(*inner_, tag).all_gather(send, recv); });
    }
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root, collective_tag tag = {}) {
        collective(link_op::reduce, send.size_bytes(),
                   [&] { detail::with_tag(*inner_, tag).reduce(send, recv, op, root); });
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op,
                        collective_tag tag = {}) {
        collective(link_op::reduce_scatter, send.size_bytes(),
                   [&] { detail::with_tag(*inner_, tag).reduce_scatter(send, recv, counts, op); });
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op, collective_tag tag = {}) {
        collective(link_op::reduce_scatter, send.size_bytes(),
                   [&] { detail::with_tag(*inner_, tag).reduce_scatter(send, recv, op); });
    }
    void barrier(collective_tag tag = {}) {
        collective(link_op::barrier, 0, [&] { detail::with_tag(*inner_, tag).barrier(); });
    }

    /// The wrapped split, wrapped in an owning link with the same parameters. The slow replica
    /// stays the slow one (slow_rank becomes its rank in the sub-group, or -1 on the others);
    /// the jitter stream of a sub-group is keyed by the colour too.
    simulated_link split(int color, int key) {
        Communicator sub = inner_->split(color, key);
        params p = params_;
        p.slow_rank = slow_ ? sub.rank() : -1;
        p.seed = params_.seed ^ (0x9E3779B97F4A7C15ull * (static_cast<std::uint64_t>(color) + 1));
        return simulated_link(std::move(sub), p);
    }

    /// Sleeps for the message's wire time, then sends it through the wrapped communicator.
    template <class T>
    void send(std::span<T> data, int dest,
              int tag) requires point_to_point_communicator<Communicator> {
        const auto wire = wire_time(link_op::point_to_point, data.size_bytes(), calls_++);
        idle_until(clock::now() + wire, wire);
        inner_->send(data, dest, tag);
    }
    template <class T>
    void recv(std::span<T> data, int source,
              int tag) requires point_to_point_communicator<Communicator> {
        inner_->recv(data, source, tag);
    }
    template <class T>
    int recv_any(std::span<T> data, int tag) requires point_to_point_communicator<Communicator> {
        return inner_->recv_any(data, tag);
    }
    template <class T, class OnTimeout>
    void recv(std::span<T> data, int source, int tag,
              OnTimeout&& on_timeout) requires named_timeout_communicator<Communicator> {
        inner_->recv(data, source, tag, on_timeout);
    }
    template <class T, class OnTimeout>
    int recv_any(std::span<T> data, int tag,
                 OnTimeout&& on_timeout) requires named_timeout_communicator<Communicator> {
        return inner_->recv_any(data, tag, on_timeout);
    }

    /// Forwarded where the wrapped communicator has them (trainers ask for these).
    int replica() const requires requires(const Communicator& c) { c.replica(); }
    { return inner_->replica(); }
    void abort() noexcept requires requires(Communicator& c) { c.abort(); }
    { inner_->abort(); }
    bool aborted() const noexcept requires requires(const Communicator& c) { c.aborted(); }
    { return inner_->aborted(); }
    void synchronize() requires requires(Communicator& c) { c.synchronize(); }
    { inner_->synchronize(); }
    template <class Event>
    void wait(Event event, const char* what) requires requires(Communicator& c) {
        c.wait(event, what);
    }
    { inner_->wait(event, what); }

    /// This object's communicator_identity (identified_communicator): what caches of state
    /// derived from the communicator are keyed by.
    std::uint64_t identity() const noexcept { return identity_.value(); }

private:
    void validate() const {
        const int me = inner_->rank();
        LOCKSTEP_REQUIRE(params_.bandwidth > 0, errc::invalid_argument, me, "simulated_link",
                         "bandwidth ", params_.bandwidth, " B/s must be positive");
        LOCKSTEP_REQUIRE(params_.latency.count() >= 0, errc::invalid_argument, me, "simulated_link",
                         "latency ", params_.latency.count(), " us must not be negative");
        LOCKSTEP_REQUIRE(params_.jitter >= 0, errc::invalid_argument, me, "simulated_link",
                         "jitter ", params_.jitter, " must not be negative");
        LOCKSTEP_REQUIRE(params_.slow_rank >= -1 && params_.slow_rank < inner_->size(),
                         errc::invalid_argument, me, "simulated_link", "slow_rank ",
                         params_.slow_rank, " is neither -1 nor a rank of this group of ",
                         inner_->size());
        LOCKSTEP_REQUIRE(params_.slow_rank < 0 || params_.slow_factor >= 1, errc::invalid_argument,
                         me, "simulated_link", "slow_factor ", params_.slow_factor,
                         " must be at least 1");
    }

    /// Agrees on the start (latest entry), runs the wrapped collective, idles out the wire time.
    template <class Inner>
    void collective(link_op op, std::size_t bytes, Inner&& inner_call) {
        if (inner_->size() <= 1) {
            inner_call();
            return;
        }
        const auto start = common_start(clock::now());
        const auto wire = wire_time(op, bytes, calls_++);
        inner_call();
        idle_until(start + wire, wire);
    }

    /// The latest of the replicas' entry times (an all_reduce max through the wrapped
    /// communicator, in the memory of its system; named "simulated_link.start").
    clock::time_point common_start(clock::time_point entry) {
        double ns[1] = {static_cast<double>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(entry.time_since_epoch())
                .count())};
        lockstep::copy(std::span<const double>(ns), host_system{}, stamp_.span(), stamp_.system());
        const std::span<const double> send(stamp_.data(), 1);
        const collective_tag tag("simulated_link.start");
        detail::with_tag(*inner_, tag).all_reduce(send, stamp_.span(), reduce_op::max);
        lockstep::copy(std::span<const double>(stamp_.data(), 1), stamp_.system(),
                       std::span<double>(ns), host_system{});
        return clock::time_point(std::chrono::duration_cast<clock::duration>(
            std::chrono::nanoseconds(static_cast<std::int64_t>(ns[0]))));
    }

    void idle_until(clock::time_point until, std::chrono::nanoseconds wire) {
        modelled_ += wire;
        const auto now = clock::now();
        if (until <= now)
            return;
        std::this_thread::sleep_until(until);
        idled_ += std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - now);
    }

    std::unique_ptr<Communicator> owned_;
    Communicator* inner_;
    params params_;
    buffer<double, system_type> stamp_; ///< the start agreement's one double
    bool slow_ = false;
    std::uint64_t calls_ = 0;
    std::chrono::nanoseconds modelled_{0};
    std::chrono::nanoseconds idled_{0};
    communicator_identity identity_;
};

} // namespace lockstep

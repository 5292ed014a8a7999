// lockstep/comm/detail/mpi_handle.hpp: what every operation of mpi_communicator stands on:
// the owned duplicates of the MPI communicator, the signature each collective is verified with,
// the polled waits against the timeout with the census of missing peers, the broken state and
// the flight recorder (and mpi_failure_action, mpi_communicator_params).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/mpi_exit_guard.hpp"
#include "lockstep/comm/detail/mpi_progress.hpp"
#include "lockstep/comm/detail/mpi_signature.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

namespace lockstep {

/// What an mpi_communicator does once a wait timed out or an MPI call failed inside an
/// operation (the communicator is broken either way).
enum class mpi_failure_action {
    abort,      ///< print the error to stderr and end the job (MPI_Abort on MPI_COMM_WORLD, with
                ///< status exit_status(e): 75 for a timeout, which tools/lockstep-run relaunches)
    throw_error ///< throw the error; the caller must end the job (e.g. abort(e))
};

/// Runtime options of mpi_communicator.
struct mpi_communicator_params {
    bool verify = true; ///< exchange a signature before each collective (see mpi_communicator)
    /// How long one MPI operation may wait for the peers (default: LOCKSTEP_TIMEOUT seconds
    /// when set, else 300 s). requires: > 0.
    std::chrono::milliseconds timeout = default_timeout(std::chrono::seconds(300));
    /// What happens after a timeout or an MPI failure inside an operation.
    mpi_failure_action on_failure = mpi_failure_action::abort;
    /// With verification: whether collectives without a collective_tag name compare their call
    /// sites, so two calls of the same collective and shape issued in another order (or one
    /// skipped) are an error instead of a wrong value (see collective_tag). Every replica must
    /// use the same value. Default: default_check_call_sites(), i.e. LOCKSTEP_CHECK_CALL_SITES
    /// (1 on, 0 off); unset, on in builds without NDEBUG and off with NDEBUG.
    bool check_call_sites = default_check_call_sites();
};

namespace detail {

/// Keeps a block that an MPI request left outstanding by a failed operation may still read or
/// write (a timeout cannot cancel a collective: MPI completes it when the peers arrive): never
/// freed, and reachable, so leak checkers do not report it.
inline void keep_forever(const void* block) noexcept {
    if (block == nullptr)
        return;
    static std::mutex m;
    // Out of memory in this one first-use allocation ends the process (noexcept).
    // NOLINTNEXTLINE(bugprone-unhandled-exception-at-new)
    static auto* kept = new std::vector<const void*>();
    const std::lock_guard<std::mutex> lock(m);
    try {
        kept->push_back(block);
    } catch (...) { // out of memory: then merely unreachable, still never freed
    }
}

/// n value-initialised elements of T on the heap that the library hands to MPI as a request's
/// buffer (the signature, reduce's copy, the 16-bit exchange, ...): freed at the end of the
/// scope, unless `broken` was set meanwhile (the operation failed, so its request may be
/// outstanding): then kept forever (keep_forever), as the census keeps its buffers.
template <class T>
class mpi_request_buffer {
    static_assert(std::is_trivially_destructible_v<T>);

public:
    mpi_request_buffer(const std::optional<error>& broken, std::size_t n)
        : broken_(&broken), data_(n == 0 ? nullptr : new T[n]()), size_(n) {}
    mpi_request_buffer(const mpi_request_buffer&) = delete;
    mpi_request_buffer& operator=(const mpi_request_buffer&) = delete;
    ~mpi_request_buffer() {
        if (broken_->has_value())
            keep_forever(data_.release());
    }
    T* data() const noexcept { return data_.get(); }
    std::size_t size() const noexcept { return size_; }
    std::span<T> span() const noexcept { return {data_.get(), size_}; }

private:
    const std::optional<error>* broken_;
    std::unique_ptr<T[]> data_;
    std::size_t size_;
};

/// Guards objects whose storage an MPI request reads until it completes (the count and
/// displacement arrays of a vector collective: MPI may read them until then): declared after
/// them, it moves them to the heap and keeps them forever (keep_forever) when `broken` was set
/// meanwhile, so a timed-out request never reads freed arrays. A moved std::vector keeps its
/// buffer, which is what the request holds.
template <class... V>
class mpi_request_arrays {
public:
    explicit mpi_request_arrays(const std::optional<error>& broken, V&... v)
        : broken_(&broken), v_(v...) {}
    mpi_request_arrays(const mpi_request_arrays&) = delete;
    mpi_request_arrays& operator=(const mpi_request_arrays&) = delete;
    ~mpi_request_arrays() {
        if (!broken_->has_value())
            return;
        try {
            keep_forever(
                std::apply([](V&... v) { return new std::tuple<V...>(std::move(v)...); }, v_));
        } catch (...) { // out of memory: the arrays go with their owners
        }
    }

private:
    const std::optional<error>* broken_;
    std::tuple<V&...> v_;
};

/// One process's handle on an MPI communicator, the base of mpi_communicator (whose comment
/// states what it guarantees): it owns a duplicate of the communicator for the operations and
/// one for the census of a timed-out replica (mpi_control), numbers and verifies collectives
/// (begin), waits for their requests within the timeout (finish) and, once an operation
/// failed, keeps the communicator broken (poison). detail::mpi_messages adds the
/// point-to-point messages (comm/detail/mpi_messages.hpp), mpi_communicator the collectives.
class mpi_handle {
public:
    using system_type = host_system;
    using params = mpi_communicator_params;
    mpi_handle(const mpi_handle&) = delete;
    mpi_handle& operator=(const mpi_handle&) = delete;

    int rank() const noexcept { return rank_; }
    int size() const noexcept { return size_; }
    /// A host_system whose thread budget is OMP_NUM_THREADS when set, else the node's cores
    /// divided by the processes of this group on the node (for a split, those of the group it
    /// was split from).
    host_system system() const { return host_system(host_system::process_threads(node_ranks_)); }
    /// The owned MPI communicator (MPI_COMM_NULL after a move).
    MPI_Comm native() const noexcept { return comm_; }
    /// True when the processes run on more than one node: collectives then cross a network
    /// instead of running as shared-memory copies on the compute cores.
    bool spans_nodes() const noexcept { return node_ranks_ < size_; }
    bool verifying() const noexcept { return params_.verify; }
    /// How long one MPI operation may wait for the peers.
    std::chrono::milliseconds timeout() const noexcept { return params_.timeout; }
    /// Sets the timeout of later operations. requires: t > 0.
    void set_timeout(std::chrono::milliseconds t) {
        LOCKSTEP_REQUIRE(t.count() > 0, errc::invalid_argument, rank_, "mpi_communicator",
                         "timeout ", t.count(), " ms must be positive");
        params_.timeout = t;
    }
    /// True once an operation timed out or an MPI call failed inside one: every later call
    /// throws the first failure again.
    bool broken() const noexcept { return broken_.has_value(); }
    /// The number of collectives this communicator has started (the "#n" in error messages).
    std::int64_t sequence() const noexcept { return seq_; }
    /// This handle's record of its last collectives (flight_recorder): written to stderr and
    /// LOCKSTEP_TRACE_DIR when an operation times out or the replicas disagree.
    const flight_recorder& trace() const noexcept { return trace_; }

    /// Ends every process of the job (MPI_Abort on MPI_COMM_WORLD, since peers outside this
    /// sub-group may wait for this process too). Use when this replica cannot continue.
    [[noreturn]] void abort(int code = 1) const noexcept {
        MPI_Abort(MPI_COMM_WORLD, code);
        std::abort();
    }
    /// Prints "lockstep: replica R of N aborting: <what>" to stderr, then abort(code).
    [[noreturn]] void abort(const std::exception& e, int code = 1) const noexcept {
        std::fprintf(stderr, "lockstep: replica %d of %d aborting: %s\n", rank_, size_, e.what());
        std::fflush(stderr);
        abort(code);
    }

protected:
    // mpi_communicator's constructor (comm/mpi_communicator.hpp).
    explicit mpi_handle(MPI_Comm comm, params p = {}) : params_(p) {
        int initialized = 0;
        LOCKSTEP_MPI_CHECK(MPI_Initialized(&initialized));
        LOCKSTEP_REQUIRE(initialized, errc::invalid_argument, -1, "mpi_communicator",
                         "MPI is not initialised: create a lockstep::mpi_environment first");
        LOCKSTEP_REQUIRE(comm != MPI_COMM_NULL, errc::invalid_argument, -1, "mpi_communicator",
                         "comm is MPI_COMM_NULL");
        LOCKSTEP_REQUIRE(p.timeout.count() > 0, errc::invalid_argument, -1, "mpi_communicator",
                         "timeout ", p.timeout.count(), " ms must be positive");
        // This process's place, for the timeout's message (setup() takes them from the dup).
        LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm, &rank_));
        LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm, &size_));
        // Nonblocking, so that a process that never joins makes this a timeout, not a hang.
        MPI_Request dup = MPI_REQUEST_NULL;
        LOCKSTEP_MPI_CHECK(MPI_Comm_idup(comm, &comm_, &dup));
        bool done = false;
        LOCKSTEP_MPI_CHECK(
            detail::mpi_poll([&](int& flag) { return MPI_Test(&dup, &flag, MPI_STATUS_IGNORE); },
                             deadline_after<detail::mpi_clock>(p.timeout), control_, 0, done));
        if (!done) {
            const error e(errc::timeout, rank_, "mpi_communicator",
                          detail::concat("MPI_Comm_idup did not complete within ",
                                         p.timeout.count(),
                                         " ms: a process of the communicator did not construct "
                                         "its mpi_communicator"));
            if (p.on_failure == mpi_failure_action::abort)
                abort(e, exit_status(e));
            throw e;
        }
        try {
            setup();
            // The cores of a node are shared by every process on it that this group knows of.
            MPI_Comm node = MPI_COMM_NULL;
            LOCKSTEP_MPI_CHECK(
                MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
            LOCKSTEP_MPI_CHECK(MPI_Comm_size(node, &node_ranks_));
            LOCKSTEP_MPI_CHECK(MPI_Comm_free(&node));
            check_same_checks();
        } catch (...) {
            release();
            throw;
        }
    }
    mpi_handle(mpi_handle&& o) noexcept { take(o); }
    mpi_handle& operator=(mpi_handle&& o) noexcept {
        if (this != &o) {
            release();
            take(o);
        }
        return *this;
    }
    ~mpi_handle() { release(); }

    // An empty handle (message_view fills it in).
    mpi_handle() = default;

    // Adopts an MPI communicator made by split (already a fresh communicator: no dup).
    mpi_handle(MPI_Comm adopted, params p, int node_ranks)
        : comm_(adopted), params_(p), node_ranks_(node_ranks) {
        try {
            setup();
        } catch (...) {
            release();
            throw;
        }
    }

    /// params::verify (and, when it is on, params::check_call_sites) must be the same on every
    /// replica: a replica that verifies exchanges a signature its peers never send, so the data
    /// of one collective pairs with the signature of another (wrong sums, garbled errors). One
    /// all_gather of both flags at construction; a difference throws errc::invalid_argument on
    /// every replica, naming each replica's values. Every replica is here (comm_ was just made
    /// collectively), so the blocking call cannot wait long.
    void check_same_checks() {
        const int mine[2] = {params_.verify ? 1 : 0, params_.check_call_sites ? 1 : 0};
        std::vector<int> all(2 * static_cast<std::size_t>(size_));
        LOCKSTEP_MPI_CHECK(MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm_));
        const auto replicas = [&](int flag, bool value) {
            std::string list;
            for (std::size_t r = 0; r < static_cast<std::size_t>(size_); ++r)
                if ((all[2 * r + static_cast<std::size_t>(flag)] != 0) == value)
                    list += (list.empty() ? "" : ", ") + std::to_string(r);
            return list;
        };
        for (int flag = 0; flag < (params_.verify ? 2 : 1); ++flag) { // call sites: if verifying
            const std::string on = replicas(flag, true), off = replicas(flag, false);
            const char* name = flag == 0 ? "verify" : "check_call_sites";
            LOCKSTEP_REQUIRE(
                on.empty() || off.empty(), errc::invalid_argument, rank_, "mpi_communicator",
                "mpi_communicator_params::", name, " differs across replicas: true on replica(s) ",
                on, ", false on replica(s) ", off, ". Every replica must pass the same ", name,
                " (a replica that verifies exchanges signatures its peers "
                "never send, pairing the data of one collective with another)");
        }
    }

    void setup() {
        LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
        LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
        LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
        int* tag_ub = nullptr;
        int found = 0;
        LOCKSTEP_MPI_CHECK(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found));
        tag_ub_ = found && tag_ub != nullptr ? *tag_ub : 32767; // 32767: the standard's minimum
        // Every replica is here (comm_ was just made collectively), so this cannot wait long.
        MPI_Comm control = MPI_COMM_NULL;
        LOCKSTEP_MPI_CHECK(MPI_Comm_dup(comm_, &control));
        control_.adopt(control);
        LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(control, MPI_ERRORS_RETURN));
    }

    void take(mpi_handle& o) noexcept {
        comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
        owns_ = o.owns_;
        control_.take(o.control_);
        params_ = o.params_;
        rank_ = o.rank_;
        size_ = o.size_;
        node_ranks_ = o.node_ranks_;
        label_ = std::move(o.label_);
        tag_ub_ = o.tag_ub_;
        seq_ = o.seq_;
        waits_ = o.waits_;
        kind_ = o.kind_;
        broken_ = std::move(o.broken_);
        trace_ = std::move(o.trace_);
        scratch_ = std::move(o.scratch_);
        scratch_bytes_ = std::exchange(o.scratch_bytes_, 0);
    }

    /// n elements of T in the scratch (grown, never shrunk; uninitialised; valid until the next
    /// call). Only collectives that finish before returning use it.
    template <class T>
    T* scratch(std::size_t n) {
        static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
        const std::size_t bytes = n * sizeof(T);
        if (bytes > scratch_bytes_) {
            scratch_.reset(new std::byte[bytes]);
            scratch_bytes_ = bytes;
        }
        return reinterpret_cast<T*>(scratch_.get());
    }
    /// n value-initialised elements of T for the buffer of an MPI request of the operation in
    /// progress, freed when it ends, or kept forever if it fails (detail::mpi_request_buffer).
    template <class T>
    detail::mpi_request_buffer<T> buffer(std::size_t n) const {
        return detail::mpi_request_buffer<T>(broken_, n);
    }
    /// Keeps the arrays an MPI request of the operation in progress reads, if it fails
    /// (detail::mpi_request_arrays): declare the result after them.
    template <class... V>
    [[nodiscard]] detail::mpi_request_arrays<V...> keep_arrays(V&... v) const {
        return detail::mpi_request_arrays<V...>(broken_, v...);
    }
    void release() noexcept {
        control_.adopt(MPI_COMM_NULL);
        if (comm_ == MPI_COMM_NULL || !owns_) {
            comm_ = MPI_COMM_NULL;
            return;
        }
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized)
            MPI_Comm_free(&comm_);
        comm_ = MPI_COMM_NULL;
    }

    template <class T>
    static constexpr void check_type() {
        static_assert(detail::is_mpi_element<T>,
                      "mpi_communicator carries float, double, int, std::int64_t, std::uint8_t, "
                      "lockstep::half and lockstep::bfloat16 elements; convert other types to "
                      "one of these first.");
    }

    template <class A, class B>
    static bool disjoint(std::span<A> a, std::span<B> b) noexcept {
        const auto a0 = reinterpret_cast<std::uintptr_t>(a.data()), a1 = a0 + a.size_bytes();
        const auto b0 = reinterpret_cast<std::uintptr_t>(b.data()), b1 = b0 + b.size_bytes();
        return a1 <= b0 || b1 <= a0;
    }
    // Calls f(offset, count) over [0, n) in pieces of at most `most` elements that MPI's int
    // counts can describe (once for 0).
    template <class F>
    static void for_each_chunk(std::size_t n, F&& f) {
        for_each_chunk(n, std::numeric_limits<int>::max(), std::forward<F>(f));
    }
    template <class F>
    static void for_each_chunk(std::size_t n, std::size_t most, F&& f) {
        const std::size_t max_chunk =
            std::min<std::size_t>(std::max<std::size_t>(1, most), std::numeric_limits<int>::max());
        std::size_t at = 0;
        do {
            const std::size_t c = std::min(n - at, max_chunk);
            f(at, static_cast<int>(c));
            at += c;
        } while (at < n);
    }

    // "all_reduce #12": the collective in progress and its sequence number.
    std::string name() const {
        std::string n = detail::mpi_operation_name(kind_, seq_);
        return label_.empty() ? n : n + " in " + label_;
    }
    detail::mpi_clock::time_point deadline() const {
        return deadline_after<detail::mpi_clock>(params_.timeout);
    }

    // Throws the first failure again once the communicator is broken.
    void require_usable(const std::string& op) const {
        LOCKSTEP_REQUIRE(comm_ != MPI_COMM_NULL, errc::invalid_argument, rank_, op,
                         "the communicator was moved from");
        if (broken_)
            fail(broken_->code(), rank_, op,
                 "the communicator is broken since an earlier failure: ", broken_->what());
    }

    // Starts collective number seq_ + 1; with verification, exchanges the signature and throws
    // on every replica when they disagree. A replica whose own arguments failed (ok == false)
    // returns so that the caller throws its precise error; the others throw peer_failure.
    // Returns the flight recorder's scope of the collective: the caller keeps it until it ends.
    [[nodiscard]] flight_recorder::scope begin(detail::mpi_collective kind, std::size_t count,
                                               std::int64_t type, int root, reduce_op op, bool ok,
                                               std::span<const std::size_t> counts = {},
                                               collective_tag tag = {}) {
        require_usable(std::string(detail::to_string(kind)));
        ++seq_;
        kind_ = kind;
        const bool rooted =
            kind == detail::mpi_collective::broadcast || kind == detail::mpi_collective::reduce;
        flight_recorder::scope traced(
            trace_,
            trace_.record(detail::to_string(kind).data(), static_cast<std::uint64_t>(seq_),
                          detail::mpi_type_name(type).data(), count, rooted ? root : -1),
            static_cast<std::uint64_t>(seq_));
        // A reduce_op outside its enumerators would reach MPI as MPI_OP_NULL (errc::mpi, a broken
        // communicator): refuse it here, after the exchange when there is one, so that the
        // peers are released with peer_failure instead of waiting.
        const bool op_known = is_reduce_op(op);
        if (!params_.verify) {
            require_known_op(op, op_known);
            return traced;
        }
        detail::mpi_signature mine;
        mine.value = {static_cast<std::int64_t>(kind),
                      seq_,
                      static_cast<std::int64_t>(std::min<std::size_t>(
                          count, std::size_t(std::numeric_limits<std::int64_t>::max()))),
                      type,
                      root,
                      static_cast<std::int64_t>(op),
                      ok && op_known ? 1 : 0,
                      kind == detail::mpi_collective::reduce_scatter ? detail::counts_hash(counts)
                                                                     : 0,
                      tag.id(params_.check_call_sites)};
        // On the heap: after a timeout MPI may still write it (mpi_request_buffer).
        const auto packed = buffer<decltype(detail::mpi_signature_pack(mine))>(1);
        auto& v = *packed.data();
        v = detail::mpi_signature_pack(mine);
        MPI_Request req = MPI_REQUEST_NULL;
        call(MPI_Iallreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_INT64_T,
                            MPI_MAX, comm_, &req),
             "MPI_Iallreduce (verify)", count);
        finish(req, "MPI_Iallreduce (verify)", count, 0);
        const auto range = detail::mpi_signature_unpack(v);
        const std::string calls =
            detail::mpi_calls_differ(range) ? gather_calls(mine, tag) : std::string();
        require_known_op(op, op_known);
        if (ok) {
            try {
                detail::require_agreement(mine, range, rank_, detail::describe_counts(counts),
                                          calls,
                                          detail::tag_text(tag.identity(params_.check_call_sites),
                                                           tag.by_site(params_.check_call_sites)),
                                          label_);
            } catch (const error& e) {
                trace_.fail_newest();
                if (!flight_recorder::dumps_on(e.code()))
                    throw;
                throw flight_recorder::with_trace(e, trace_.dump(rank_, size_, e.what(), label_));
            }
        }
        return traced;
    }

    // Refuses a reduce_op value outside the enumerators (an integer cast to reduce_op).
    void require_known_op(reduce_op op, bool known) const {
        LOCKSTEP_REQUIRE(known, errc::invalid_argument, rank_, name(), "reduce_op value ",
                         static_cast<int>(op),
                         " is none of reduce_op::sum, max and min (an integer cast to "
                         "reduce_op?); nothing was communicated");
    }

    // After a mismatch of collectives or tags (so on every replica): every replica's call,
    // "replica 0 called all_gather #7 (4 float), replica 1 called all_reduce #7 (...)".
    std::string gather_calls(const detail::mpi_signature& mine, collective_tag tag) {
        constexpr std::size_t w = detail::mpi_call_text_bytes;
        const auto text = buffer<char>(w * static_cast<std::size_t>(size_));
        const std::string own =
            detail::mpi_describe_call(mine, tag.identity(params_.check_call_sites),
                                      tag.by_site(params_.check_call_sites))
                .substr(0, w - 1);
        std::copy(own.begin(), own.end(), text.data() + w * static_cast<std::size_t>(rank_));
        MPI_Request req = MPI_REQUEST_NULL;
        call(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, text.data(), static_cast<int>(w),
                            MPI_CHAR, comm_, &req),
             "MPI_Iallgather (verify)", w);
        finish(req, "MPI_Iallgather (verify)", w, 0);
        std::string out;
        for (int j = 0; j < size_; ++j)
            out += (j == 0 ? "" : ", ") + std::string("replica ") + std::to_string(j) + " called " +
                   std::string(text.data() + w * static_cast<std::size_t>(j));
        return out;
    }

    void ibarrier(const char* what) {
        MPI_Request req = MPI_REQUEST_NULL;
        call(MPI_Ibarrier(comm_, &req), what, 0);
        finish(req, what, 0, 0);
    }
    // Waits for a collective's request of `bytes` bytes per replica within the timeout; a
    // failure or timeout breaks the communicator.
    // With a core per process it spins about twice as long as its recent collectives waited
    // (detail::wait_estimate, at most mpi_poll_schedule::max_adaptive_spin) before it sleeps.
    void finish(MPI_Request& req, const char* mpi_call, std::size_t count, std::size_t bytes) {
        bool done = false;
        auto schedule = detail::mpi_poll_schedule::for_bytes(bytes);
        if (node_ranks_ <= host_system::hardware_threads())
            schedule.spin =
                waits_.spin(schedule.spin, detail::mpi_poll_schedule::max_adaptive_spin);
        const auto began = detail::mpi_clock::now();
        const int rc =
            detail::mpi_poll([&](int& flag) { return MPI_Test(&req, &flag, MPI_STATUS_IGNORE); },
                             deadline(), control_, seq_, done, schedule);
        call(rc, mpi_call, count);
        if (done) {
            waits_.record(detail::mpi_clock::now() - began,
                          detail::mpi_poll_schedule::max_adaptive_spin);
            return;
        }
        // A census of the peers: who is inside this collective, who is behind or silent.
        const auto grace =
            std::min<std::chrono::milliseconds>(params_.timeout, std::chrono::seconds(1));
        const auto peers = control_.census(rank_, size_, seq_, grace);
        std::string missing, detail_text, arrived;
        for (int j = 0; j < size_; ++j) {
            const auto& p = peers[static_cast<std::size_t>(j)];
            using st = detail::mpi_peer_report::state;
            if (p.where == st::self || p.where == st::arrived) {
                arrived += (arrived.empty() ? "" : ", ") + std::to_string(j);
                continue;
            }
            missing += (missing.empty() ? "" : ", ") + std::to_string(j);
            detail_text += (detail_text.empty() ? "" : "; ") + std::string("replica ") +
                           std::to_string(j) + " ";
            if (p.where == st::silent)
                detail_text += "did not answer within " + std::to_string(grace.count()) +
                               " ms (busy outside this communicator, exited or failed)";
            else
                detail_text +=
                    "has started " + std::to_string(p.sequence) + " collective(s)" +
                    (p.inside ? " and waits in an operation" : " and is between operations");
        }
        poison(error(errc::timeout, rank_, name(),
                     detail::concat("timed out after ", params_.timeout.count(), " ms in ",
                                    mpi_call, "; missing replica(s) ",
                                    missing.empty() ? std::string("unknown") : missing,
                                    missing.empty() ? "" : " (", detail_text,
                                    missing.empty() ? "" : ")", "; arrived: ", arrived,
                                    " (group of ", size_, ")")));
    }

    // Marks the communicator broken with e, then aborts the job or throws e (params).
    // A timeout also writes the flight recorder, and e then names its file. The request of the
    // failed operation may stay outstanding, so the library's buffers it may use are kept
    // forever: the scratch here, the operation's mpi_request_buffers as they go out of scope.
    [[noreturn]] void poison(error e) {
        trace_.fail_newest();
        if (flight_recorder::dumps_on(e.code()))
            e = flight_recorder::with_trace(e, trace_.dump(rank_, size_, e.what(), label_));
        broken_ = e;
        detail::keep_forever(scratch_.release());
        scratch_bytes_ = 0;
        if (params_.on_failure == mpi_failure_action::abort)
            abort(e, exit_status(e));
        throw e;
    }

    void call(int rc, const char* mpi_call, std::size_t count) {
        if (rc != MPI_SUCCESS)
            poison(error(errc::mpi, rank_, name(),
                         detail::concat(mpi_call, " failed: ", detail::mpi_error_text(rc),
                                        " (count ", count, ", group of ", size_, ")")));
    }
    void call_p2p(int rc, const char* op, const char* mpi_call, int peer, int tag) {
        if (rc != MPI_SUCCESS)
            poison(error(errc::mpi, rank_, op,
                         detail::concat(mpi_call, " with replica ", peer_name(peer), ", tag ", tag,
                                        " failed: ", detail::mpi_error_text(rc))));
    }
    // A message's wait timed out: fails with on_timeout(the timeout's error), the caller's
    // account of the wait (the error itself when that throws).
    template <class OnTimeout>
    [[noreturn]] void p2p_timeout(const char* op, const char* mpi_call, int peer, int tag,
                                  OnTimeout&& on_timeout) {
        const error e(errc::timeout, rank_, op,
                      detail::concat("timed out after ", params_.timeout.count(), " ms in ",
                                     mpi_call, " (tag ", tag, "): missing replica ",
                                     peer_name(peer), " (group of ", size_, ")"));
        poison(detail::named_timeout_error(on_timeout, e));
    }
    // "3", or "(any)" for MPI_ANY_SOURCE.
    static std::string peer_name(int peer) {
        return peer == MPI_ANY_SOURCE ? std::string("(any)") : std::to_string(peer);
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    bool owns_ = true; // false for a message_view
    detail::mpi_control control_;
    params params_{};
    int rank_ = -1;
    int size_ = 0;
    int node_ranks_ = 1;
    /// "" for a communicator made from an MPI_Comm, else "split(color=c)" (after its parent's
    /// label and " / "): messages name operations "all_gather #3 in split(color=1)", so ranks
    /// read as the split's, not the parent's.
    std::string label_;
    int tag_ub_ = 32767;
    std::int64_t seq_ = 0;
    detail::wait_estimate waits_; // how long its collectives wait (finish)
    detail::mpi_collective kind_ = detail::mpi_collective::none;
    std::optional<error> broken_;
    detail::mpi_exit_guard exit_guard_; // exit() while this lives aborts the job
    flight_recorder trace_{"mpi"};
    std::unique_ptr<std::byte[]> scratch_; // reduce_scatter's in-place result (scratch())
    std::size_t scratch_bytes_ = 0;
};

} // namespace detail
} // namespace lockstep

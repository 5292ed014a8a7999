// lockstep/comm/detail/mpi_handle.hpp: what every operation of mpi_communicator stands on:
// the owned duplicates of the MPI communicator, made and checked collectively, and the
// operations' machinery they run with (comm/detail/mpi_operations.hpp).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/mpi_communicator_params.hpp"
#include "lockstep/comm/detail/mpi_exit_guard.hpp"
#include "lockstep/comm/detail/mpi_operations.hpp"
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
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

namespace lockstep::detail {

/// One process's handle on an MPI communicator, the base of mpi_communicator (whose comment
/// states what it guarantees): it owns a duplicate of the communicator for the operations and
/// one for the census of a timed-out replica (mpi_control). Its base detail::mpi_operations
/// (comm/detail/mpi_operations.hpp) numbers and verifies collectives (begin), waits for their
/// requests within the timeout (finish) and, once an operation failed, keeps the communicator
/// broken (poison). detail::mpi_messages adds the point-to-point messages
/// (comm/detail/mpi_messages.hpp); detail::mpi_all_to_all, detail::mpi_reduce_scatter and
/// mpi_communicator the collectives.
class mpi_handle : public mpi_operations {
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

protected:
    // mpi_communicator's constructor (comm/mpi_communicator.hpp).
    explicit mpi_handle(MPI_Comm comm, params p = {}) : mpi_operations(p) {
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
        : mpi_operations(adopted, p, node_ranks) {
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
};

} // namespace lockstep::detail

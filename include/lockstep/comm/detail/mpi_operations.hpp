// lockstep/comm/detail/mpi_operations.hpp: how each operation of an mpi_handle runs on its
// state: begin (numbering, the flight recorder, the signature each collective is verified
// with), finish (the polled wait against the timeout with the census of missing peers) and the
// broken state a failure leaves (poison). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/mpi_communicator_params.hpp"
#include "lockstep/comm/detail/mpi_exit_guard.hpp"
#include "lockstep/comm/detail/mpi_progress.hpp"
#include "lockstep/comm/detail/mpi_request_buffer.hpp"
#include "lockstep/comm/detail/mpi_signature.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
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

#include <mpi.h>

namespace lockstep::detail {

/// The state of an mpi_handle and the life of each operation on it (mpi_handle's base; the
/// guarantees are stated at mpi_communicator): begin numbers, records and verifies a
/// collective, finish waits for its requests within the timeout (a census of the peers when it
/// times out), and once an operation failed poison keeps the communicator broken and aborts the
/// job or throws (params::on_failure). mpi_handle owns the communicators this state names.
class mpi_operations {
public:
    mpi_operations(const mpi_operations&) = delete;
    mpi_operations& operator=(const mpi_operations&) = delete;

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
    using params = mpi_communicator_params;
    mpi_operations() = default;
    explicit mpi_operations(params p) : params_(p) {}
    mpi_operations(MPI_Comm adopted, params p, int node_ranks)
        : comm_(adopted), params_(p), node_ranks_(node_ranks) {}
    ~mpi_operations() = default;

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
                      detail::concat("timed out after ",
                                     params_.timeout.count() * detail::timeout_periods(on_timeout),
                                     " ms in ", mpi_call, " (tag ", tag, "): missing replica ",
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

} // namespace lockstep::detail

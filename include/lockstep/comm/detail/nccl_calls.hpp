// lockstep/comm/detail/nccl_calls.hpp: nccl_calls, how nccl_communicator's operations are
// numbered, checked, traced, timed and waited for. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/nccl_handle.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/detail/stream_gap_timer.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include <nccl.h>

namespace lockstep::detail {

/// The base of nccl_communicator (whose comment states what it guarantees): the replica's
/// handle, its operations' sequence numbers, its flight recorder and its device timing; the
/// waits that poll through the handle; and what every operation does around its NCCL call.
class nccl_calls {
public:
    /// Waits until the replica's stream is idle, polling NCCL's asynchronous errors and the
    /// clique's failure mark; aborts the communicator and throws on an error, a failed peer or
    /// after nccl_options::timeout. Prefer it over system().synchronize() while collectives
    /// are in flight (a stream waiting for a dead peer never becomes idle).
    void synchronize() {
        const std::string name = reached("synchronize");
        wait_traced(name, true, [&] { h_.wait(name); });
    }

    /// Waits until `event` has completed (cudaEventQuery, polled), with the checks of
    /// synchronize(): aborts and throws on a CUDA error, a failed peer (errc::peer_failure),
    /// NCCL's asynchronous error or after nccl_options::timeout (errc::timeout). `what` names
    /// the event in the error message. Use it instead of cudaEventSynchronize for an event
    /// recorded after collectives (e.g. "the step's result is ready").
    /// requires: event was created on device() and recorded (an unrecorded event counts as
    /// complete, as in CUDA).
    void wait(cudaEvent_t event, const char* what) {
        const std::string name =
            reached(std::string("wait (") + (what != nullptr ? what : "event") + ")");
        wait_traced(name, false, [&] { h_.wait_event(name, event); });
    }

    /// This replica's record of its last operations (flight_recorder). Operations are recorded
    /// as queued when enqueued and become done when synchronize() or barrier() finds the
    /// stream idle; wait(event) leaves them queued. A timeout or peer failure seen by a wait
    /// writes the record, and the error names the file.
    const flight_recorder& trace() const noexcept { return trace_; }

    /// Starts timing, on the device, the time this replica's stream spends between this
    /// communicator's collectives (detail::stream_gap_timer: two CUDA events per collective
    /// from now on), which device_between_ns() reads; train_params::report_stragglers_every
    /// turns it on. Collectives driven inside an nccl_group are launched at its end, after
    /// their events: their gaps are not the stream's. Idempotent.
    void time_between_on_device() { gaps_.start(h_.device()); }

    /// Makes this communicator's stream wait on the device (no host wait) for `event`, recorded
    /// after collectives on another stream of the replica (comm_stream's side stream): with the
    /// device timing on, the stream's wait there counts as time in collectives, not as the
    /// replica's own work, as a collective on this stream would (a replica waiting for a slower
    /// one's buckets is not the slow one). requires: event recorded on device(). A CUDA error
    /// stops the family, as a failed collective does, and throws errc::cuda.
    void device_wait(cudaEvent_t event) {
        gaps_.before(h_.stream());
        cudaError_t st = cudaSuccess;
        {
            cuda_device_guard guard(h_.device());
            st = cudaStreamWaitEvent(h_.stream(), event, 0);
        }
        if (st != cudaSuccess) { // as the handle's polled waits report a CUDA error
            (void)cudaGetLastError();
            h_.fail_and_abort(errc::cuda, "device_wait",
                              "cudaStreamWaitEvent: ", cudaGetErrorName(st), " (",
                              cudaGetErrorString(st), ")");
        }
        gaps_.after(h_.stream());
    }

    /// The device time between collectives since time_between_on_device(), in ns, over the
    /// gaps whose next collective the stream has reached (after synchronize(): all of them);
    /// 0 while off. Throws errc::cuda when the timing's events failed.
    std::int64_t device_between_ns() { return gaps_.between_ns(); }

protected:
    nccl_calls(ncclComm_t comm, int device, nccl_handle::stream_source stream,
               std::shared_ptr<nccl_clique> clique, std::shared_ptr<nccl_family> family,
               nccl_options options)
        : h_(comm, device, std::move(stream), std::move(clique), std::move(family), options) {}
    nccl_calls(const nccl_calls&) = delete;
    nccl_calls& operator=(const nccl_calls&) = delete;
    nccl_calls(nccl_calls&&) noexcept = default;
    nccl_calls& operator=(nccl_calls&&) noexcept = default;
    ~nccl_calls() = default;

    // "synchronize (after operation #41)": a timeout message then says how far this replica
    // got, so comparing the replicas' messages shows which one skipped or added a call.
    std::string reached(std::string op) const {
        return sequence_ == 0 ? op + " (before any operation)"
                              : op + " (after operation #" + std::to_string(sequence_ - 1) + ")";
    }
    std::string next_operation(const char* op) {
        return std::string(op) + " #" + std::to_string(sequence_++);
    }

    // Makes the enqueueing NCCL call `call()` (nccl_handle::enqueue), between the events of the
    // device timing when it is on.
    template <class Call>
    void enqueue(const std::string& name, Call call) {
        gaps_.before(h_.stream());
        h_.enqueue(name, call);
        gaps_.after(h_.stream());
    }

    // A null span with a non-zero count, or one larger than memory can hold, is refused before
    // anything is enqueued (like every argument error here, it aborts the communicator so the
    // peers get peer_failure instead of waiting).
    // A reduce_op that is none of the enumerators (an integer cast to it): refused (aborting, as
    // check_spans does) instead of being reduced as a sum.
    void check_op(const std::string& name, reduce_op op) {
        h_.require(is_reduce_op(op), errc::invalid_argument, name, "reduce_op value ",
                   static_cast<int>(op), " is none of sum, max, min");
    }
    template <class A, class B>
    void check_spans(const std::string& op, std::span<A> a, std::span<B> b) {
        const std::string problem = detail::join_problems(
            {detail::span_problem(a, "send"), detail::span_problem(b, "recv")});
        h_.require(problem.empty(), errc::invalid_argument, op, problem);
    }

    // send and recv in NCCL's in-place form (in_place, described by `form`) or disjoint: a
    // partial overlap is undefined in NCCL, so it is refused (aborting, as check_spans does).
    template <class A, class B>
    void check_disjoint(const std::string& op, std::span<A> send, std::span<B> recv, bool in_place,
                        const char* form) {
        const std::string overlap =
            in_place ? std::string() : lockstep::detail::overlap_text(send, "send", recv, "recv");
        h_.require(overlap.empty(), errc::invalid_argument, op, overlap,
                   ": give them identical (in place: ", form, ") or disjoint");
    }

    // Records an enqueued operation (sequence_ - 1) as queued: NCCL runs it later on the stream.
    void traced(const char* op, const char* type, std::size_t count, int peer) noexcept {
        trace_.record(op, static_cast<std::uint64_t>(sequence_ - 1), type, count, peer,
                      op_state::queued);
    }
    // Runs a wait; once the whole stream is idle (stream_idle) every queued operation is done.
    // A failed wait writes the flight recorder and the error names its file; the operations
    // stay queued, since the stream does not say which of them hangs.
    template <class Wait>
    void wait_traced(const std::string& op, bool stream_idle, Wait&& wait) {
        try {
            wait();
        } catch (const error& e) {
            if (!flight_recorder::dumps_on(e.code()))
                throw;
            throw flight_recorder::with_trace(
                e, trace_.dump(h_.rank(), h_.size(), op + ": " + e.what()));
        }
        if (stream_idle)
            trace_.complete_queued();
    }

    void check_peer(const std::string& op, int peer) {
        h_.require(peer >= 0 && peer < h_.size() && peer != h_.rank(), errc::invalid_argument, op,
                   "peer ", peer, " is not another rank of ", h_.size(), " replicas");
    }

    nccl_handle h_;
    long long sequence_ = 0;
    flight_recorder trace_{"nccl"};
    stream_gap_timer gaps_; // off unless time_between_on_device()
};

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

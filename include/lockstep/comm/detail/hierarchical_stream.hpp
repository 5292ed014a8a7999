// lockstep/comm/detail/hierarchical_stream.hpp: comm_stream for a hierarchical_communicator with
// a device intra-node part, ordered with the compute stream by events. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/comm/hierarchical.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/system/cuda_system.hpp"

#include <memory>
#include <utility>

namespace lockstep {

/// hierarchical_communicator over a device intra-node part (nccl_communicator): a split of the
/// replica's communicator (its intra-node part on the side stream, which the comm_stream owns,
/// when the intra-node communicator's split takes a stream) driven by a
/// communication thread (detail::ordered_worker, with the device made current on it), because
/// every inter-node step blocks a host thread while the pinned copies cross to MPI.
/// - submit(work): records a fresh event on the compute stream (on the calling thread, so it
///   marks exactly the work enqueued so far) and queues the item; on the communication thread
///   the side stream waits for that event, then work(comm()) runs. The compute thread returns
///   at once and goes on enqueuing its kernels.
/// - join(): waits on the host until the communication thread has run every item (rethrowing
///   the first failure), then makes the compute stream wait for an event recorded on the side
///   stream.
template <class Intra, class Inter, class Routes>
requires(!Intra::system_type::is_host) class comm_stream<
    hierarchical_communicator<Intra, Inter, Routes>> {
public:
    using communicator_type = hierarchical_communicator<Intra, Inter, Routes>;

    /// Splits comm (collective: every replica constructs its stream at the same point) and
    /// starts the communication thread at `priority`.
    explicit comm_stream(communicator_type& comm, comm_priority priority = comm_priority::normal)
        : compute_(comm.system()), side_(comm.system().device()),
          comm_(split_onto(comm, side_.get())), done_(comm_.system().device()),
          worker_(
              [device = comm_.system().device()] { LOCKSTEP_CUDA_CHECK(cudaSetDevice(device)); },
              priority) {}
    comm_stream(const comm_stream&) = delete;
    comm_stream& operator=(const comm_stream&) = delete;

    communicator_type& comm() noexcept { return comm_; }

    /// Runs work(comm()) on the communication thread with the side stream behind the compute
    /// stream's work so far.
    template <class Work>
    void submit(Work&& work) {
        auto ready = std::make_shared<cuda_event>(compute_.device());
        ready->record(compute_);
        worker_.submit([this, ready, w = std::forward<Work>(work)]() mutable {
            ready->make_wait(comm_.system());
            w(comm_);
        });
    }
    /// Waits for the communication thread's items (rethrowing the first failure), then orders
    /// the compute stream after the side stream (device-side wait).
    void join() {
        worker_.join();
        done_.record(comm_.system());
        done_.make_wait(compute_);
    }

private:
    static communicator_type split_onto(communicator_type& comm, cudaStream_t side) {
        if constexpr (requires(Intra & intra) { intra.split(0, 0, side); })
            return comm.split(0, comm.rank(), side);
        else
            return comm.split(0, comm.rank());
    }

    cuda_system compute_;
    cuda_stream side_; // the node communicator's split runs on it; before comm_: outlives it
    communicator_type comm_;
    cuda_event done_;
    detail::ordered_worker worker_; // last: stopped (queue drained) before the rest goes
};

} // namespace lockstep
#endif

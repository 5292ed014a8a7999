// lockstep/comm/detail/hierarchical_stream.hpp: comm_stream for a hierarchical_communicator with
// a device intra-node part, ordered with the compute stream by events. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/comm/hierarchical.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/system/cuda_system.hpp"

#include <utility>

namespace lockstep {

/// hierarchical_communicator over a device intra-node part (nccl_communicator): as
/// comm_stream<nccl_communicator>, a split of the replica's communicator whose intra-node part
/// has its own stream; submit() makes that stream wait for an event recorded on the compute
/// stream and then runs the work on the calling thread (the inter-node steps block it while
/// the host exchanges the pinned copies); join() makes the compute stream wait for an event
/// recorded on the side stream. The primary template's communication thread would not order
/// the side stream after the compute stream's kernels.
template <class Intra, class Inter, class Routes>
requires(!Intra::system_type::is_host) class comm_stream<
    hierarchical_communicator<Intra, Inter, Routes>> {
public:
    using communicator_type = hierarchical_communicator<Intra, Inter, Routes>;

    /// Splits comm (collective: every replica constructs its stream at the same point).
    explicit comm_stream(communicator_type& comm)
        : compute_(comm.system()), comm_(comm.split(0, comm.rank())),
          ready_(comm_.system().device()), done_(comm_.system().device()) {}

    communicator_type& comm() noexcept { return comm_; }

    /// Runs work(comm()) with the side stream behind the compute stream's work so far.
    template <class Work>
    void submit(Work&& work) {
        ready_.record(compute_);
        ready_.make_wait(comm_.system());
        std::forward<Work>(work)(comm_);
    }
    /// Orders the compute stream after every submitted item (device-side wait).
    void join() {
        done_.record(comm_.system());
        done_.make_wait(compute_);
    }

private:
    cuda_system compute_;
    communicator_type comm_;
    cuda_event ready_;
    cuda_event done_;
};

} // namespace lockstep
#endif

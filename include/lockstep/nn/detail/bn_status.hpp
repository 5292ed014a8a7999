// lockstep/nn/detail/bn_status.hpp: a batch-norm layer's checks of its input and communicator,
// and the status it reads back outside a trainer's step. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_statistics.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/nn/layout.hpp"
#include "lockstep/system/staged_read.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>

namespace lockstep::nn::detail {

/// What is wrong with an input of x_size values, shape `shape` and an output of y_size values
/// for a layer of `channels` channels in Layout; empty when nothing is.
template <tensor_layout Layout>
std::string check_input(std::size_t channels, std::size_t x_size, const tensor_shape& shape,
                        std::size_t y_size) {
    if (shape.rank() != Layout::rank)
        return lockstep::detail::concat("expected a rank-", Layout::rank, " ", Layout::name,
                                        " tensor, got shape ", shape, " of rank ", shape.rank());
    if (shape[Layout::channel_axis] != channels)
        return lockstep::detail::concat("the layer has ", channels, " channels, the input ",
                                        shape[Layout::channel_axis], " (shape ", shape, ", ",
                                        Layout::name, ")");
    if (shape.elements_overflow())
        return lockstep::detail::concat("shape ", shape,
                                        ": the product of the extents overflows std::size_t");
    if (x_size != shape.elements() || y_size != shape.elements())
        return lockstep::detail::concat("shape ", shape, " has ", shape.elements(),
                                        " values, x has ", x_size, " and y ", y_size);
    return {};
}

/// The stream contract: the communicator's system must be the layer's (sys); else throws
/// lockstep::error (invalid_argument) naming both devices and streams. A communicator of another
/// system type (host memory for a device layer, or the reverse) does not compile.
template <class System, class Comm>
void check_system(const System& sys, const Comm& comm, const char* op) {
    static_assert(std::is_same_v<typename Comm::system_type, System>,
                  "lockstep: the batch_norm layer's System and the communicator's system_type "
                  "differ (its collectives would get memory of the wrong kind): use a "
                  "communicator of the layer's system, or a layer of the communicator's");
    if constexpr (!System::is_host) {
        const System cs = comm.system();
        LOCKSTEP_REQUIRE(cs == sys, errc::invalid_argument, comm.rank(), op,
                         "the layer runs on device ", sys.device(), " stream ",
                         static_cast<const void*>(sys.stream()), ", its communicator on device ",
                         cs.device(), " stream ", static_cast<const void*>(cs.stream()),
                         ": construct the layer from the communicator (batch_norm(comm, "
                         "channels)) or with comm.system()");
    }
}

/// The communicator a forward_train ran on: its backward combines its sums over the same
/// replicas (the statistics' count is theirs), so it must run on the same communicator.
struct forward_communicator {
    std::uint64_t identity = 0; ///< identified_communicator's identity(), else 0
    int size = 0;

    template <communicator Comm>
    static forward_communicator of(const Comm& comm) {
        if constexpr (identified_communicator<Comm>)
            return {comm.identity(), comm.size()};
        else
            return {0, comm.size()};
    }
    /// What is wrong with running the backward on `comm`, or "".
    template <communicator Comm>
    std::string problem(const Comm& comm) const {
        const forward_communicator now = of(comm);
        if (now.identity == identity && now.size == size)
            return {};
        return lockstep::detail::concat(
            "backward on another communicator (", now.size, " replicas, identity ", now.identity,
            ") than its forward_train (", size, " replicas, identity ", identity,
            "): the sums would be combined over other replicas than the statistics; pass the "
            "forward's communicator");
    }
};

/// A number of the calling thread, never given to another thread of the process (a
/// std::thread::id may be: a thread created after one was joined often gets its id).
inline std::uint64_t thread_serial() noexcept {
    static std::atomic<std::uint64_t> next{1};
    thread_local const std::uint64_t mine = next.fetch_add(1, std::memory_order_relaxed);
    return mine;
}

/// The replica a layer belongs to. One layer object called by several replicas (built once
/// outside the replicas' function) would race on its buffers and mix their statistics: the
/// first call of a second replica is refused, before it touches the layer. A replica is its
/// rank and its thread together: the same rank on another thread (a later run) and another
/// rank on the same thread (a shrunk or split communicator) are the same replica, and the
/// binding follows them; a call whose rank and thread both differ is another replica (threads
/// told apart by thread_serial, so a later run's thread is never taken for an ended one).
class replica_owner {
public:
    replica_owner() = default;
    /// Bound to `rank` on the constructing thread (a layer built from a communicator).
    explicit replica_owner(int rank) : rank_(rank), how_("built for") {}
    // A layer is moved or copied only while no replica calls it: the binding goes along.
    replica_owner(const replica_owner& o) : rank_(o.rank_), thread_(o.thread_), how_(o.how_) {}
    replica_owner& operator=(const replica_owner& o) {
        if (this == &o)
            return *this;
        rank_ = o.rank_;
        thread_ = o.thread_;
        how_ = o.how_;
        return *this;
    }

    /// Binds the layer to (rank, this thread) on its first training call; refuses a call whose
    /// rank and thread both differ from the binding with lockstep::error (invalid_argument)
    /// naming both replicas and the fix; layer() names the layer ("bn::global, 3 channels").
    template <class Describe>
    void claim(int rank, const char* op, Describe&& layer) {
        const std::uint64_t me = thread_serial();
        const std::lock_guard<std::mutex> lock(mutex_);
        LOCKSTEP_REQUIRE(rank_ < 0 || rank == rank_ || me == thread_, errc::invalid_argument, rank,
                         op, "batch_norm is used by replica ", rank, " but was ", how_, " replica ",
                         rank_, " (", layer(),
                         "): one layer object shared by several replicas races on its buffers "
                         "and mixes their statistics; make one layer per replica (construct it "
                         "inside the replica's function)");
        if (rank != rank_) // first bound, or rebound by a shrunk or split communicator
            how_ = "first trained on";
        rank_ = rank;
        thread_ = me;
    }

private:
    std::mutex mutex_;
    int rank_ = -1; ///< -1: not bound yet
    std::uint64_t thread_ = thread_serial();
    const char* how_ = "first trained on";
};

/// The host side of a layer's status reads outside a trainer's step (pinned on CUDA), each
/// made on first use: the backward status value and the layer's own error record.
template <class Acc, class System>
class layer_status {
public:
    /// The read of the backward status (one value of the combined sums).
    staged_read<Acc, System>& sums(const System& sys) {
        if (!sums_)
            sums_ = std::make_unique<staged_read<Acc, System>>(4, sys);
        return *sums_;
    }
    /// The read of the layer's own error record.
    staged_read<kernels::layer_error_record, System>& errors(const System& sys) {
        if (!errors_)
            errors_ = std::make_unique<staged_read<kernels::layer_error_record, System>>(1, sys);
        return *errors_;
    }

    /// Reads the error record `own` back (one synchronisation through the communicator) and
    /// throws what the device found: a peer's invalid input (peer_failure) or statistics over
    /// one value per channel (invalid_argument).
    template <class Comm>
    void throw_error(Comm& comm, const System& sys, const kernels::layer_error_record* own,
                     const char* op, const tensor_shape& shape) {
        errors(sys).enqueue(std::span<const kernels::layer_error_record>(own, 1));
        const kernels::layer_error_record e = wait_for(comm, errors(sys), op)[0];
        const auto code = static_cast<layer_error>(static_cast<int>(e.code));
        const int rank = comm.rank();
        if (code == layer_error::peer_invalid_input)
            fail(errc::peer_failure, rank, op, "replica ", static_cast<int>(e.value),
                 " passed invalid input to this layer");
        if (code == layer_error::single_value) {
            if (e.value < 0)
                fail(errc::invalid_argument, rank, op,
                     "expected more than 1 value per channel when training, got 1 over the "
                     "replicas sharing statistics (",
                     shape, " here)");
            fail(errc::invalid_argument, rank, op,
                 "expected more than 1 value per channel when training, replica ",
                 static_cast<int>(e.value), " has 1");
        }
    }

private:
    std::unique_ptr<staged_read<Acc, System>> sums_;
    std::unique_ptr<staged_read<kernels::layer_error_record, System>> errors_;
};

} // namespace lockstep::nn::detail

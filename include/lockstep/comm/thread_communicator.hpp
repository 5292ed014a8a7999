// lockstep/comm/thread_communicator.hpp: thread_communicator, one replica thread's handle on the
// shared-memory collectives of a thread_group. SPDX-License-Identifier: Apache-2.0
#pragma once
#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/shm_group.hpp"
#include "lockstep/comm/detail/shm_handle.hpp"
#include "lockstep/comm/detail/shm_p2p.hpp"
#include "lockstep/comm/detail/shm_reductions.hpp"
#include "lockstep/comm/detail/shm_shrink.hpp"
#include "lockstep/comm/detail/shm_sync.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/detail/split_label.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

class thread_group;

/// One replica's handle on a group of replica threads (made by thread_group::run, or by
/// split). Models point_to_point_communicator and all_to_all_communicator over host memory.
///
/// Semantics beyond the concept:
/// - Reductions combine replicas in rank order 0, 1, ..., size()-1, so every replica gets the
///   same bits and repeated runs give the same bits. lockstep::half and lockstep::bfloat16 are
///   combined in float and rounded once: the result is round16(the float fold in rank order).
/// - Collectives of up to detail::shm::stash_bytes (4 KiB) per replica copy the send data into
///   a shared stash and need one rendezvous. Larger ones read the peers' buffers directly:
///   in all_reduce each replica owns 1/size() of the elements, reduces them from every
///   replica's input and writes the result into every replica's output in the same pass
///   (reduce-scatter and all-gather fused: each byte read once and written once), two
///   rendezvous.
/// - Every collective carries a per-group sequence number; replicas that disagree on the call
///   (collective, collective_tag, element type, count, reduction, root, receive size,
///   reduce_scatter's per-rank counts) all throw lockstep::error (errc::count_mismatch for
///   counts, errc::shape_mismatch otherwise) naming "<collective> #<seq>" and every replica's
///   values ("replica 0 called all_gather #7 (4 floats), replica 1 called all_reduce #7 (4
///   floats, sum)"), before any data moves. The group stays usable after that. Calls of the
///   same collective and shape issued in another order (or one skipped) are told apart by their
///   collective_tag: a name, or the call site when thread_group_params::check_call_sites is on
///   ("... all_reduce #3 (4 floats, sum, at train.cpp:42)"); with neither they pair silently.
/// - If any replica of the run fails (throws out of its function, times out, or destroys a
///   handle its peers wait for), every replica blocked in or later entering a collective, send
///   or recv throws errc::peer_failure naming the failed replica and its message.
/// - A wait longer than the group's timeout throws errc::timeout naming the operation, its
///   sequence number and the missing replicas, and fails the run.
/// - A null span with a non-zero count, or a span larger than memory can hold, on any replica
///   makes every replica throw errc::invalid_argument naming that replica and its span;
///   nothing is copied and the group stays usable.
/// - thread_group::abort (from any thread) fails the run: every replica blocked in or later
///   entering a collective, send or recv throws errc::peer_failure naming the reason.
/// - send is buffered: it copies the elements and returns at once. A recv whose span does not
///   fit the message consumes it and throws (see recv), as mpi_communicator's does.
/// - Integer sums wrap modulo 2^bits, as MPI's do (computed in the unsigned type of the same
///   width: no undefined behaviour on signed overflow).
/// - A reduce_op value that is none of sum, max and min throws errc::invalid_argument on every
///   replica, naming the value, before any data moves.
/// - A handle, and every split of it, is valid only inside thread_group::run's function: once
///   run() has returned, every collective, split, shrink, send and recv on it throws
///   errc::invalid_argument at once, naming the replica.
/// - Every collective is recorded in the handle's flight_recorder (trace()); a timeout, peer
///   failure or disagreement writes it out (stderr, and LOCKSTEP_TRACE_DIR) and the error
///   message names the file.
/// A handle is used by one thread at a time; it is movable, not copyable.
///
/// What every operation stands on (membership, the checked rendezvous, phases, failures
/// and the flight recorder) is detail::shm::member_handle (comm/detail/shm_handle.hpp); the
/// reducing collectives (all_reduce, reduce, reduce_scatter, all_combine) are its base
/// detail::shm::reduction_handle (comm/detail/shm_reductions.hpp), over member_handle.
class thread_communicator : public detail::shm::reduction_handle {
public:
    using system_type = host_system;

    /// Moves the handle, sequence numbers included. ensures: o is empty (size() == 0) and
    /// throws errc::invalid_argument from every communication call.
    thread_communicator(thread_communicator&& o) noexcept = default;
    /// Leaves this handle's group (as the destructor does), then takes o's handle.
    thread_communicator& operator=(thread_communicator&& o) noexcept = default;
    thread_communicator(const thread_communicator&) = delete;
    thread_communicator& operator=(const thread_communicator&) = delete;
    /// Leaves the group: peers that wait for this replica afterwards throw errc::peer_failure.
    ~thread_communicator() = default;

    /// data on every replica becomes data of replica `root`. tag: see collective_tag.
    /// requires: every replica passes the same count, type and root, 0 <= root < size().
    template <class T>
    void broadcast(std::span<T> data, int root, collective_tag tag = {}) {
        static_assert(std::is_trivially_copyable_v<T>, "broadcast copies elements as bytes.");
        const bool small = stashed<T>(data.size());
        auto s = start(record<T>(detail::shm::collective_kind::broadcast, data.size(), data.size(),
                                 data.data(), data.data(), reduce_op::sum, root, tag),
                       small ? 1 : 2, small && rank_ == root ? data.data() : nullptr,
                       small && rank_ == root ? data.size() : 0);
        if (rank_ != root)
            copy_elements(data.data(), small ? stashed_send<T>(root, s) : peer_recv<T>(root, s),
                          data.size());
        if (!small)
            next_phase(s);
    }

    /// recv = the concatenation of every replica's send, in rank order. tag: see collective_tag.
    /// requires: equal send counts; recv.size() == size() * send.size(); send may be the
    /// rank()-th slice of recv and must not overlap it otherwise (that throws
    /// errc::invalid_argument on every replica).
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    collective_tag tag = {}) {
        static_assert(std::is_trivially_copyable_v<T>, "all_gather copies elements as bytes.");
        const std::size_t count = send.size();
        const bool small = stashed<T>(count);
        auto s = start(record<T>(detail::shm::collective_kind::all_gather, count, recv.size(),
                                 send.data(), recv.data(), reduce_op::sum, 0, tag),
                       small ? 1 : 2, small ? send.data() : nullptr, small ? count : 0);
        for (int j = 0; j < size(); ++j)
            copy_elements(recv.data() + static_cast<std::size_t>(j) * count,
                          small ? stashed_send<T>(j, s) : peer_send<T>(j, s), count);
        if (!small)
            next_phase(s);
    }

    /// Block r of recv = block rank() of replica r's send (blocks of send.size() / size()
    /// elements). Small exchanges go through the stash (one rendezvous); larger ones copy
    /// straight from the peers' send spans (two).
    /// requires: equal send counts, a multiple of size(); recv.size() == send.size(); send and
    /// recv do not overlap. Violations throw on every replica (errc::count_mismatch,
    /// errc::invalid_argument for overlapping spans).
    template <class T>
    void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    collective_tag tag = {}) {
        static_assert(std::is_trivially_copyable_v<T>, "all_to_all copies elements as bytes.");
        const std::size_t count = send.size();
        const bool small = stashed<T>(count);
        auto s = start(record<T>(detail::shm::collective_kind::all_to_all, count, recv.size(),
                                 send.data(), recv.data(), reduce_op::sum, 0, tag),
                       small ? 1 : 2, small ? send.data() : nullptr, small ? count : 0);
        const std::size_t block = count / static_cast<std::size_t>(size());
        const std::size_t mine = static_cast<std::size_t>(rank_) * block;
        for (int j = 0; j < size(); ++j)
            copy_elements(recv.data() + static_cast<std::size_t>(j) * block,
                          (small ? stashed_send<T>(j, s) : peer_send<T>(j, s)) + mine, block);
        if (!small)
            next_phase(s);
    }

    /// Returns once every replica of the group has entered the barrier.
    void barrier(collective_tag tag = {}) {
        start(record<char>(detail::shm::collective_kind::barrier, 0, 0, nullptr, nullptr,
                           reduce_op::sum, 0, tag),
              1);
    }

    /// A collective: the replicas with equal `color` form a new group, ranked by (key, rank).
    /// Sub-groups have their own sequence numbers and run collectives independently of each
    /// other and of this group. ensures: the result's size() is the number of replicas that
    /// passed `color`.
    thread_communicator split(int color, int key) {
        auto rec = record<char>(detail::shm::collective_kind::split, 0, 0, nullptr, nullptr,
                                reduce_op::sum, 0);
        rec.color = color;
        rec.key = key;
        auto s = start(std::move(rec), 2);
        std::vector<int> ranks;
        for (int j = 0; j < size(); ++j)
            if (group_->call(j, s.seq).color == color)
                ranks.push_back(j);
        std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
            return group_->call(a, s.seq).key < group_->call(b, s.seq).key;
        });
        const int leader = *std::min_element(ranks.begin(), ranks.end());
        if (leader == rank_) {
            std::vector<int> replicas;
            replicas.reserve(ranks.size());
            for (int j : ranks)
                replicas.push_back(group_->replica_of(j));
            std::string label = detail::split_label(group_->label(), color);
            // Only the child field is written; peers read other fields of this record now.
            group_->member(rank_).calls[s.seq % 2].child =
                std::make_shared<detail::shm::group_state>(group_->context_ptr(),
                                                           std::move(replicas), std::move(label),
                                                           group_->replicas_in_process());
        }
        next_phase(s);
        const int new_rank =
            static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
        return thread_communicator(group_->call(leader, s.seq).child, new_rank);
    }

    /// Sends a copy of data to rank `dest` with `tag` and returns at once.
    /// requires: 0 <= dest < size().
    template <class T>
    void send(std::span<T> data, int dest, int tag) {
        using U = std::remove_const_t<T>;
        static_assert(std::is_trivially_copyable_v<U>, "send copies elements as bytes.");
        const std::string op =
            "send to rank " + std::to_string(dest) + " (tag " + std::to_string(tag) + ")";
        require_group(op.c_str());
        LOCKSTEP_REQUIRE(dest >= 0 && dest < size(), errc::invalid_argument, replica(), op, "rank ",
                         dest, " is not in this group of ", size());
        require_span(op, data);
        group_->throw_if_failed(rank_, op);
        detail::shm::post(*group_, rank_, dest, tag, std::span<const U>(data));
    }

    /// Receives the oldest message from rank `source` with `tag` into data. ensures: the
    /// message held exactly data.size() elements of T, else it is consumed and
    /// errc::count_mismatch (errc::shape_mismatch for another element type) is thrown naming
    /// both counts and saying the message was discarded (as mpi_communicator::recv).
    /// requires: 0 <= source < size().
    template <class T>
    void recv(std::span<T> data, int source, int tag) {
        const std::string op =
            "recv from rank " + std::to_string(source) + " (tag " + std::to_string(tag) + ")";
        require_group(op.c_str());
        LOCKSTEP_REQUIRE(source >= 0 && source < size(), errc::invalid_argument, replica(), op,
                         "rank ", source, " is not in this group of ", size());
        require_span(op, data);
        detail::shm::receive(*group_, rank_, data, tag, source, op);
    }

    /// Receives the oldest message with `tag` from any rank into data; returns its source.
    /// A message that does not fit data is consumed and refused as in recv.
    template <class T>
    int recv_any(std::span<T> data, int tag) {
        const std::string op = "recv_any (tag " + std::to_string(tag) + ")";
        require_group(op.c_str());
        require_span(op, data);
        return detail::shm::receive(*group_, rank_, data, tag, -1, op);
    }

    /// This object's communicator_identity (identified_communicator): what caches of state
    /// derived from the communicator are keyed by. A shrink gives the handle a new one.
    std::uint64_t identity() const noexcept { return identity_.value(); }

    /// How many times this handle's group was shrunk (0 for thread_group::run's group).
    int generation() const noexcept { return group_ ? group_->context().generation() : 0; }

    /// Leaves this group, failed or not, for a new one made of the replicas that call shrink()
    /// (collective over the survivors; a thread_group's own communicator only, not a split:
    /// else errc::unsupported). The survivors agree through the group itself: the decision is
    /// taken once, by the first survivor that sees every member either arrived here or gone (its
    /// handle destroyed: its thread ended), or after the group's timeout (a member that has not
    /// arrived by then is left out: a stalled thread keeps running its own code but is not in
    /// the new group). ensures: this handle belongs to the new group (generation() + 1, a new
    /// identity(), sequence numbers from 0), rank() is this replica's position among the
    /// survivors in their old rank order, size() their number, replica() unchanged; the old group
    /// is dead: its splits and every handle still on it (an excluded replica's) throw
    /// errc::peer_failure from every later call, and an excluded replica's own shrink() throws
    /// it too, so nothing it does reaches the survivors. Returns the thread_group indices of the
    /// replicas left out; thread_group::lost() lists them after run() with the reasons. Refused
    /// (errc::peer_failure on every replica that calls it, no new group) when a member's thread
    /// ended with the errc::peer_failure or errc::timeout the group's failure caused: that
    /// replica was healthy, so the survivors do not drop it as a loss of its own.
    std::vector<int> shrink() {
        require_group("thread_communicator.shrink");
        const std::shared_ptr<detail::shm::group_state> old = group_;
        detail::shm::shrink_outcome next = detail::shm::shrink_group(*old, rank_);
        old->depart(rank_);
        group_ = std::move(next.group);
        rank_ = next.rank;
        seq_ = 0;
        epoch_ = 0;
        identity_ = communicator_identity();
        std::vector<int> lost;
        for (const auto& x : old->context().excluded())
            lost.push_back(x.replica);
        return lost;
    }

private:
    friend class thread_group;

    thread_communicator(std::shared_ptr<detail::shm::group_state> group, int rank)
        : reduction_handle(std::move(group), rank) {}

    communicator_identity identity_;
};

static_assert(point_to_point_communicator<thread_communicator>,
              "thread_communicator must model lockstep::point_to_point_communicator.");
static_assert(all_to_all_communicator<thread_communicator>,
              "thread_communicator must model lockstep::all_to_all_communicator.");

} // namespace lockstep

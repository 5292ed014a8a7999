// lockstep/comm/communicator.hpp: the communicator concept every backend (thread_group, mpi,
// nccl) models, and the reduction operators. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>

namespace lockstep {

/// The reduction a collective applies element-wise. A value that is none of these (an integer
/// cast to reduce_op) is refused with errc::invalid_argument naming it.
enum class reduce_op { sum, max, min };

/// Whether op is one of reduce_op's enumerators.
constexpr bool is_reduce_op(reduce_op op) noexcept {
    return op == reduce_op::sum || op == reduce_op::max || op == reduce_op::min;
}

/// The name of a reduction, e.g. "sum".
constexpr std::string_view to_string(reduce_op op) noexcept {
    switch (op) {
    case reduce_op::sum:
        return "sum";
    case reduce_op::max:
        return "max";
    case reduce_op::min:
        return "min";
    }
    return "unknown";
}

/// A communicator connects the `size()` replicas of one group; this replica is `rank()`.
/// Every collective must be called by every replica of the group in the same order with the
/// same counts; lockstep checks what a backend can check and throws lockstep::error on every
/// replica instead of hanging or returning garbage.
///
/// `system()` is the system this replica's buffers and kernels use (a host_system with this
/// replica's thread budget, or a cuda_system with this replica's device and stream).
/// Collectives (spans live in the memory of `C::system_type`):
/// - all_reduce(send, recv, op): recv[i] = op over replicas of send[i]; send may alias recv.
///   Integer sums wrap modulo 2^bits, as MPI's do (here and in reduce and reduce_scatter).
/// - broadcast(data, root): data on every replica becomes root's data.
/// - all_gather(send, recv): recv = concatenation of every replica's send, in rank order;
///   requires recv.size() == size() * send.size(); send may be this replica's slot of recv (in
///   place), else must not overlap it.
/// - reduce(send, recv, op, root): as all_reduce, but only root's recv is written.
/// - reduce_scatter(send, recv, counts, op): counts holds size() entries and send.size() is
///   their sum, equal on every replica; rank r's slice of send is the counts[r] elements from
///   offset_r = counts[0] + ... + counts[r-1]; ensures: recv[i] = op over replicas of
///   send[offset_rank() + i]; requires recv.size() == counts[rank()] (counts may be uneven and
///   may hold zeros). recv may be this replica's slice of send (in place), else must not
///   overlap send. reduce_scatter(send, recv, op) is the equal-count form: every count is
///   recv.size(), so send.size() == size() * recv.size().
/// - barrier(): returns once every replica has entered it.
/// - split(color, key): the sub-group of replicas with the same color, ranked by (key, rank).
/// The concept requires float, double and int; lockstep's backends also carry the 16-bit floats
/// lockstep::half and lockstep::bfloat16 in every collective (sums formed in float: see each
/// backend for the order and the number of roundings).
template <class C>
concept communicator = requires(C& c, const C& cc, std::span<float> f, std::span<const float> cf,
                                std::span<double> d, std::span<const double> cd, std::span<int> i,
                                std::span<const int> ci, std::span<const std::size_t> counts) {
    typename C::system_type;
    { cc.system() } -> std::convertible_to<typename C::system_type>;
    { cc.rank() } -> std::convertible_to<int>;
    { cc.size() } -> std::convertible_to<int>;
    c.all_reduce(cf, f, reduce_op::sum);
    c.all_reduce(cd, d, reduce_op::max);
    c.all_reduce(ci, i, reduce_op::min);
    c.broadcast(f, 0);
    c.all_gather(cf, f);
    c.reduce(cf, f, reduce_op::sum, 0);
    c.reduce_scatter(cf, f, counts, reduce_op::sum);
    c.reduce_scatter(cd, d, counts, reduce_op::max);
    c.reduce_scatter(ci, i, reduce_op::min);
    c.barrier();
    { c.split(0, 0) } -> std::same_as<C>;
};

/// Facts about a communicator type that trainers use. Specialise it for a communicator of your
/// own, or give the type a `static constexpr bool collectives_use_compute_cores`.
/// - collectives_use_compute_cores: the collectives' work runs on the replica's compute cores
///   (shared-memory copies), so a communication thread would compete with the compute instead
///   of overlapping it. Default: true for host-memory communicators, false for device ones.
template <class C>
struct communicator_traits {
    static constexpr bool collectives_use_compute_cores = [] {
        if constexpr (requires { C::collectives_use_compute_cores; })
            return static_cast<bool>(C::collectives_use_compute_cores);
        else
            return static_cast<bool>(C::system_type::is_host);
    }();
};

/// A communicator with a personalised exchange (reduce::compressed needs it; thread_group, MPI
/// and NCCL communicators have it; a communicator without it still models `communicator`):
/// - all_to_all(send, recv): send and recv hold size() blocks of b = send.size() / size()
///   elements each; block r of recv becomes block rank() of replica r's send (block rank() is
///   this replica's own).
///   requires: send.size() equal on every replica and a multiple of size(); recv.size() ==
///   send.size(); send and recv do not overlap (there is no in-place form).
template <class C>
concept all_to_all_communicator = communicator<C> &&
    requires(C& c, std::span<float> f, std::span<const float> cf, std::span<int> i,
             std::span<const int> ci) {
    c.all_to_all(cf, f);
    c.all_to_all(ci, i);
};

/// An all_to_all_communicator that can also leave out the block a replica sends itself:
/// - all_to_all_others(send, recv): as all_to_all(send, recv), except that recv's own block
///   (block rank()) is neither read nor written: a caller that reads its own block where it
///   lies in send saves copying it (mpi_communicator: one block fewer through MPI).
template <class C>
concept all_to_all_others_communicator = all_to_all_communicator<C> &&
    requires(C& c, std::span<float> f, std::span<const float> cf) {
    c.all_to_all_others(cf, f);
};

namespace detail {
/// The combine functor all_combine is required to accept in combine_communicator.
struct combine_probe {
    void operator()(const float* const* /*sources*/, std::size_t /*n*/, std::size_t /*first*/,
                    std::size_t /*m*/, float* /*out*/) const {}
};
} // namespace detail

/// A communicator with all_combine(arrays, count, recv, combine): recv[i] = a caller's
/// element-wise function of every replica's input arrays at i, computed once (by the element's
/// owner) and stored to every replica; see thread_communicator::all_combine.
template <class C>
concept combine_communicator = communicator<C> &&
    requires(C& c, std::span<const float* const> a, std::span<float> f) {
    c.all_combine(a, std::size_t{0}, f, detail::combine_probe{});
};

/// A communicator with point-to-point messages (needed by asynchronous training):
/// - send(data, dest, tag) / recv(data, source, tag): matched by (source, tag), in order.
///   ensures: the message held exactly data.size() elements of data's type, else it is
///   consumed, data is not written, and lockstep::error (errc::count_mismatch for another
///   count, errc::shape_mismatch for another element type) is thrown naming both: the message
///   is lost, not left for a retry.
/// - recv_any(data, tag) -> int: receives the next message with `tag` from any replica and
///   returns its source (a message that does not fit is consumed and refused as in recv).
template <class C>
concept point_to_point_communicator = communicator<C> &&
    requires(C& c, std::span<float> f, std::span<const float> cf) {
    c.send(cf, 0, 0);
    c.recv(f, 0, 0);
    { c.recv_any(f, 0) } -> std::convertible_to<int>;
};

} // namespace lockstep

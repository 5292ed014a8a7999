// lockstep/comm/detail/tag_forwarding.hpp: with_tag(c, tag), the collectives of a wrapped
// communicator called with the wrapper's caller's collective_tag where they take one.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"

#include <cstddef>
#include <span>
#include <type_traits>

namespace lockstep::detail {

/// The collectives of communicator `c`, each called with `tag` when c's collective takes a
/// collective_tag (the thread group's and MPI's) and without it when not (NCCL's): so that a
/// wrapper (simulated_link, hierarchical_communicator) hands its caller's name or call site
/// (check_call_sites) to the communicator that checks it, instead of its own line.
template <class C>
class tag_forwarder {
public:
    tag_forwarder(C& c, const collective_tag& tag) noexcept : c_(c), tag_(tag) {}

    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    reduce_op op) const {
        if constexpr (requires { c_.all_reduce(send, recv, op, tag_); })
            c_.all_reduce(send, recv, op, tag_);
        else
            c_.all_reduce(send, recv, op);
    }
    template <class T>
    void broadcast(std::span<T> data, int root) const {
        if constexpr (requires { c_.broadcast(data, root, tag_); })
            c_.broadcast(data, root, tag_);
        else
            c_.broadcast(data, root);
    }
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) const {
        if constexpr (requires { c_.all_gather(send, recv, tag_); })
            c_.all_gather(send, recv, tag_);
        else
            c_.all_gather(send, recv);
    }
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root) const {
        if constexpr (requires { c_.reduce(send, recv, op, root, tag_); })
            c_.reduce(send, recv, op, root, tag_);
        else
            c_.reduce(send, recv, op, root);
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op) const {
        if constexpr (requires { c_.reduce_scatter(send, recv, counts, op, tag_); })
            c_.reduce_scatter(send, recv, counts, op, tag_);
        else
            c_.reduce_scatter(send, recv, counts, op);
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op) const {
        if constexpr (requires { c_.reduce_scatter(send, recv, op, tag_); })
            c_.reduce_scatter(send, recv, op, tag_);
        else
            c_.reduce_scatter(send, recv, op);
    }
    template <class T>
    void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) const {
        if constexpr (requires { c_.all_to_all(send, recv, tag_); })
            c_.all_to_all(send, recv, tag_);
        else
            c_.all_to_all(send, recv);
    }
    void barrier() const {
        if constexpr (requires { c_.barrier(tag_); })
            c_.barrier(tag_);
        else
            c_.barrier();
    }

private:
    C& c_;
    const collective_tag& tag_;
};

/// c's collectives with `tag` (see tag_forwarder); use within the call that received the tag.
template <class C>
tag_forwarder<C> with_tag(C& c, const collective_tag& tag) noexcept {
    return {c, tag};
}

} // namespace lockstep::detail

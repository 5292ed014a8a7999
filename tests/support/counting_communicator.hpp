// tests/support/counting_communicator.hpp: a communicator wrapper that forwards every call to
// the communicator it wraps and counts the calls per collective kind. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace lockstep::testing {

/// Calls per kind seen by a counting_communicator (and by every communicator split from it).
struct collective_counts {
    int all_reduce = 0;
    int broadcast = 0;
    int all_gather = 0;
    int reduce = 0;
    int reduce_scatter = 0;
    int all_to_all = 0;
    int barrier = 0;
    int split = 0;
    int send = 0;
    int recv = 0;

    /// Collectives that move data or synchronise (everything except split and point-to-point).
    int collectives() const {
        return all_reduce + broadcast + all_gather + reduce + reduce_scatter + all_to_all + barrier;
    }
    friend bool operator==(const collective_counts&, const collective_counts&) = default;
};

/// Wraps a communicator by reference (it must outlive the wrapper) and models the communicator
/// concept itself. Communicators split from it own their inner communicator and count into the
/// same collective_counts, so a layer that splits once still shows every call it makes.
template <communicator Comm>
class counting_communicator {
public:
    using system_type = typename Comm::system_type;

    explicit counting_communicator(Comm& inner)
        : inner_(&inner), counts_(std::make_shared<collective_counts>()) {}

    /// The calls counted so far.
    const collective_counts& counts() const { return *counts_; }
    /// Sets every count to zero.
    void reset() { *counts_ = collective_counts{}; }

    decltype(auto) system() const { return inner_->system(); }
    int rank() const { return inner_->rank(); }
    int size() const { return inner_->size(); }

    template <class T>
    void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
        ++counts_->all_reduce;
        inner_->all_reduce(send, recv, op);
    }
    template <class T>
    void broadcast(std::span<T> data, int root) {
        ++counts_->broadcast;
        inner_->broadcast(data, root);
    }
    template <class T>
    void all_gather(std::span<const T> send, std::span<T> recv) {
        ++counts_->all_gather;
        inner_->all_gather(send, recv);
    }
    /// Where the wrapped communicator has all_to_all.
    template <class T>
    void all_to_all(std::span<const T> send,
                    std::span<T> recv) requires all_to_all_communicator<Comm> {
        ++counts_->all_to_all;
        inner_->all_to_all(send, recv);
    }
    template <class T>
    void reduce(std::span<const T> send, std::span<T> recv, reduce_op op, int root) {
        ++counts_->reduce;
        inner_->reduce(send, recv, op, root);
    }
    template <class T>
    void reduce_scatter(std::span<const T> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op) {
        ++counts_->reduce_scatter;
        inner_->reduce_scatter(send, recv, counts, op);
    }
    template <class T>
    void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
        ++counts_->reduce_scatter;
        inner_->reduce_scatter(send, recv, op);
    }
    void barrier() {
        ++counts_->barrier;
        inner_->barrier();
    }
    counting_communicator split(int color, int key) {
        ++counts_->split;
        std::shared_ptr<Comm> owned(new Comm(inner_->split(color, key)));
        return counting_communicator(std::move(owned), counts_);
    }

    template <class T>
    void send(std::span<const T> data, int dest,
              int tag) requires point_to_point_communicator<Comm> {
        ++counts_->send;
        inner_->send(data, dest, tag);
    }
    template <class T>
    void recv(std::span<T> data, int source, int tag) requires point_to_point_communicator<Comm> {
        ++counts_->recv;
        inner_->recv(data, source, tag);
    }
    template <class T>
    int recv_any(std::span<T> data, int tag) requires point_to_point_communicator<Comm> {
        ++counts_->recv;
        return inner_->recv_any(data, tag);
    }

    /// This object's communicator_identity (what bn::group keys its split by).
    std::uint64_t identity() const noexcept { return identity_.value(); }

private:
    counting_communicator(std::shared_ptr<Comm> owned, std::shared_ptr<collective_counts> counts)
        : owned_(std::move(owned)), inner_(owned_.get()), counts_(std::move(counts)) {}

    std::shared_ptr<Comm> owned_;
    Comm* inner_;
    std::shared_ptr<collective_counts> counts_;
    communicator_identity identity_;
};

} // namespace lockstep::testing

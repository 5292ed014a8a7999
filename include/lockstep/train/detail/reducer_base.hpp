// lockstep/train/detail/reducer_base.hpp: the reducer interface every ReducePolicy implements,
// and reducer_base, which owns the bucket plan, the launch order and where pieces are reduced.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"

#include <atomic>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// reducer<Policy, T, Communicator> reduces one flat buffer laid out as `tensors` over the
/// replicas of a communicator. Interface (every specialisation, through reducer_base):
/// - reducer(comm, tensors, overlap = {}): plans the pieces (buckets) once; with
///   `overlap.enabled` the pieces are reduced on a comm_stream (a communication thread at
///   `overlap.priority` on the host, a side stream on CUDA) while the caller goes on computing
///   (collective: every replica passes the same `overlap`).
/// - begin(data, check = {}): starts the reduction of data (the flat gradient buffer); nothing
///   launched. check(k, piece), when given, is called right before piece k is launched.
/// - mark_ready(t): tensor t of data is final; launches every piece now complete, in order.
/// - finish(): launches the rest and waits for all of them (on CUDA: the compute stream waits).
///   ensures: data holds the sum over replicas on every replica (parameter_server: on Root;
///   the other replicas' data is unspecified).
/// - apply(values, update): runs update() (the optimizer step on values from data) where the
///   policy updates, and makes values identical everywhere (parameter_server: broadcast).
/// - average(values): values = the mean over replicas on every replica (local SGD).
/// - plan(): the pieces, in launch order. collectives(): collectives issued so far.
/// Every replica issues the same collectives in the same order, whatever it marks ready.
template <class Policy, class T, class Communicator>
class reducer;

/// Whether a reducer reduces its pieces on a comm_stream, and at which priority the stream's
/// communication thread runs (detail::use_overlap decides both).
struct overlap_setting {
    bool enabled = false;
    comm_priority priority = comm_priority::normal;
};

/// What every reducer shares: the bucket plan, the launch order, and where a piece is reduced
/// (inline on the replica's communicator, or on its communication stream). A policy derives from
/// it and supplies `reduce_piece(Communicator& c, std::span<T> piece)` (or
/// `reduce_piece(c, piece, const bucket& b)` when it needs to know which piece of the plan it
/// is: b is the element of plan()), the collective(s) that reduce one piece over `c` (run with c's
/// system for its kernels; returning void for one collective, or the number it issued), and
/// overrides apply/average where it differs.
template <class Derived, class T, class Communicator>
class reducer_base {
public:
    reducer_base(Communicator& comm, std::vector<bucket> plan, std::size_t tensors,
                 overlap_setting overlap)
        : comm_(&comm), launcher_(std::move(plan), tensors) {
        if (overlap.enabled)
            stream_.emplace(comm, overlap.priority);
    }

    /// Called as check(k, piece) on the calling thread right before piece k (of plan()) is
    /// launched: the piece still holds this replica's own values (enqueue device work to
    /// inspect them; on CUDA it runs before the reduction, which waits for the caller's stream).
    using piece_check = std::function<void(std::size_t, const bucket&)>;

    void begin(std::span<T> data, piece_check check = {}) {
        data_ = data;
        check_ = std::move(check);
        launcher_.reset();
    }
    void mark_ready(std::size_t t) {
        launcher_.mark_ready(t, [&](const bucket& b) { launch(b); });
    }
    void finish() {
        launcher_.finish([&](const bucket& b) { launch(b); });
        if (stream_)
            stream_->join();
    }
    template <class Update>
    void apply(std::span<T> /*values*/, Update&& update) {
        update();
    }
    void average(std::span<T> values) {
        begin(values);
        finish();
        scale(comm_->system(), values, T(1) / static_cast<T>(comm_->size()));
    }
    const std::vector<bucket>& plan() const noexcept { return launcher_.plan(); }
    std::size_t collectives() const noexcept {
        return collectives_.load(std::memory_order_relaxed);
    }
    /// After a failed step: waits for the pieces still in flight and drops their errors, so a
    /// later step starts with an empty stream.
    void drain() noexcept {
        if (!stream_)
            return;
        try {
            stream_->join();
        } catch (...) {
        }
    }
    /// True when pieces are reduced on a communication stream, beside the compute.
    bool overlaps() const noexcept { return stream_.has_value(); }

protected:
    Communicator& comm() noexcept { return *comm_; }
    void count_collective() noexcept { collectives_.fetch_add(1, std::memory_order_relaxed); }

private:
    void launch(const bucket& b) {
        if (check_)
            check_(static_cast<std::size_t>(&b - launcher_.plan().data()), b);
        std::span<T> piece = data_.subspan(b.offset, b.size);
        if (stream_)
            stream_->submit([this, piece, pb = &b](Communicator& c) { reduce(c, piece, *pb); });
        else
            reduce(*comm_, piece, b);
    }
    void reduce(Communicator& c, std::span<T> piece, const bucket& b) {
        Derived& self = static_cast<Derived&>(*this);
        const auto run = [&] {
            if constexpr (requires { self.reduce_piece(c, piece, b); })
                return self.reduce_piece(c, piece, b);
            else
                return self.reduce_piece(c, piece);
        };
        if constexpr (std::is_void_v<decltype(run())>) {
            run();
            collectives_.fetch_add(1, std::memory_order_relaxed);
        } else {
            collectives_.fetch_add(run(), std::memory_order_relaxed);
        }
    }

    Communicator* comm_;
    ordered_launcher launcher_;
    std::span<T> data_;
    piece_check check_;
    std::atomic<std::size_t> collectives_{0}; // the communication thread adds to it
    std::optional<comm_stream<Communicator>> stream_;
};

} // namespace lockstep::detail

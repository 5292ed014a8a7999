// lockstep/train/detail/reducer.hpp: reducer<ReducePolicy, T, Communicator>, the object that
// carries out one ReducePolicy for a trainer, and the all_reduce-based reducers (per_tensor,
// bucketed). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_compressed.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/reduce_parameter_server.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// reducer<Policy, T, Communicator> reduces one flat buffer laid out as `tensors` over the
/// replicas of a communicator. Interface (every specialisation):
/// - reducer(comm, tensors): plans the pieces (buckets) once.
/// - begin(data): starts the reduction of data (the flat gradient buffer); nothing launched.
/// - mark_ready(t): tensor t of data is final; launches every piece now complete, in order.
/// - finish(): launches the rest. ensures: data holds the sum over replicas on every replica
///   (parameter_server: on Root; the other replicas' data is unspecified).
/// - apply(values, update): runs update() (the optimizer step on values from data) where the
///   policy updates, and makes values identical everywhere (parameter_server: broadcast).
/// - average(values): values = the mean over replicas on every replica (local SGD).
/// - plan(): the pieces, in launch order. collectives(): collectives issued so far.
/// Every replica issues the same collectives in the same order, whatever it marks ready.
template <class Policy, class T, class Communicator>
class reducer;

/// per_tensor and bucketed: one in-place all_reduce (sum) per piece.
template <class T, class Communicator>
class all_reduce_reducer {
public:
    all_reduce_reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
                       std::size_t first_bytes, std::size_t bytes)
        : comm_(&comm),
          launcher_(plan_buckets(tensors, sizeof(T), first_bytes, bytes), tensors.size()) {}

    void begin(std::span<T> data) {
        data_ = data;
        launcher_.reset();
    }
    void mark_ready(std::size_t t) {
        launcher_.mark_ready(t, [&](const bucket& b) { launch(b); });
    }
    void finish() {
        launcher_.finish([&](const bucket& b) { launch(b); });
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
    std::size_t collectives() const noexcept { return collectives_; }

private:
    void launch(const bucket& b) {
        std::span<T> piece = data_.subspan(b.offset, b.size);
        comm_->all_reduce(std::span<const T>(piece), piece, reduce_op::sum);
        ++collectives_;
    }

    Communicator* comm_;
    ordered_launcher launcher_;
    std::span<T> data_;
    std::size_t collectives_ = 0;
};

/// reduce::per_tensor: every tensor is its own piece.
template <class T, class Communicator>
class reducer<reduce::per_tensor, T, Communicator> : public all_reduce_reducer<T, Communicator> {
public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors)
        : all_reduce_reducer<T, Communicator>(comm, tensors, 1, 1) {}
};

/// reduce::bucketed<Bytes, FirstBytes>: buckets of ~Bytes (the first ~FirstBytes).
template <std::size_t Bytes, std::size_t FirstBytes, class T, class Communicator>
class reducer<reduce::bucketed<Bytes, FirstBytes>, T, Communicator>
    : public all_reduce_reducer<T, Communicator> {
    using policy = reduce::bucketed<Bytes, FirstBytes>;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors)
        : all_reduce_reducer<T, Communicator>(comm, tensors, policy::first_bucket_bytes,
                                              policy::bucket_bytes) {}
};

} // namespace lockstep::detail

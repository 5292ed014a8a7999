// lockstep/train/detail/reduce_compressed.hpp: the reducer of reduce::compressed<Wire> (buckets
// reduced by compressed_all_reduce on 16-bit wire values). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/compressed_all_reduce.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

template <class Policy, class T, class Communicator>
class reducer;

/// reduce::compressed<Wire>: per bucket (the plan of reduce::bucketed<>), every replica rounds
/// its gradient to Wire (nearest even) and the buckets are summed by compressed_all_reduce: a
/// reduce-scatter of 16-bit shards (all_to_all, each replica sums its shard in float in rank
/// order and rounds the sum to Wire) and an all_gather of the rounded shards, so every replica
/// gets the same bits. Each replica sends about half the bytes of a float all-reduce.
/// Error per element: |err| <= u sum_r |g_r| + u |sum_r g_r| + (size - 1) 2^-24 sum_r |g_r|,
/// u = Wire::unit_roundoff (compressed_all_reduce.hpp states the details).
/// requires: Communicator models all_to_all_communicator.
template <class Wire, class T, class Communicator>
class reducer<reduce::compressed<Wire>, T, Communicator> {
    using buckets = reduce::bucketed<>;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors)
        : comm_(&comm), launcher_(plan_buckets(tensors, sizeof(T), buckets::first_bucket_bytes,
                                               buckets::bucket_bytes),
                                  tensors.size()) {
        std::size_t largest = 0;
        for (const bucket& b : launcher_.plan())
            largest = std::max(largest, b.size);
        ws_ = compressed_workspace<T, system_type>(comm.system(), comm.size(), largest,
                                                   compressed_chunk_elements<Communicator>);
    }

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
    /// Not offered: weights rounded to 16 bits would lose the model (policy/compat.hpp rejects
    /// local SGD with compressed reduction at compile time).
    void average(std::span<T>) = delete;

    const std::vector<bucket>& plan() const noexcept { return launcher_.plan(); }
    std::size_t collectives() const noexcept { return collectives_; }

private:
    using system_type = typename Communicator::system_type;

    void launch(const bucket& b) {
        collectives_ += compressed_all_reduce<Wire>(*comm_, data_.subspan(b.offset, b.size), ws_);
    }

    Communicator* comm_;
    ordered_launcher launcher_;
    std::span<T> data_;
    compressed_workspace<T, system_type> ws_;
    std::size_t collectives_ = 0;
};

} // namespace lockstep::detail

// lockstep/train/detail/reduce_compressed.hpp: the reducer of reduce::compressed<Wire> (buckets
// reduced by compressed_all_reduce on 16-bit wire values). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/compressed_all_reduce.hpp"
#include "lockstep/train/detail/reducer_base.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// reduce::compressed<Wire>: per bucket (the plan of reduce::bucketed<>), every replica rounds
/// its gradient to Wire (nearest even) and the buckets are summed by compressed_all_reduce: a
/// reduce-scatter of 16-bit shards (all_to_all, each replica sums its shard in float in rank
/// order and rounds the sum to Wire) and an all_gather of the rounded shards, so every replica
/// gets the same bits. Each replica sends about half the bytes of a float all-reduce.
/// Error per element: |err| <= u sum_r |g_r| + u |sum_r g_r| + (size - 1) 2^-24 sum_r |g_r|,
/// u = Wire::unit_roundoff (compressed_all_reduce.hpp states the details).
/// requires: Communicator models all_to_all_communicator.
template <class Wire, class T, class Communicator>
class reducer<reduce::compressed<Wire>, T, Communicator>
    : public reducer_base<reducer<reduce::compressed<Wire>, T, Communicator>, T, Communicator> {
    using buckets = reduce::bucketed<>;
    using base = reducer_base<reducer, T, Communicator>;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
            overlap_setting overlap = {})
        : base(comm,
               plan_buckets(tensors, sizeof(T), buckets::first_bucket_bytes, buckets::bucket_bytes),
               tensors.size(), overlap) {
        std::size_t largest = 0;
        for (const bucket& b : this->plan())
            largest = std::max(largest, b.size);
        ws_ = compressed_workspace<T, system_type>(comm.system(), comm.size(), largest,
                                                   compressed_chunk_elements<Communicator>);
    }

    /// Not offered: weights rounded to 16 bits would lose the model (policy/compat.hpp rejects
    /// local SGD with compressed reduction at compile time).
    void average(std::span<T>) = delete;

    /// One piece: compressed_all_reduce over c (kernels on c's system); returns the
    /// collectives it issued.
    std::size_t reduce_piece(Communicator& c, std::span<T> piece) {
        return compressed_all_reduce<Wire>(c, piece, ws_);
    }

private:
    using system_type = typename Communicator::system_type;

    compressed_workspace<T, system_type> ws_;
};

} // namespace lockstep::detail

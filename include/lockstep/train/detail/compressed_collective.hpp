// lockstep/train/detail/compressed_collective.hpp: the collective of reduce::compressed<Wire>
// (buckets reduced by compressed_all_reduce on 16-bit wire values).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/bucketed_collective.hpp"
#include "lockstep/train/detail/compressed_all_reduce.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/train_params.hpp"

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
class collective<reduce::compressed<Wire>, T, Communicator>
    : public piecewise_collective<collective<reduce::compressed<Wire>, T, Communicator>, T,
                                  Communicator> {
    using base = piecewise_collective<collective, T, Communicator>;
    using system_type = typename Communicator::system_type;

public:
    collective(Communicator& comm, const std::vector<tensor_info>& tensors,
               overlap_setting overlap = {}, const train_params& /*params*/ = {})
        : base(comm, plan_buckets_of<reduce::bucketed<>>(tensors, sizeof(T)), tensors.size(),
               overlap) {
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
    compressed_workspace<T, system_type> ws_;
};

} // namespace lockstep::detail

// lockstep/train/detail/reducer.hpp: reducer<ReducePolicy, T, Communicator>, the object that
// carries out one ReducePolicy for a trainer, and the all_reduce-based reducers (per_tensor,
// bucketed). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_compressed.hpp"
#include "lockstep/train/detail/reduce_parameter_server.hpp"
#include "lockstep/train/detail/reduce_sharded.hpp"
#include "lockstep/train/detail/reducer_base.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// per_tensor and bucketed: one in-place all_reduce (sum) per piece.
template <class T, class Communicator>
class all_reduce_reducer
    : public reducer_base<all_reduce_reducer<T, Communicator>, T, Communicator> {
    using base = reducer_base<all_reduce_reducer<T, Communicator>, T, Communicator>;

public:
    all_reduce_reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
                       std::size_t first_bytes, std::size_t bytes, overlap_setting overlap)
        : base(comm, plan_buckets(tensors, sizeof(T), first_bytes, bytes), tensors.size(),
               overlap) {}

    void reduce_piece(Communicator& c, std::span<T> piece) {
        c.all_reduce(std::span<const T>(piece), piece, reduce_op::sum);
    }
};

/// reduce::per_tensor: every tensor is its own piece.
template <class T, class Communicator>
class reducer<reduce::per_tensor, T, Communicator> : public all_reduce_reducer<T, Communicator> {
public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
            overlap_setting overlap = {})
        : all_reduce_reducer<T, Communicator>(comm, tensors, 1, 1, overlap) {}
};

/// reduce::bucketed<Bytes, FirstBytes>: buckets of ~Bytes (the first ~FirstBytes).
template <std::size_t Bytes, std::size_t FirstBytes, class T, class Communicator>
class reducer<reduce::bucketed<Bytes, FirstBytes>, T, Communicator>
    : public all_reduce_reducer<T, Communicator> {
    using policy = reduce::bucketed<Bytes, FirstBytes>;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
            overlap_setting overlap = {})
        : all_reduce_reducer<T, Communicator>(comm, tensors, policy::first_bucket_bytes,
                                              policy::bucket_bytes, overlap) {}
};

} // namespace lockstep::detail

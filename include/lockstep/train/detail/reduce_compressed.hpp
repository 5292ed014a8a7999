// lockstep/train/detail/reduce_compressed.hpp: the reducer of reduce::compressed<Wire>
// (16-bit wire, gathered, summed in rank order in T). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/reducer_base.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep::detail {

/// reduce::compressed<Wire>: per bucket, every replica rounds its gradient to Wire (nearest
/// even), packs two wire values per 32-bit word, all_gathers the words, and sums the size()
/// rounded contributions in T in rank order, so every replica computes the same bits.
/// Communicators cannot sum 16-bit floats, hence gather-then-sum: each replica sends n/2 words
/// (half the bytes of a float all_reduce's payload) but receives (size - 1) n/2 words and
/// sums size x n values, so it pays off for few replicas or slow links. Error: each
/// contribution is rounded once (relative error <= Wire::unit_roundoff); the sum is exact in T
/// up to T's own rounding.
template <class Wire, class T, class Communicator>
class reducer<reduce::compressed<Wire>, T, Communicator>
    : public reducer_base<reducer<reduce::compressed<Wire>, T, Communicator>, T, Communicator> {
    using buckets = reduce::bucketed<>;
    using base = reducer_base<reducer, T, Communicator>;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors, bool overlap = false)
        : base(comm,
               plan_buckets(tensors, sizeof(T), buckets::first_bucket_bytes, buckets::bucket_bytes),
               tensors.size(), overlap) {
        std::size_t largest = 0;
        for (const bucket& b : this->plan())
            largest = std::max(largest, b.size);
        const std::size_t words = (largest + 1) / 2;
        send_ = buffer<int, system_type>(words, comm.system());
        recv_ =
            buffer<int, system_type>(words * static_cast<std::size_t>(comm.size()), comm.system());
    }

    /// Not offered: weights rounded to 16 bits would lose the model (policy/compat.hpp rejects
    /// local SGD with compressed reduction at compile time).
    void average(std::span<T>) = delete;

    /// One piece: rounded, gathered, summed in rank order (kernels on c's system).
    void reduce_piece(Communicator& c, std::span<T> piece) {
        const auto sys = c.system();
        const std::size_t words = (piece.size() + 1) / 2;
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(words),
                         pack_wire_fn<Wire, T>{piece.data(), piece.size(), send_.data()});
        const std::size_t ranks = static_cast<std::size_t>(c.size());
        c.all_gather(std::span<const int>(send_.data(), words),
                     std::span<int>(recv_.data(), words * ranks));
        thrust::for_each(
            sys.policy(), thrust::counting_iterator<std::size_t>(0),
            thrust::counting_iterator<std::size_t>(words),
            sum_wire_fn<Wire, T>{recv_.data(), words, c.size(), piece.data(), piece.size()});
    }

private:
    using system_type = typename Communicator::system_type;

    buffer<int, system_type> send_, recv_;
};

} // namespace lockstep::detail

// lockstep/train/detail/reduce_reproducible.hpp: the reducer of reduce::reproducible<C>: the
// chunk plan and the anchored accumulator (anchored_accumulator.hpp) it drives.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/anchored_accumulator.hpp"
#include "lockstep/train/detail/reducer.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/shard.hpp"

#include <cstddef>
#include <vector>

namespace lockstep::detail {

/// The chunks [first, last) of a global batch of `global` samples cut into chunks of `chunk`
/// samples that replica `rank` of `size` computes: contiguous, balanced by chunk count (the
/// first replicas get one more), possibly none. requires: chunk >= 1.
inline shard_range reproducible_chunks(std::size_t global, std::size_t chunk, int rank, int size) {
    const reduce::chunk_run c = reduce::chunks_of(global, chunk, rank, size);
    shard_range out;
    out.begin = c.first;
    out.end = c.first + c.count;
    return out;
}

/// One task: the loss a replica adds to the step's status loss slot: the global exact loss on
/// replica 0 only (so the status sum over replicas is that loss, bitwise), plus the sum of this
/// replica's non-finite chunk losses (so the replica that produced one is named).
struct reproducible_loss_fn {
    const double* own;
    const double* global;
    bool first;
    double* loss;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        const double o = *own;
        const bool finite = o - o == 0.0;
        *loss += (first ? *global : 0.0) + (finite ? 0.0 : o);
    }
};

/// reduce::reproducible<C>: the per-tensor plan (for the trainer's checks and buckets()) and the
/// anchored accumulator; requires a communicator with all_to_all; the reproducible step driver
/// (reproducible_driver.hpp) drives it (it is never launched piece by piece).
template <std::size_t C, std::size_t G, class T, class Communicator>
class reducer<reduce::reproducible<C, G>, T, Communicator>
    : public all_reduce_reducer<T, Communicator> {
public:
    using system_type = typename Communicator::system_type;

    static_assert(all_to_all_communicator<Communicator>,
                  "reduce::reproducible needs a communicator with all_to_all (thread_group, MPI, "
                  "NCCL, and hierarchical ones whose parts have it)");

    reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
            overlap_setting /*overlap*/ = {})
        : all_reduce_reducer<T, Communicator>(comm, tensors, 1, 1, overlap_setting{}),
          acc_(count(tensors), comm.size(), comm.rank(), comm.system(), G,
               combine_communicator<Communicator> && system_type::is_host,
               all_to_all_others_communicator<Communicator> && system_type::is_host) {}

    anchored_accumulator<T, system_type>& accumulator() noexcept { return acc_; }
    /// Counts the collectives of a step.
    void count_step() noexcept {
        for (std::size_t k = 0; k < acc_.collectives(); ++k)
            this->count_collective();
    }

private:
    static std::size_t count(const std::vector<tensor_info>& tensors) {
        std::size_t n = 0;
        for (const tensor_info& t : tensors)
            n = t.offset + t.size > n ? t.offset + t.size : n;
        return n;
    }

    anchored_accumulator<T, system_type> acc_;
};

} // namespace lockstep::detail

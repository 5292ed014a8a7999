// lockstep/train/detail/reduce_reproducible.hpp: the reducer of reduce::reproducible<C>: the
// chunk plan and the exact (binned) accumulator of chunk gradients and losses.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/exact_sum.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/reducer.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/shard.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

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

/// Exact, order-independent sums of n gradient elements and one loss (element n), in the binned
/// representation of kernels/exact_sum.hpp, on System. Per step: clear(), add() per chunk,
/// finalize_local() (this replica's own sum, for its checks), reduce() (collective), finalize().
/// Three doubles in the system's memory hold a chunk's device loss, this replica's own loss and
/// the global loss (chunk_loss(), own_loss(), global_loss()).
template <class T, class System>
class binned_accumulator {
public:
    binned_accumulator(std::size_t n, const System& sys)
        : n_(n), sys_(sys), top_(n + 1, sys), global_top_(n + 1, sys),
          bins_(kernels::binned::window * (n + 1), sys), losses_(3, sys) {}

    std::size_t size() const noexcept { return n_; }
    double* chunk_loss() noexcept { return losses_.data(); }
    double* own_loss() noexcept { return losses_.data() + 1; }
    double* global_loss() noexcept { return losses_.data() + 2; }

    /// ensures: every element (and the loss) is empty.
    void clear() { run(n_ + 1, kernels::binned_clear_fn{top_.data(), bins_.data(), n_ + 1}); }
    /// Adds one chunk's gradient g (n values) exactly. requires: g.size() == size().
    void add(std::span<const T> g) {
        run(n_, kernels::binned_add_fn<T>{g.data(), top_.data(), bins_.data(), n_ + 1, 0});
    }
    /// Adds one chunk's loss: `value` plus *device_value when not null (the system's memory).
    void add_loss(double value, const double* device_value) {
        run(1, kernels::binned_add_scalar_fn{device_value, value, top_.data(), bins_.data(), n_ + 1,
                                             n_});
    }
    /// This replica's own sums, rounded: g (n values) and *loss (system memory).
    void finalize_local(std::span<T> g, double* loss) { write(top_.data(), g, loss); }
    /// Cross-replica exact sum: MAX all_reduce of the n + 1 tops, windows aligned to them, SUM
    /// all_reduce of the 3 (n + 1) int64 bins (exact). Collective on comm.
    template <class Communicator>
    void reduce(Communicator& comm) {
        comm.all_reduce(std::span<const std::int64_t>(top_.span()), global_top_.span(),
                        reduce_op::max);
        run(n_ + 1,
            kernels::binned_align_fn{global_top_.data(), top_.data(), bins_.data(), n_ + 1});
        comm.all_reduce(std::span<const std::int64_t>(bins_.span()), bins_.span(), reduce_op::sum);
    }
    /// After reduce(): the global sums, rounded once: g (n values) and *loss (system memory).
    void finalize(std::span<T> g, double* loss) { write(global_top_.data(), g, loss); }

private:
    template <class F>
    void run(std::size_t count, const F& f) {
        kernels::for_each_index(sys_, count, f);
    }
    void write(const std::int64_t* top, std::span<T> g, double* loss) {
        run(n_, kernels::binned_finalize_fn<T>{top, bins_.data(), n_ + 1, 0, g.data()});
        run(1, kernels::binned_finalize_fn<double>{top, bins_.data(), n_ + 1, n_, loss});
    }

    std::size_t n_;
    System sys_;
    buffer<std::int64_t, System> top_;        ///< this replica's top bin per element
    buffer<std::int64_t, System> global_top_; ///< the MAX over replicas of top_
    buffer<std::int64_t, System> bins_;       ///< window j of element i at j * (n + 1) + i
    buffer<double, System> losses_;           ///< chunk, own and global loss
};

/// One task: the loss a replica adds to the step's status loss slot: the global exact loss on
/// replica 0 only (so the status sum over replicas is that loss, bitwise), plus this replica's
/// own loss when it is not finite (so the replica that produced it is named).
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
/// binned accumulator; the reproducible step driver (reproducible_driver.hpp) drives it (it is
/// never launched piece by piece).
template <std::size_t C, class T, class Communicator>
class reducer<reduce::reproducible<C>, T, Communicator>
    : public all_reduce_reducer<T, Communicator> {
public:
    using system_type = typename Communicator::system_type;

    reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
            overlap_setting /*overlap*/ = {})
        : all_reduce_reducer<T, Communicator>(comm, tensors, 1, 1, overlap_setting{}),
          acc_(count(tensors), comm.system()) {}

    binned_accumulator<T, system_type>& accumulator() noexcept { return acc_; }
    /// The collectives of a step: the MAX and SUM all_reduce.
    void count_step() noexcept {
        this->count_collective();
        this->count_collective();
    }

private:
    static std::size_t count(const std::vector<tensor_info>& tensors) {
        std::size_t n = 0;
        for (const tensor_info& t : tensors)
            n = t.offset + t.size > n ? t.offset + t.size : n;
        return n;
    }

    binned_accumulator<T, system_type> acc_;
};

} // namespace lockstep::detail

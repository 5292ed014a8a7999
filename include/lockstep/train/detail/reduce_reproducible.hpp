// lockstep/train/detail/reduce_reproducible.hpp: the reducer of reduce::reproducible<C>: the
// chunk plan and the order-independent accumulator of chunk gradients and losses.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
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

/// The loss's binned top (kernels/exact_sum.hpp) as an exponent field, so that it travels in
/// the fields' MAX all_reduce: empty -> 0, top t -> t + 1 (t <= 52), non-finite -> non_finite.
template <class Field>
struct loss_top_encode_fn {
    const std::int64_t* top;
    Field* field;
    Field non_finite;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        const std::int64_t t = *top;
        *field = t == kernels::binned::non_finite_top
                     ? non_finite
                     : static_cast<Field>(t == kernels::binned::empty_top ? 0 : t + 1);
    }
};

/// The inverse of loss_top_encode_fn on the MAX of the fields: the global top, to which the
/// loss's window (top, bins) is moved.
template <class Field>
struct loss_top_align_fn {
    const Field* field;
    Field non_finite;
    std::int64_t* global_top;
    std::int64_t* top;
    std::int64_t* bins;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        const Field f = *field;
        *global_top =
            f == non_finite ? kernels::binned::non_finite_top : static_cast<std::int64_t>(f) - 1;
        kernels::binned_align_fn{global_top, top, bins, 1}(0);
    }
};

/// Order-independent sums of n gradient elements (kernels/anchored_sum.hpp: fixed point
/// anchored at each element's largest exponent) and one loss (kernels/exact_sum.hpp: binned),
/// on System. Per step: begin(chunks), add() and add_loss() per chunk (every chunk but the last
/// is kept: (chunks - 1) n values), reduce_fields() (collective), convert(), check_local() (this
/// replica's own sums, for its checks), reduce_limbs() (collective), finalize(). Three doubles
/// in the system's memory hold a chunk's device loss, this replica's own loss and the global
/// loss (chunk_loss(), own_loss(), global_loss()). Memory: the fields (2 per element), the limbs
/// (2 int64 per element) and the kept chunks.
template <class T, class System>
class anchored_accumulator {
public:
    using field_type = typename kernels::anchored<T>::exponent_type;
    static constexpr field_type non_finite = kernels::anchored<T>::non_finite;

    anchored_accumulator(std::size_t n, const System& sys)
        : n_(n), sys_(sys), field_(n + 1, sys), global_field_(n + 1, sys),
          limbs_(2 * n + kernels::binned::window, sys), loss_top_(2, sys), losses_(3, sys) {}

    std::size_t size() const noexcept { return n_; }
    double* chunk_loss() noexcept { return losses_.data(); }
    double* own_loss() noexcept { return losses_.data() + 1; }
    double* global_loss() noexcept { return losses_.data() + 2; }

    /// Starts a step in which this replica adds `chunks` chunks. requires: chunks >= 1.
    void begin(std::size_t chunks) {
        chunks_ = chunks;
        added_ = 0;
        const std::size_t kept = (chunks - 1) * n_;
        if (store_.size() < kept)
            store_ = buffer<T, System>(kept, sys_);
        run(1, kernels::binned_clear_fn{loss_top_.data(), loss_bins(), 1});
    }
    /// Adds one chunk's gradient g (n values; the last chunk's must stay in g until check_local).
    /// requires: g.size() == size(), fewer than `chunks` added.
    void add(std::span<const T> g) {
        T* store = added_ + 1 < chunks_ ? store_.data() + added_ * n_ : nullptr;
        run(n_, kernels::anchored_gather_fn<T>{g.data(), store, field_.data(), added_ == 0});
        ++added_;
    }
    /// Adds one chunk's loss: `value` plus *device_value when not null (the system's memory).
    void add_loss(double value, const double* device_value) {
        run(1, kernels::binned_add_scalar_fn{device_value, value, loss_top_.data(), loss_bins(), 1,
                                             0});
    }
    /// MAX all_reduce of the exponent fields (the loss's top with them). Collective on comm.
    template <class Communicator>
    void reduce_fields(Communicator& comm) {
        run(1, loss_top_encode_fn<field_type>{loss_top_.data(), field_.data() + n_, non_finite});
        comm.all_reduce(std::span<const field_type>(field_.span()), global_field_.span(),
                        reduce_op::max);
    }
    /// The limbs of every element for the global anchors. last: the last chunk's gradient.
    void convert(std::span<const T> last) {
        run(n_, kernels::anchored_convert_fn<T>{chunks(last.data()), global_field_.data(),
                                                limbs_.data(), limbs_.data() + n_});
    }
    /// g (the last chunk's gradient) becomes non-finite exactly where this replica's own sums
    /// are (finite elsewhere); *loss = this replica's own loss.
    void check_local(std::span<T> g, double* loss) {
        run(n_, kernels::anchored_own_check_fn<T>{chunks(g.data()), field_.data(), g.data()});
        run(1, kernels::binned_finalize_fn<double>{loss_top_.data(), loss_bins(), 1, 0, loss});
    }
    /// SUM all_reduce of the limbs (and of the loss's aligned bins). Collective on comm.
    template <class Communicator>
    void reduce_limbs(Communicator& comm) {
        run(1, loss_top_align_fn<field_type>{global_field_.data() + n_, non_finite,
                                             loss_top_.data() + 1, loss_top_.data(), loss_bins()});
        comm.all_reduce(std::span<const std::int64_t>(limbs_.span()), limbs_.span(),
                        reduce_op::sum);
    }
    /// After reduce_limbs(): the global sums, rounded once: g (n values) and *loss.
    void finalize(std::span<T> g, double* loss) {
        run(n_, kernels::anchored_finalize_fn<T>{global_field_.data(), limbs_.data(),
                                                 limbs_.data() + n_, g.data()});
        run(1, kernels::binned_finalize_fn<double>{loss_top_.data() + 1, loss_bins(), 1, 0, loss});
    }

private:
    template <class F>
    void run(std::size_t count, const F& f) {
        kernels::for_each_index(sys_, count, f);
    }
    std::int64_t* loss_bins() noexcept { return limbs_.data() + 2 * n_; }
    kernels::anchored_chunks<T> chunks(const T* last) const noexcept {
        return {store_.data(), last, chunks_, n_};
    }

    std::size_t n_;
    System sys_;
    std::size_t chunks_ = 1;
    std::size_t added_ = 0;
    buffer<field_type, System> field_;        ///< this replica's fields (element n: the loss)
    buffer<field_type, System> global_field_; ///< their MAX over replicas: the anchors
    buffer<std::int64_t, System> limbs_;      ///< hi of element i at i, lo at n + i, loss bins
    buffer<std::int64_t, System> loss_top_;   ///< the loss's own and global top
    buffer<double, System> losses_;           ///< chunk, own and global loss
    buffer<T, System> store_;                 ///< every chunk but the last
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
/// anchored accumulator; the reproducible step driver (reproducible_driver.hpp) drives it (it is
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

    anchored_accumulator<T, system_type>& accumulator() noexcept { return acc_; }
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

    anchored_accumulator<T, system_type> acc_;
};

} // namespace lockstep::detail

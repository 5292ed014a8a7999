// lockstep/train/detail/step_checks.hpp: the device-side checks of a training step (non-finite
// gradient elements per replica before reduction and of the reduced gradient, the gradient norm,
// the skip decision and the gradient factor) as host/device functors over Thrust.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/mixed_precision.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/check_order.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/step_state.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>

// The CUDA system's passes of the checks (found by argument-dependent lookup).
#if LOCKSTEP_HAS_CUDA
#include "lockstep/train/detail/check_order_cuda.cuh"
#endif

namespace lockstep::detail {

/// Before the status all_reduce, from the pre-reduction tiles' sums: this replica's row and its
/// part of the totals; totals->loss += loss first, then the loss is checked.
struct finish_local_fn {
    double loss;
    double global_batch;
    double lr;
    step_totals* totals;
    replica_row* row;    ///< this replica's row
    save_word save;      ///< its background checkpoint save
    double trainer;      ///< the trainer's ordinal on its communicator (trainer_ordinal.hpp)
    double first_sample; ///< the global index of the step's first sample
    const kernels::loss_scale_device_state* scale; ///< the loss scale the step uses (or null)
    const std::int64_t* params; ///< the parameters' digest (first step), or null (0 in the row)
    LOCKSTEP_HOST_DEVICE void operator()(const check_sums& s) const {
        const double count = s.count;
        const double first = s.first;
        totals->loss += loss;
        const double bad_loss = is_finite(totals->loss) ? 0.0 : 1.0;
        totals->non_finite = count;
        totals->loss_non_finite = bad_loss;
        row->non_finite = count;
        row->first_non_finite = first;
        row->loss_non_finite = bad_loss;
        row->global_batch = global_batch;
        row->lr = lr;
        row->trainer = trainer;
        row->first_sample = first_sample;
        row->loss_scale = scale != nullptr ? scale->scale : 1.0;
        row->scale_growth = scale != nullptr ? scale->growth_tracker : 0.0;
        // The top 52 bits: an integer a double holds exactly.
        row->params = params != nullptr
                          ? static_cast<double>(static_cast<std::uint64_t>(*params) >> 12)
                          : 0.0;
        row->save = save;
    }
};

/// After the post-reduction tiles, from their sums: the reduced gradient's count, first index
/// and squared norm (this replica's own: the reduced gradient is the same on every replica).
struct finish_reduced_fn {
    step_outcome* outcome;
    LOCKSTEP_HOST_DEVICE void operator()(const check_sums& s) const {
        outcome->reduced_non_finite = s.count;
        outcome->reduced_first = s.first;
        outcome->grad_norm2 = s.sq;
    }
};

/// Task i < 3 tiles: the piece checks' tiles (three doubles each) as a gradient whose checks are
/// own's count and first index leaves them: tile 0 = {own.count, own.first, 0}, every other
/// tile zero (finish_local folds the tiles, so it finds that count and first index).
struct load_pieces_fn {
    const check_sums* own;
    double* tiles;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        tiles[i] = i == 0 ? own->count : i == 1 ? own->first : 0.0;
    }
};

/// One task: the reduced gradient's checks as a gradient with no non-finite element leaves them
/// without squares (count 0, first 0, squared norm 0).
struct clear_reduced_fn {
    step_outcome* outcome;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        finish_reduced_fn{outcome}(check_sums{});
    }
};

/// One task, after the totals were summed over replicas: the skip decision (in the outcome and
/// as the int the optimizer kernels read, 1: skip the update), the overflow the loss scale
/// backs off from, and the gradient factor.
/// Skipped: a non-finite gradient element (before or after reduction) or loss, a layer error, or
/// replicas that disagree on global_batch, lr, the trainer they step (its ordinal on the
/// communicator: trainer_ordinal.hpp), the step's first sample, the loss scale (its value and
/// growth tracker) or the parameters' digest in the trainer's first step (rows [0, replicas)).
/// grad_factor = c = min(1, max_norm / (||g|| + 1e-6)) when max_norm > 0
/// (torch.nn.utils.clip_grad_norm_), else 1.
struct decide_skip_fn {
    const step_totals* totals;
    step_outcome* outcome;
    const replica_row* rows;
    int replicas;
    int* skip;
    double max_norm;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        bool mismatch = false;
        for (int r = 1; r < replicas; ++r) {
            const replica_row& row = rows[r];
            mismatch = mismatch || row.global_batch != rows[0].global_batch ||
                       row.lr != rows[0].lr || row.trainer != rows[0].trainer ||
                       row.first_sample != rows[0].first_sample ||
                       row.loss_scale != rows[0].loss_scale ||
                       row.scale_growth != rows[0].scale_growth || row.params != rows[0].params;
        }
        const bool bad = totals->non_finite > 0 || outcome->reduced_non_finite > 0 ||
                         totals->loss_non_finite > 0 || totals->layer_errors > 0 || mismatch;
        double c = 1.0;
        if (max_norm > 0) {
            const double norm = ::sqrt(outcome->grad_norm2);
            c = max_norm / (norm + 1e-6);
            c = c < 1.0 ? c : 1.0;
        }
        outcome->mismatch = mismatch ? 1.0 : 0.0;
        // A sum that overflows is an overflow too: the loss scale must back off from it.
        outcome->overflow = totals->non_finite + outcome->reduced_non_finite;
        outcome->grad_factor = c;
        outcome->skip = bad ? 1.0 : 0.0;
        *skip = bad ? 1 : 0;
    }
};

/// One task, after the skip decision and the loss scale's update: the run of skipped steps
/// (train_params::max_consecutive_skips). A skipped step adds 1 to streak->skipped and to the run,
/// except the skip of a loss scale still backing off (an overflow at a scale above floor) and a
/// step the replicas disagreed on (thrown at its read), which neither count nor end the run; an
/// applied step ends it. When the run reaches limit (> 0)
/// for the first time, the step's rows [0, replicas) and reduced checks are kept as the cause.
struct count_skip_fn {
    const step_totals* totals;
    const step_outcome* outcome;
    const replica_row* rows;
    int replicas;
    const kernels::loss_scale_record* scale_report; ///< written by the update (loss scaling)
    skip_streak* streak;
    replica_row* cause; ///< replicas rows
    double limit;       ///< 0: no limit
    bool scaling;       ///< loss scaling is on
    double floor;       ///< loss_scaling::min_scale
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        if (streak->tripped != 0)
            streak->after_trip += 1;
        if (outcome->skip == 0) {
            streak->run = 0;
            return;
        }
        streak->skipped += 1;
        if (outcome->mismatch != 0)
            return; // the replicas disagreed: its read throws that, whatever the run
        if (scaling && outcome->overflow > 0 && scale_report->used > floor)
            return; // the scale backs off: GradScaler's normal skips
        streak->run += 1;
        if (limit > 0 && streak->tripped == 0 && streak->run >= limit) {
            streak->tripped = 1;
            streak->after_trip = 0;
            streak->limit_run = streak->run;
            streak->reduced_non_finite = outcome->reduced_non_finite;
            streak->reduced_first = outcome->reduced_first;
            streak->loss_scale = scaling ? scale_report->used : 0.0;
            for (int r = 0; r < replicas; ++r)
                cause[r] = rows[r];
        }
    }
};

/// x *= *factor unless *skip (read on the device): the gradient factor of a step.
template <class T>
struct scale_by_factor_fn {
    const double* factor;
    const int* skip;
    LOCKSTEP_HOST_DEVICE T operator()(T x) const {
        if (*skip != 0)
            return x;
        return static_cast<T>(static_cast<double>(x) * *factor);
    }
};

/// The gradient checks of a trainer over a flat gradient buffer of n elements cut into
/// reduction pieces: per-piece tiles before reduction (each piece's tiles have their own
/// partial slots, so pieces may be checked in any order), and tiles over the whole buffer
/// after it. Every pass is a kernel on the system's stream: nothing is read on the host. The sums
/// follow check_order.hpp on every system, so host and GPU give the same bits.
template <class System>
class gradient_checks {
public:
    gradient_checks(const std::vector<bucket>& pieces, std::size_t n, const System& sys) {
        std::size_t tiles = 0;
        for (const bucket& b : pieces) {
            base_.push_back(tiles);
            tiles += check_tiles(b.size);
        }
        piece_tiles_ = tiles;
        whole_tiles_ = check_tiles(n);
        pre_ = buffer<double, System>(3 * (tiles == 0 ? 1 : tiles), sys);
        post_ = buffer<double, System>(3 * (whole_tiles_ == 0 ? 1 : whole_tiles_), sys);
        zero(sys, pre_.span());
    }

    /// Counts the NaN/inf elements of piece k of data (data: the whole flat buffer), before it
    /// is reduced. requires: k < pieces.size(), b == pieces[k].
    template <class T>
    void check_piece(const System& sys, std::span<const T> data, std::size_t k, const bucket& b) {
        grad_check_tiles(sys, data.data(), b.offset, b.offset + b.size, base_[k], pre_.data(),
                         false);
    }

    /// Every piece's tiles as check_piece leaves them for a gradient with own->count non-finite
    /// elements, the first at flat index own->first - 1 (0: none), without reading it (own: in
    /// the system's memory; reduce::reproducible's report).
    void load_pieces(const System& sys, const check_sums* own) {
        kernels::for_each_index(sys, 3 * (piece_tiles_ == 0 ? 1 : piece_tiles_),
                                load_pieces_fn{own, pre_.data()});
    }

    /// After every piece was checked: this replica's row and its part of the totals (`trainer`:
    /// the trainer's ordinal on its communicator, trainer_ordinal.hpp; 0: unchecked;
    /// `first_sample`: the step's first global sample; `scale`: the loss scale's state in System
    /// memory, read when the task runs; null: no loss scaling; `params`: the parameters' digest in
    /// System memory, in the trainer's first step, else null).
    void finish_local(const System& sys, double loss, double global_batch, double lr,
                      step_totals* totals, replica_row* row, save_word save = {},
                      double trainer = 0, double first_sample = 0,
                      const kernels::loss_scale_device_state* scale = nullptr,
                      const std::int64_t* params = nullptr) {
        grad_check_finish(sys, pre_.data(), piece_tiles_,
                          finish_local_fn{loss, global_batch, lr, totals, row, save, trainer,
                                          first_sample, scale, params});
    }

    /// Counts, finds the first and (with `norm`) sums the squares of the whole buffer (the
    /// reduced gradient) into the outcome.
    template <class T>
    void check_reduced(const System& sys, std::span<const T> data, bool norm,
                       step_outcome* outcome) {
        grad_check_tiles(sys, data.data(), 0, data.size(), 0, post_.data(), norm);
        grad_check_finish(sys, post_.data(), check_tiles(data.size()), finish_reduced_fn{outcome});
    }

    /// What check_reduced without squares finds in a gradient with no non-finite element,
    /// written into the outcome without reading it (the reducer knows: reduce::reproducible's
    /// report).
    void clear_reduced(const System& sys, step_outcome* outcome) {
        kernels::for_each_index(sys, 1, clear_reduced_fn{outcome});
    }

    /// As check_reduced over elements [begin, end) of data only (reduce::sharded: the shard this
    /// replica reduced); the first index found is a flat index of data. requires: begin <= end
    /// <= the n of the constructor.
    template <class T>
    void check_reduced(const System& sys, std::span<const T> data, std::size_t begin,
                       std::size_t end, bool norm, step_outcome* outcome) {
        grad_check_tiles(sys, data.data(), begin, end, 0, post_.data(), norm);
        grad_check_finish(sys, post_.data(), check_tiles(end - begin), finish_reduced_fn{outcome});
    }

private:
    std::vector<std::size_t> base_;
    std::size_t piece_tiles_ = 0;
    std::size_t whole_tiles_ = 0;
    buffer<double, System> pre_, post_;
};

/// grads *= *factor unless *skip, on the device (factor, skip: in sys's memory).
template <class System, class T>
void apply_grad_factor(const System& sys, std::span<T> grads, const double* factor,
                       const int* skip) {
    if (grads.empty())
        return;
    kernels::with_policy_for(sys, grads.size(), [&](auto policy) {
        thrust::transform(policy, grads.data(), grads.data() + grads.size(), grads.data(),
                          scale_by_factor_fn<T>{factor, skip});
    });
}

} // namespace lockstep::detail

// lockstep/train/detail/step_checks.hpp: the device-side checks of a training step (non-finite
// gradient elements per replica before reduction and of the reduced gradient, the gradient norm,
// the skip decision and the gradient factor) as host/device functors over Thrust.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/step_status.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>

namespace lockstep::detail {

/// Elements per task of the gradient checks: large enough that the host runs long vectorised
/// loops, small enough that a GPU has many tasks.
inline constexpr std::size_t check_tile = std::size_t(1) << 14;

/// The tiles of n elements (>= 0).
inline std::size_t check_tiles(std::size_t n) {
    return (n + check_tile - 1) / check_tile;
}

/// Task t over elements [begin + t * tile, min(end, begin + (t + 1) * tile)) of data: writes
/// out[3 (base + t) + {0, 1, 2}] = {NaN/inf elements, 1 + flat index of the first (0: none),
/// sum of squares in double (0 unless `squares`)}.
template <class T>
struct tile_check_fn {
    const T* data;
    std::size_t begin, end, base;
    double* out;
    bool squares;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        const std::size_t b = begin + t * check_tile;
        const std::size_t e = b + check_tile < end ? b + check_tile : end;
        const non_finite_fn<T> bad;
        std::uint32_t count = 0;
        for (std::size_t i = b; i < e; ++i)
            count += static_cast<std::uint32_t>(bad(data[i]));
        double first = 0;
        if (count != 0)
            for (std::size_t i = b; i < e; ++i)
                if (bad(data[i])) {
                    first = static_cast<double>(i + 1);
                    break;
                }
        double sq = 0;
        if (squares)
            for (std::size_t i = b; i < e; ++i) {
                const double x = static_cast<double>(data[i]);
                sq += x * x;
            }
        double* o = out + 3 * (base + t);
        o[0] = static_cast<double>(count);
        o[1] = first;
        o[2] = sq;
    }
};

/// One task: sums tiles [0, tiles) of `partial` (tile order: independent of the thread count)
/// into {count, first (the smallest non-zero), squares}.
struct combine_tiles {
    const double* partial;
    std::size_t tiles;
    LOCKSTEP_HOST_DEVICE void operator()(double& count, double& first, double& sq) const {
        count = 0;
        first = 0;
        sq = 0;
        for (std::size_t t = 0; t < tiles; ++t) {
            const double* p = partial + 3 * t;
            count += p[0];
            if (p[1] != 0 && (first == 0 || p[1] < first))
                first = p[1];
            sq += p[2];
        }
    }
};

/// 1 when x is NaN or infinite.
LOCKSTEP_HOST_DEVICE inline bool non_finite_double(double x) {
    return non_finite_fn<double>{}(x) != 0;
}

/// One task, before the status all_reduce: this replica's row and the summed slots from the
/// pre-reduction tiles; status[loss] += loss first, then the loss is checked.
struct finish_local_fn {
    const double* partial;
    std::size_t tiles;
    double loss;
    double global_batch;
    double lr;
    double* status; ///< the status_slot block
    double* row;    ///< this replica's replica_slot row
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double count, first, sq;
        combine_tiles{partial, tiles}(count, first, sq);
        status[status_slot::loss] += loss;
        const double bad_loss = non_finite_double(status[status_slot::loss]) ? 1.0 : 0.0;
        status[status_slot::non_finite] = count;
        status[status_slot::loss_non_finite] = bad_loss;
        row[replica_slot::non_finite] = count;
        row[replica_slot::first_non_finite] = first;
        row[replica_slot::loss_non_finite] = bad_loss;
        row[replica_slot::global_batch] = global_batch;
        row[replica_slot::lr] = lr;
    }
};

/// One task, after the post-reduction tiles: the reduced gradient's count, first index and
/// squared norm (local slots: the reduced gradient is the same on every replica).
struct finish_reduced_fn {
    const double* partial;
    std::size_t tiles;
    double* status;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double count, first, sq;
        combine_tiles{partial, tiles}(count, first, sq);
        status[status_slot::reduced_non_finite] = count;
        status[status_slot::reduced_first] = first;
        status[status_slot::grad_norm2] = sq;
    }
};

/// One task, after the status was summed over replicas: the skip decision (as the status slot
/// and as the int the optimizer kernels read, 1: skip the update) and the gradient factor.
/// Skipped: a non-finite gradient element (before or after reduction) or loss, a layer error, a
/// skip request, or replicas that disagree on global_batch or lr (rows [0, replicas)).
/// grad_factor = u * c, u = status[grad_unscale], c = min(1, max_norm / (u ||g|| + 1e-6)) when
/// max_norm > 0 (torch.nn.utils.clip_grad_norm_), else 1.
struct decide_skip_fn {
    double* status;
    const double* rows;
    int replicas;
    int* skip;
    double max_norm;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        bool mismatch = false;
        for (int r = 1; r < replicas; ++r) {
            const double* row = rows + static_cast<std::size_t>(r) * replica_slot::slots;
            mismatch = mismatch ||
                       row[replica_slot::global_batch] != rows[replica_slot::global_batch] ||
                       row[replica_slot::lr] != rows[replica_slot::lr];
        }
        const bool bad =
            status[status_slot::non_finite] > 0 || status[status_slot::reduced_non_finite] > 0 ||
            status[status_slot::loss_non_finite] > 0 || status[status_slot::layer_errors] > 0 ||
            status[status_slot::skip_requests] > 0 || mismatch;
        const double u = status[status_slot::grad_unscale];
        double c = 1.0;
        if (max_norm > 0) {
            const double norm = u * ::sqrt(status[status_slot::grad_norm2]);
            c = max_norm / (norm + 1e-6);
            c = c < 1.0 ? c : 1.0;
        }
        status[status_slot::mismatch] = mismatch ? 1.0 : 0.0;
        status[status_slot::grad_factor] = u * c;
        status[status_slot::skip] = bad ? 1.0 : 0.0;
        *skip = bad ? 1 : 0;
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

/// Resets the status_slot defaults that are not zero (grad_unscale = 1).
struct status_defaults_fn {
    double* status;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        status[status_slot::grad_unscale] = 1.0;
        status[status_slot::grad_factor] = 1.0;
    }
};

/// The gradient checks of a trainer over a flat gradient buffer of n elements cut into
/// reduction pieces: per-piece tiles before reduction (each piece's tiles have their own
/// partial slots, so pieces may be checked in any order), and tiles over the whole buffer
/// after it. Every pass is a kernel on the system's stream: nothing is read on the host.
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
        const std::size_t tiles = check_tiles(b.size);
        if (tiles == 0)
            return;
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(tiles),
                         tile_check_fn<T>{data.data(), b.offset, b.offset + b.size, base_[k],
                                          pre_.data(), false});
    }

    /// After every piece was checked: this replica's row and the summed status slots.
    void finish_local(const System& sys, double loss, double global_batch, double lr,
                      double* status, double* row) {
        one_task(sys,
                 finish_local_fn{pre_.data(), piece_tiles_, loss, global_batch, lr, status, row});
    }

    /// Counts, finds the first and (with `norm`) sums the squares of the whole buffer (the
    /// reduced gradient) into the local status slots.
    template <class T>
    void check_reduced(const System& sys, std::span<const T> data, bool norm, double* status) {
        if (whole_tiles_ != 0)
            thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                             thrust::counting_iterator<std::size_t>(whole_tiles_),
                             tile_check_fn<T>{data.data(), 0, data.size(), 0, post_.data(), norm});
        one_task(sys, finish_reduced_fn{post_.data(), whole_tiles_, status});
    }

    /// As check_reduced over elements [begin, end) of data only (reduce::sharded: the shard this
    /// replica reduced); the first index found is a flat index of data. requires: begin <= end
    /// <= the n of the constructor.
    template <class T>
    void check_reduced(const System& sys, std::span<const T> data, std::size_t begin,
                       std::size_t end, bool norm, double* status) {
        const std::size_t tiles = check_tiles(end - begin);
        if (tiles != 0)
            thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                             thrust::counting_iterator<std::size_t>(tiles),
                             tile_check_fn<T>{data.data(), begin, end, 0, post_.data(), norm});
        one_task(sys, finish_reduced_fn{post_.data(), tiles, status});
    }

    template <class F>
    static void one_task(const System& sys, const F& f) {
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(1), f);
    }

private:
    std::vector<std::size_t> base_;
    std::size_t piece_tiles_ = 0;
    std::size_t whole_tiles_ = 0;
    buffer<double, System> pre_, post_;
};

/// grads *= status[grad_factor] unless *skip, on the device.
template <class System, class T>
void apply_grad_factor(const System& sys, std::span<T> grads, const double* status,
                       const int* skip) {
    if (grads.empty())
        return;
    thrust::transform(sys.policy(), grads.data(), grads.data() + grads.size(), grads.data(),
                      scale_by_factor_fn<T>{status + status_slot::grad_factor, skip});
}

} // namespace lockstep::detail

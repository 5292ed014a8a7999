// lockstep/kernels/bn_statistics.hpp: the exchange format of batch-norm statistics between
// replicas and the one per-channel kernel that turns the gathered blocks into normalization
// coefficients, running statistics and a device-side error status.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/step_status.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>
#include <cstdint>

namespace lockstep::kernels {

/// A replica's statistics block, the unit batch norm all_gathers (Acc values):
///   [0] status (0: valid input; otherwise the replica reports invalid input),
///   [1] count_hi, [2] count_lo: the values per channel, count_hi * 2^24 + count_lo (exact in
///       float up to 2^48 values, where a single float count stops at 2^24),
///   [3 + 2c] mean of channel c, [4 + 2c] M2 of channel c.
namespace stats_block {
inline constexpr std::size_t status = 0;
inline constexpr std::size_t count_hi = 1;
inline constexpr std::size_t count_lo = 2;
inline constexpr std::size_t header = 3;
/// The size of a block of C channels.
LOCKSTEP_HOST_DEVICE constexpr std::size_t size(std::size_t channels) {
    return header + 2 * channels;
}
} // namespace stats_block

/// Splits a count into the two exact halves of a statistics block.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline void encode_count(std::uint64_t n, Acc& hi, Acc& lo) {
    hi = static_cast<Acc>(n >> 24);
    lo = static_cast<Acc>(n & 0xffffffu);
}
/// The count a block's two halves encode.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline double decode_count(Acc hi, Acc lo) {
    return static_cast<double>(hi) * 16777216.0 + static_cast<double>(lo);
}

/// Channel c: writes this replica's statistics block from its per-channel moments and the
/// exact count (channel 0 also writes the header).
template <class Acc>
struct pack_block_fn {
    const moments<Acc>* local;
    Acc status;
    std::uint64_t count;
    Acc* block;

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        if (c == 0) {
            block[stats_block::status] = status;
            encode_count(count, block[stats_block::count_hi], block[stats_block::count_lo]);
        }
        block[stats_block::header + 2 * c] = local[c].mean;
        block[stats_block::header + 2 * c + 1] = local[c].m2;
    }
};

/// Chan's merge with the count in double, so that counts beyond 2^24 stay exact with float
/// statistics. Empty sides are exact identities, as in chan_merge.
template <class Acc>
struct wide_moments {
    double count = 0;
    Acc mean = 0;
    Acc m2 = 0;

    LOCKSTEP_HOST_DEVICE void merge(double nb, Acc mb, Acc m2b) {
        if (nb == 0)
            return;
        if (count == 0) {
            count = nb;
            mean = mb;
            m2 = m2b;
            return;
        }
        const double n = count + nb;
        const Acc delta = mb - mean;
        const Acc wb = static_cast<Acc>(nb / n);
        mean = mean + delta * wb;
        m2 = m2 + m2b + delta * delta * (static_cast<Acc>(count) * wb);
        count = n;
    }
};

/// Channel c, training forward: merges the gathered statistics blocks (in rank order, so every
/// replica computes the same bits), writes the normalization coefficients and updates the
/// running statistics; channel 0 also writes the normalization count and checks the blocks.
/// - Normalization statistics: the merge of blocks [0, blocks) when `normalize_merged`
///   (bn::global, bn::group), else block `self` alone (bn::local, running_only, tower).
/// - Running statistics: the merge of blocks [running_first, running_last), unbiased variance
///   over their count (skipped when that count is below 2).
/// - Errors (channel 0): a block whose status is not 0 (layer_error::peer_invalid_input, value
///   = that replica's world rank), or statistics over exactly one value per channel
///   (layer_error::single_value: the merged count when normalize_merged, else any block's).
///   With `report_only_errors` (a step's shared status) an error adds 1 to
///   status[layer_errors] and fills the error slots if they are empty; without it (a layer's
///   own status) the three error slots are overwritten, with zeros when all is well.
template <class Acc>
struct finish_statistics_fn {
    const Acc* blocks;
    std::size_t stride;
    int count_blocks;
    int self;
    int running_first;
    int running_last;
    bool normalize_merged;
    int world_offset; ///< world rank of block 0 (bn::group: the group's first replica)
    const Acc* gamma;
    Acc eps;
    Acc momentum;
    Acc* mean;
    Acc* invstd;
    Acc* scale;
    Acc* running_mean;
    Acc* running_var;
    double* count; ///< out: the values per channel the normalization statistics cover
    double* status;
    bool report_only_errors;
    double layer;

    LOCKSTEP_HOST_DEVICE wide_moments<Acc> merged(int first, int last, std::size_t c) const {
        wide_moments<Acc> m;
        for (int r = first; r < last; ++r) {
            const Acc* b = blocks + static_cast<std::size_t>(r) * stride;
            m.merge(decode_count(b[stats_block::count_hi], b[stats_block::count_lo]),
                    b[stats_block::header + 2 * c], b[stats_block::header + 2 * c + 1]);
        }
        return m;
    }

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        const wide_moments<Acc> norm =
            normalize_merged ? merged(0, count_blocks, c) : merged(self, self + 1, c);
        const Acc var = norm.count > 0 ? norm.m2 / static_cast<Acc>(norm.count) : Acc(0);
        const Acc inv = inverse_sqrt(var + eps);
        mean[c] = norm.mean;
        invstd[c] = inv;
        scale[c] = gamma[c] * inv;
        const wide_moments<Acc> run = merged(running_first, running_last, c);
        if (run.count > 1) {
            const Acc unbiased = run.m2 / static_cast<Acc>(run.count - 1);
            running_mean[c] = (Acc(1) - momentum) * running_mean[c] + momentum * run.mean;
            running_var[c] = (Acc(1) - momentum) * running_var[c] + momentum * unbiased;
        }
        if (c == 0)
            check(norm.count);
    }

private:
    LOCKSTEP_HOST_DEVICE void check(double norm_count) const {
        *count = norm_count;
        layer_error code = layer_error::none;
        double value = -1;
        for (int r = 0; r < count_blocks && code == layer_error::none; ++r) {
            if (blocks[static_cast<std::size_t>(r) * stride + stats_block::status] != Acc(0)) {
                code = layer_error::peer_invalid_input;
                value = world_offset + r;
            }
        }
        if (code == layer_error::none) {
            if (normalize_merged) {
                if (norm_count == 1)
                    code = layer_error::single_value;
            } else {
                for (int r = 0; r < count_blocks && code == layer_error::none; ++r) {
                    const Acc* b = blocks + static_cast<std::size_t>(r) * stride;
                    if (decode_count(b[stats_block::count_hi], b[stats_block::count_lo]) == 1) {
                        code = layer_error::single_value;
                        value = world_offset + r;
                    }
                }
            }
        }
        if (!report_only_errors) {
            status[status_slot::error_code] = static_cast<double>(code);
            status[status_slot::error_layer] = layer;
            status[status_slot::error_value] = value;
            return;
        }
        if (code == layer_error::none)
            return;
        status[status_slot::layer_errors] += 1;
        if (status[status_slot::error_code] == 0) {
            status[status_slot::error_code] = static_cast<double>(code);
            status[status_slot::error_layer] = layer;
            status[status_slot::error_value] = value;
        }
    }
};

} // namespace lockstep::kernels

// lockstep/kernels/bn_statistics.hpp: the one per-channel kernel that turns the gathered
// batch-norm statistics blocks (kernels::packed_moments) into normalization coefficients,
// running statistics and a device-side error status.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/bn_fused.hpp"
#include "lockstep/kernels/layer_report.hpp"
#include "lockstep/kernels/moments.hpp"

#include <cstddef>
#include <cstdint>

namespace lockstep::kernels {

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
///   over their count (skipped when that count is below 2); with kept_mean, the values before
///   this update are kept first (kept_mean[c], kept_var[c]: a trainer's step restores them when
///   it is skipped).
/// - Errors (channel 0): a block whose status is not 0 (layer_error::peer_invalid_input, value
///   = that replica's world rank), or statistics over exactly one value per channel
///   (layer_error::single_value: the merged count when normalize_merged, else any block's).
///   Reported through `report` (layer_report::write: a step's shared report counts errors and
///   keeps the first; a layer's own record is overwritten, with code 0 when all is well).
template <class Acc>
struct finish_statistics_fn {
    static constexpr bool finishes = true;
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
    layer_report report;
    Acc* kept_mean = nullptr; ///< when not null, with kept_var: the running statistics kept
    Acc* kept_var = nullptr;

    LOCKSTEP_HOST_DEVICE wide_moments<Acc> merged(int first, int last, std::size_t c) const {
        wide_moments<Acc> m;
        for (int r = first; r < last; ++r) {
            const Acc* b = blocks + static_cast<std::size_t>(r) * stride;
            m.merge(packed_moments::count(b), b[packed_moments::mean(c)], b[packed_moments::m2(c)]);
        }
        return m;
    }

    /// Channel c's normalization statistics: the merged blocks' or this replica's.
    LOCKSTEP_HOST_DEVICE wide_moments<Acc> normalization(std::size_t c) const {
        return normalize_merged ? merged(0, count_blocks, c) : merged(self, self + 1, c);
    }
    /// 1 / sqrt(variance + eps) of statistics m.
    LOCKSTEP_HOST_DEVICE Acc inverse_std(const wide_moments<Acc>& m) const {
        const Acc var = m.count > 0 ? m.m2 / static_cast<Acc>(m.count) : Acc(0);
        return inverse_sqrt(var + eps);
    }
    /// Channel c's coefficients, as operator() writes them (the fused CUDA normalize computes
    /// them per block from the blocks with this arithmetic).
    LOCKSTEP_HOST_DEVICE channel_coefficients<Acc> coefficients(std::size_t c) const {
        const wide_moments<Acc> norm = normalization(c);
        return {norm.mean, gamma[c] * inverse_std(norm)};
    }
    /// The values operator() reads over every channel (for_each_index's work estimate).
    std::size_t elements(std::size_t channels) const noexcept {
        return channels * static_cast<std::size_t>(count_blocks);
    }

    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        const wide_moments<Acc> norm = normalization(c);
        const Acc inv = inverse_std(norm);
        mean[c] = norm.mean;
        invstd[c] = inv;
        scale[c] = gamma[c] * inv;
        if (kept_mean != nullptr) {
            kept_mean[c] = running_mean[c];
            kept_var[c] = running_var[c];
        }
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
            if (blocks[static_cast<std::size_t>(r) * stride + packed_moments::status] != Acc(0)) {
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
                    if (packed_moments::count(b) == 1) {
                        code = layer_error::single_value;
                        value = world_offset + r;
                    }
                }
            }
        }
        report.write(code, value);
    }
};

} // namespace lockstep::kernels

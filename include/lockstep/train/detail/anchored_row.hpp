// lockstep/train/detail/anchored_row.hpp: what one replica of reduce::reproducible's anchored
// accumulator sends in its row (its chunks' loss terms as doubles, its tail values, the report of
// its sums), and the tasks that write the row and read every replica's: the loss terms summed
// into the status loss, and the reports folded into this replica's own check (its non-finite
// chunk values: count and first index) and whether every sum is finite, so that
// reduce::reproducible reads neither its last chunk nor the summed gradient again to count them.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/train/detail/check_order.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"

#include <cstddef>

namespace lockstep::detail {

/// A step's losses in the system's memory: the chunk being computed (the user's function writes
/// it) and the global sum.
struct anchored_losses {
    double chunk;
    double global;
};

/// One replica's doubles in the accumulator's row all_gather (gathered: at the end of its
/// region): its loss terms, 2 per call (loss_terms_fn), then `tail` doubles holding each call's
/// tail values (blocks; values of the gradient's type, which the all_gather moves as bytes, so
/// no conversion can flush a subnormal), then `report` words of the host's sums
/// (kernels/detail/anchored_combine.hpp).
struct anchored_row {
    std::size_t calls = 1;
    std::size_t tail = 0;
    std::size_t report = 0;
    LOCKSTEP_HOST_DEVICE std::size_t terms() const noexcept { return 2 * calls; }
    LOCKSTEP_HOST_DEVICE std::size_t size() const noexcept { return terms() + tail + report; }
    template <class T>
    T* tail_values(double* row) const noexcept {
        return reinterpret_cast<T*>(row + terms());
    }
    double* report_words(double* row) const noexcept { return row + terms() + tail; }
};

/// One task: a chunk's two loss terms, `value` and *device_value (0 when null), at out[0..1].
struct loss_terms_fn {
    const double* device_value;
    double value;
    double* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        out[0] = value;
        out[1] = device_value != nullptr ? *device_value : 0.0;
    }
};

/// One task: the loss a replica adds to the step's status loss slot: the global loss on replica
/// 0 only (`first`: the status sum over replicas is that loss, bitwise), plus the sum of this
/// replica's loss terms[0, count) that are not finite, which names it and, unlike its partial
/// sum, does not depend on how the chunks fall on replicas. A NaN global loss (the anchored sum
/// is NaN exactly where a term is not finite; a sum beyond the range is an infinity) is left to
/// the replicas whose own terms made it, which add them: replica 0 is not named for another's
/// term, and the status sum stays non-finite.
struct status_loss_fn {
    const double* terms;
    std::size_t count;
    const double* global;
    bool first;
    double* loss;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double own = 0.0;
        for (std::size_t k = 0; k < count; ++k)
            own += is_finite(terms[k]) ? 0.0 : terms[k];
        const double g = *global;
        *loss += (first && !is_nan(g) ? g : 0.0) + own;
    }
};

/// What finalize() leaves where the sums report: this replica's own check (its non-finite chunk
/// values as the step's piece checks count them; no squares) and whether every sum is finite.
struct anchored_own_report {
    check_sums own;
    bool sums_finite;
};

/// One task, after every owner's report (owner o's words at reports[o * row.size()]) reached
/// this replica: out->own.count = the elements where one of its values is not finite,
/// out->own.first = 1 + the flat index of the first (0: none); out->sums_finite when no owner saw
/// a sum that is not finite, nor is one of the tail's. The tail (the blocks exchange's `tail`
/// elements tail_first + t, summed on every replica): this replica's values, call c's at
/// tail_values[c * tail]; their sums at tail_sums.
template <class T>
struct own_report_fn {
    const double* reports;
    std::size_t owners;
    anchored_row row;
    std::size_t rank;
    const T* tail_values;
    std::size_t tail;
    std::size_t tail_first;
    const T* tail_sums;
    anchored_own_report* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double count = 0.0;
        double first = 0.0;
        bool all_finite = true;
        for (std::size_t o = 0; o < owners; ++o) {
            const double* w = reports + o * row.size();
            all_finite = all_finite && w[0] == 0.0;
            count += w[1 + 2 * rank];
            const double f = w[2 + 2 * rank];
            first = f != 0.0 && (first == 0.0 || f < first) ? f : first;
        }
        // The tail lies past every block, so its first counts only when no block had one.
        for (std::size_t t = 0; t < tail; ++t) {
            bool bad = false;
            for (std::size_t c = 0; c < row.calls; ++c)
                bad = bad || !is_finite(tail_values[c * tail + t]);
            if (bad) {
                count += 1.0;
                first = first == 0.0 ? static_cast<double>(tail_first + t + 1) : first;
            }
            all_finite = all_finite && non_finite_fn<T>{}(tail_sums[t]) == 0;
        }
        out->own = check_sums{count, first, 0.0};
        out->sums_finite = all_finite;
    }
};

} // namespace lockstep::detail

// lockstep/train/detail/anchored_report.hpp: what the owners' anchored sums saw
// (kernels/detail/anchored_combine.hpp), gathered and folded into this replica's own check (its
// non-finite chunk values: count and first index) and whether every sum is finite, so that
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

/// What finalize() leaves where the sums report: this replica's own check (its non-finite chunk
/// values as the step's piece checks count them; no squares) and whether every sum is finite.
struct anchored_own_report {
    check_sums own;
    bool sums_finite;
};

/// One task, after every owner's report (owner o's words at reports[o * stride]) reached this
/// replica: out->own.count = the elements where one of its values is not finite, out->own.first
/// = 1 + the flat index of the first (0: none); out->sums_finite when no owner saw a sum that is
/// not finite, nor is one of the tail's. The tail (the blocks exchange's n mod replicas elements
/// tail_first + t, summed on every replica; else tail = 0): this replica's values, call c's at
/// tail_values[c * tail], carried in doubles (kernels::anchored_carry); their sums at tail_sums.
template <class T>
struct own_report_fn {
    const double* reports;
    std::size_t owners;
    std::size_t stride;
    std::size_t rank;
    const double* tail_values;
    std::size_t calls;
    std::size_t tail;
    std::size_t tail_first;
    const T* tail_sums;
    anchored_own_report* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double count = 0.0;
        double first = 0.0;
        bool all_finite = true;
        for (std::size_t o = 0; o < owners; ++o) {
            const double* w = reports + o * stride;
            all_finite = all_finite && w[0] == 0.0;
            count += w[1 + 2 * rank];
            const double f = w[2 + 2 * rank];
            first = f != 0.0 && (first == 0.0 || f < first) ? f : first;
        }
        // The tail lies past every block, so its first counts only when no block had one.
        for (std::size_t t = 0; t < tail; ++t) {
            bool bad = false;
            for (std::size_t c = 0; c < calls; ++c)
                bad = bad || !is_finite(kernels::anchored_uncarry<T>(tail_values[c * tail + t]));
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

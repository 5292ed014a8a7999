// lockstep/train/detail/anchored_loss.hpp: the loss terms of reduce::reproducible's chunks, as
// doubles: kept per chunk, summed over every replica's terms as the gradients are
// (kernels/anchored_sum.hpp), rounded once, and checked for this replica's non-finite terms.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/finite.hpp"

#include <cstddef>

namespace lockstep::detail {

/// A step's losses in the system's memory: the chunk being computed (the user's function writes
/// it) and the global sum.
struct anchored_losses {
    double chunk;
    double global;
};

/// One replica's doubles in the accumulator's row all_gather (gathered: at the end of its
/// region): its loss terms, 2 per call (loss_terms_fn), then each call's `tail` values (blocks),
/// then `report` words of the host's sums (kernels/detail/anchored_combine.hpp).
struct anchored_row {
    std::size_t calls = 1;
    std::size_t tail = 0;
    std::size_t report = 0;
    std::size_t terms() const noexcept { return 2 * calls; }
    std::size_t size() const noexcept { return terms() + calls * tail + report; }
    double* tail_values(double* row) const noexcept { return row + terms(); }
    double* report_words(double* row) const noexcept { return row + terms() + calls * tail; }
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
/// sum, does not depend on how the chunks fall on replicas.
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
        *loss += (first ? *global : 0.0) + own;
    }
};

} // namespace lockstep::detail

// lockstep/train/detail/reduced_check_rows.hpp: the reduced gradient's checks made where its
// parts lie (reduce::sharded: every replica its shard; reduce::parameter_server: Root the whole)
// and shared through the step's status, so every replica decides from the same values.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/train/step_state.hpp"

#include <cstddef>

namespace lockstep::detail {

/// One replica's checks of the part of the reduced gradient it holds (a row per replica in the
/// step's status, summed with it; zero where the replica holds none): its non-finite count,
/// 1 + flat index of the first one (0: none) and squared norm.
struct check_row {
    double non_finite = 0;
    double first_non_finite = 0;
    double grad_norm2 = 0;
};

/// The doubles per replica of the check rows (a collective's status_doubles).
inline constexpr std::size_t check_row_doubles = sizeof(check_row) / sizeof(double);

/// One task, before the status all_reduce: this replica's checks (the outcome check_reduced
/// wrote over its part) into its row.
struct checks_to_row_fn {
    const step_outcome* outcome;
    check_row* row; ///< this replica's
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        row->non_finite = outcome->reduced_non_finite;
        row->first_non_finite = outcome->reduced_first;
        row->grad_norm2 = outcome->grad_norm2;
    }
};

/// One task, after the status all_reduce: the reduced gradient's count (sum over the rows), first
/// index (the smallest) and squared norm (sum over the rows in rank order: the same value on
/// every replica; a single part's exactly, the other rows being zero) into the outcome, as
/// check_reduced writes them for the whole gradient.
struct combine_check_rows_fn {
    const check_row* rows; ///< every replica's
    int replicas;
    step_outcome* outcome;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double count = 0, first = 0, sq = 0;
        for (int r = 0; r < replicas; ++r) {
            const check_row& p = rows[r];
            count += p.non_finite;
            if (p.first_non_finite != 0 && (first == 0 || p.first_non_finite < first))
                first = p.first_non_finite;
            sq += p.grad_norm2;
        }
        outcome->reduced_non_finite = count;
        outcome->reduced_first = first;
        outcome->grad_norm2 = sq;
    }
};

/// [C] After this replica checked the part of the reduced gradient it holds (s.check, when
/// `checked`; a replica that holds none leaves its row zero): the checks into its row, the
/// step's status summed over replicas (s.sum_status), and every row combined into the outcome,
/// so every replica takes the skip decision, the loss scale's update and the clipping factor
/// from the same values. requires: the collective's status_doubles is check_row_doubles.
template <class Stages>
void share_reduced_checks(Stages& s, bool checked) {
    const step_view v = s.view();
    auto* rows = reinterpret_cast<check_row*>(v.collective);
    if (checked)
        kernels::for_each_index(s.system(), 1, checks_to_row_fn{v.outcome, &rows[s.rank()]});
    s.sum_status();
    kernels::for_each_index(s.system(), 1, combine_check_rows_fn{rows, v.replicas, v.outcome});
}

} // namespace lockstep::detail

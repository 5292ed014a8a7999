// lockstep/train/detail/parameter_server_collective.hpp: the collective of
// reduce::parameter_server<Root> (sum onto Root, Root updates, parameters broadcast back).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/bucketed_collective.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/reduced_check_rows.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/train_params.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// reduce::parameter_server<Root>: gradients are summed onto Root in the default buckets
/// (reduce, in place), only Root checks the sum (after the gradient hook, which runs there) and
/// shares its checks through the step's status, so every replica skips, scales and reports
/// alike; only Root runs the optimizer, and the parameters are broadcast from Root. Traffic per
/// step: one reduce plus one broadcast of the whole model (a ring all_reduce moves about the same
/// bytes, but Root's link carries all of it); what it buys is that optimizer state lives and
/// moves on Root only.
template <int Root, class T, class Communicator>
class collective<reduce::parameter_server<Root>, T, Communicator>
    : public piecewise_collective<collective<reduce::parameter_server<Root>, T, Communicator>, T,
                                  Communicator> {
    using base = piecewise_collective<collective, T, Communicator>;

public:
    /// Root's check row in the step's status (reduced_check_rows.hpp).
    static constexpr std::size_t status_doubles = check_row_doubles;

    /// requires: Root < comm.size() (else lockstep::error, invalid_argument).
    collective(Communicator& comm, const std::vector<tensor_info>& tensors,
               overlap_setting overlap = {}, const train_params& /*params*/ = {})
        : base(comm, plan_buckets_of<reduce::bucketed<>>(tensors, sizeof(T)), tensors.size(),
               overlap) {
        LOCKSTEP_REQUIRE(Root < comm.size(), errc::invalid_argument, comm.rank(),
                         "reduce::parameter_server", "root ", Root, " is not a replica (",
                         comm.size(), " replicas)");
    }

    /// One piece: summed onto Root.
    void reduce_piece(Communicator& c, std::span<T> piece) {
        c.reduce(std::span<const T>(piece), piece, reduce_op::sum, Root);
    }

    /// Only Root holds the reduced gradient (the other replicas' is unspecified).
    bool reduced_here(int rank) const noexcept { return rank == Root; }

    /// Root checks the sum; its checks reach every replica through the status (a replica's own
    /// unreduced gradient says nothing of the sum: it can be finite where the sum overflows).
    template <class Stages>
    void agree(Stages& s) {
        const bool root = s.rank() == Root;
        if (root)
            s.check(s.core().optimizer_shard());
        share_reduced_checks(s, root);
    }

    /// Root clips and updates; everyone receives Root's parameters.
    template <class Stages>
    void update(Stages& s) {
        if (s.rank() == Root)
            base::update(s);
        broadcast(s.core().values());
    }

    void average(std::span<T> values) {
        this->begin(values);
        this->finish();
        if (this->comm().rank() == Root)
            scale(this->comm().system(), values, T(1) / static_cast<T>(this->comm().size()));
        broadcast(values);
    }

    /// Root's values to every replica, bucket by bucket.
    void broadcast(std::span<T> values) {
        for (const bucket& b : this->plan()) {
            this->comm().broadcast(values.subspan(b.offset, b.size), Root);
            this->count_collective();
        }
    }
};

} // namespace lockstep::detail

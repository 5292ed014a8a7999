// lockstep/train/detail/reduce_parameter_server.hpp: the reducer of
// reduce::parameter_server<Root> (sum onto Root, Root updates, parameters broadcast back).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/reducer_base.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// reduce::parameter_server<Root>: gradients are summed onto Root in the default buckets
/// (reduce, in place), only Root runs the optimizer, and the parameters are broadcast from Root.
/// Traffic per step: one reduce plus one broadcast of the whole model (a ring all_reduce moves
/// about the same bytes, but Root's link carries all of it); what it buys is that optimizer
/// state lives and moves on Root only.
template <int Root, class T, class Communicator>
class reducer<reduce::parameter_server<Root>, T, Communicator>
    : public reducer_base<reducer<reduce::parameter_server<Root>, T, Communicator>, T,
                          Communicator> {
    using buckets = reduce::bucketed<>;
    using base = reducer_base<reducer, T, Communicator>;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
            overlap_setting overlap = {})
        : base(comm,
               plan_buckets(tensors, sizeof(T), buckets::first_bucket_bytes, buckets::bucket_bytes),
               tensors.size(), overlap) {
        LOCKSTEP_REQUIRE(Root < comm.size(), errc::invalid_argument, comm.rank(),
                         "reduce::parameter_server", "root ", Root, " is not a replica (",
                         comm.size(), " replicas)");
    }

    /// Root updates; everyone receives Root's parameters.
    template <class Update>
    void apply(std::span<T> values, Update&& update) {
        if (this->comm().rank() == Root)
            update();
        broadcast(values);
    }
    void average(std::span<T> values) {
        this->begin(values);
        this->finish();
        if (this->comm().rank() == Root)
            scale(this->comm().system(), values, T(1) / static_cast<T>(this->comm().size()));
        broadcast(values);
    }

    /// One piece: summed onto Root.
    void reduce_piece(Communicator& c, std::span<T> piece) {
        c.reduce(std::span<const T>(piece), piece, reduce_op::sum, Root);
    }

private:
    void broadcast(std::span<T> values) {
        for (const bucket& b : this->plan()) {
            this->comm().broadcast(values.subspan(b.offset, b.size), Root);
            this->count_collective();
        }
    }
};

} // namespace lockstep::detail

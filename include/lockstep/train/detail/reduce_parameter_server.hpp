// lockstep/train/detail/reduce_parameter_server.hpp: the reducer of
// reduce::parameter_server<Root> (sum onto Root, Root updates, parameters broadcast back).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

template <class Policy, class T, class Communicator>
class reducer;

/// reduce::parameter_server<Root>: gradients are summed onto Root in the default buckets
/// (reduce, in place), only Root runs the optimizer, and the parameters are broadcast from Root.
/// Traffic per step: one reduce plus one broadcast of the whole model (a ring all_reduce moves
/// about the same bytes, but Root's link carries all of it); what it buys is that optimizer
/// state lives and moves on Root only.
template <int Root, class T, class Communicator>
class reducer<reduce::parameter_server<Root>, T, Communicator> {
    using buckets = reduce::bucketed<>;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors)
        : comm_(&comm), launcher_(plan_buckets(tensors, sizeof(T), buckets::first_bucket_bytes,
                                               buckets::bucket_bytes),
                                  tensors.size()) {
        LOCKSTEP_REQUIRE(Root < comm.size(), errc::invalid_argument, comm.rank(),
                         "reduce::parameter_server", "root ", Root, " is not a replica (",
                         comm.size(), " replicas)");
    }

    void begin(std::span<T> data) {
        data_ = data;
        launcher_.reset();
    }
    void mark_ready(std::size_t t) {
        launcher_.mark_ready(t, [&](const bucket& b) { launch(b); });
    }
    void finish() {
        launcher_.finish([&](const bucket& b) { launch(b); });
    }
    /// Root updates; everyone receives Root's parameters.
    template <class Update>
    void apply(std::span<T> values, Update&& update) {
        if (comm_->rank() == Root)
            update();
        broadcast(values);
    }
    void average(std::span<T> values) {
        begin(values);
        finish();
        if (comm_->rank() == Root)
            scale(comm_->system(), values, T(1) / static_cast<T>(comm_->size()));
        broadcast(values);
    }
    const std::vector<bucket>& plan() const noexcept { return launcher_.plan(); }
    std::size_t collectives() const noexcept { return collectives_; }

private:
    void launch(const bucket& b) {
        std::span<T> piece = data_.subspan(b.offset, b.size);
        comm_->reduce(std::span<const T>(piece), piece, reduce_op::sum, Root);
        ++collectives_;
    }
    void broadcast(std::span<T> values) {
        for (const bucket& b : launcher_.plan()) {
            comm_->broadcast(values.subspan(b.offset, b.size), Root);
            ++collectives_;
        }
    }

    Communicator* comm_;
    ordered_launcher launcher_;
    std::span<T> data_;
    std::size_t collectives_ = 0;
};

} // namespace lockstep::detail

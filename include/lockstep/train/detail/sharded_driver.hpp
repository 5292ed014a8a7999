// lockstep/train/detail/sharded_driver.hpp: the step driver of reduce::sharded (ZeRO stage 1)
// under sync::synchronous: each replica reduces, checks, clips and updates its shard.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/detail/step_driver.hpp"

#include <cstddef>

namespace lockstep::detail {

/// reduce::sharded<Bytes, FirstBytes>: the buckets are reduce-scattered while backward runs, so
/// each replica holds the reduced gradient of its shard (optimizer_shard()) only; it checks,
/// clips and updates that shard; the shards' non-finite counts, first indices and squared norms
/// travel in the status all_reduce (shard rows), so every replica takes the same decision from
/// the whole gradient; then the updated shards are all-gathered (reducer apply).
template <std::size_t Bytes, std::size_t FirstBytes>
class step_driver<sync::synchronous, reduce::sharded<Bytes, FirstBytes>> {
public:
    template <class Stages>
    explicit step_driver(Stages& /*s*/) {}

    template <class Stages, class Fn>
    step_result step(Stages& s, std::size_t global, Fn& fn) {
        const shard_extent own = s.core().optimizer_shard();
        s.begin(0);
        s.zero();
        s.start_reduction();
        const double loss = s.forward_backward(global, fn, false, true);
        s.finish_reduction();
        s.unscale();
        step_result r = s.open_result();
        s.report(loss, global, r.lr);
        s.freeze();
        s.hook(); // the shard holds the reduced gradient, the rest this replica's own
        s.check(own);
        s.share_shard_checks();
        s.sum_status();
        s.combine_shard_checks();
        s.decide(0, s.replicas());
        s.update_scale();
        s.count_skip(s.replicas());
        s.commit();
        s.set_lr(r.lr);
        s.reducer().apply(s.core().values(), [&] {
            s.clip(own);
            s.update(own);
        });
        return s.end(global, r);
    }

    template <class Stages>
    void finish(Stages& /*s*/) {}
};

} // namespace lockstep::detail

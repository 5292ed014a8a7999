// lockstep/train/detail/reproducible_driver.hpp: the step driver of reduce::reproducible<C>
// under sync::synchronous: one step function call per chunk, the chunks' gradients summed
// exactly, one rounding. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/detail/global_batch_check.hpp"
#include "lockstep/train/detail/reduce_reproducible.hpp"
#include "lockstep/train/detail/step_driver.hpp"
#include "lockstep/train/shard.hpp"

#include <cstddef>
#include <span>

namespace lockstep::detail {

/// reduce::reproducible<C>: the global batch is cut into chunks [k C, min((k + 1) C, global));
/// this replica computes its contiguous run of chunks, one fn call per chunk on zeroed gradients
/// with scale = 1 / global; the anchored accumulator (anchored_accumulator.hpp) keeps every
/// chunk's gradient but the last, each tensor as the backward marks it ready (which leaves zeros
/// for the next chunk: step_stages::forward_backward_chunks), and each chunk's loss. The chunk
/// values are exchanged (gathered to every replica, each block of elements to its owner by
/// all_to_all, or read where they lie by all_combine), this replica's own chunk values checked
/// (non-finite counts name the replica: counted by the sums themselves where the exchange
/// reports, combined or blocks in place; else on the host in float only where the keep passes
/// and a pass over the last chunk as the backward marks it ready flagged a non-finite value), the
/// sums formed in fixed point anchored at each element's largest exponent and rounded once (on
/// every replica, or by each element's owner, followed by an all_gather of the blocks or stored
/// to every replica) into the gradient, and the step continues as the synchronous one (status
/// all_reduce, skip decision, update); the summed gradient is not read again to count its
/// non-finite elements where the sums reported none and nothing changes it before the check. The
/// loss reported is the exact sum, rounded once (replica 0 contributes it to the status sum, the
/// others 0). bn::ghost layers learn the global batch from the layers' step (begin(global)).
/// ensures: every replica, for every replica count, holds the same bits.
template <std::size_t C, std::size_t G>
class step_driver<sync::synchronous, reduce::reproducible<C, G>> {
public:
    /// requires: train_params::micro_batches == 1 (else lockstep::error, invalid_argument).
    template <class Stages>
    explicit step_driver(Stages& s) {
        LOCKSTEP_REQUIRE(s.core().params().micro_batches == 1, errc::invalid_argument, s.rank(),
                         "data_parallel", "micro_batches = ", s.core().params().micro_batches,
                         ": reduce::reproducible cuts every global batch into chunks of ", C,
                         " samples itself (use 1)");
    }

    template <class Stages, class Fn>
    step_result step(Stages& s, std::size_t global, Fn& fn) {
        using T = typename Stages::T;
        auto& acc = s.reducer().accumulator();
        const std::span<T> grads = s.core().grads().first(acc.size());
        const shard_extent all = s.core().optimizer_shard(); // every element
        LOCKSTEP_REQUIRE(global >= 1, errc::invalid_argument, s.rank(), "data_parallel.step",
                         "global batch size is 0");
        const std::size_t chunks = (global + C - 1) / C;
        LOCKSTEP_REQUIRE(chunks + static_cast<std::size_t>(s.replicas()) <=
                             kernels::anchored_limits::max_terms,
                         errc::invalid_argument, s.rank(), "data_parallel.step", "global batch ",
                         global, " in chunks of ", C, " samples is ", chunks, " chunks on ",
                         s.replicas(), " replicas; reduce::reproducible sums at most ",
                         kernels::anchored_limits::max_terms, " chunks plus replicas");
        check_same_global_batch(s.core().comm(), global, s.core().steps(), [] {
            return concat("reduce::reproducible cuts it into chunks of ", C,
                          " samples; every replica must exchange as many");
        });
        (void)next_sample_offset(s.core().samples(), global, s.rank());
        const step_view v = s.begin(global);
        const shard_range mine = reproducible_chunks(global, C, s.rank(), s.replicas());
        const shard_range busiest = reproducible_chunks(global, C, 0, s.replicas());
        // A replica without chunks adds one of zeros.
        acc.begin(mine.empty() ? 1 : mine.size(), busiest.empty() ? 1 : busiest.size());
        double* chunk_loss = acc.chunk_loss();
        s.forward_backward_chunks(
            global, C, fn, chunk_loss,
            [&](std::size_t first, std::size_t count) { acc.take(grads, first, count); },
            [&](double host_loss) {
                acc.add(std::span<const T>(grads));
                acc.add_loss(host_loss, chunk_loss);
            });
        acc.exchange(s.core().comm(), std::span<const T>(grads));
        // This replica's non-finite chunk values and loss are counted as its own; the skip
        // decision depends on no partial sum (only on values and the global sums), so it is the
        // same for every replica count.
        double* own_loss = acc.own_loss();
        acc.check_local(grads, own_loss);
        if (!acc.reports_own()) {
            if (acc.own_values_finite())
                s.clear_pieces(); // what counting g would find: nothing
            else
                s.check_pieces();
        }
        double* global_loss = acc.global_loss();
        acc.finalize(s.core().comm(), grads, global_loss);
        if (acc.reports_own())
            s.load_pieces(acc.own_report()); // the sums counted this replica's values
        s.reducer().count_step();
        s.unscale();
        kernels::for_each_index(
            s.system(), 1,
            reproducible_loss_fn{own_loss, global_loss, s.rank() == 0, &v.totals->loss});
        step_result r = s.open_result();
        s.report(0.0, global, r.lr);
        s.freeze();
        s.hook();
        if (acc.sums_finite() && s.checks_reduced_as_left())
            s.clear_reduced(); // the sums saw every one of them: none is NaN or infinite
        else
            s.check(all);
        s.sum_status();
        s.decide(0, s.replicas());
        s.update_scale();
        s.count_skip(s.replicas());
        s.commit(); // bn::ghost: the chunks' statistics gathered, running statistics updated
        s.set_lr(r.lr);
        s.clip(all);
        s.update(all);
        return s.end(global, r);
    }

    template <class Stages>
    void finish(Stages& /*s*/) {}
};

} // namespace lockstep::detail

// lockstep/train/detail/reproducible_collective.hpp: the collective of reduce::reproducible<C>:
// one step function call per chunk of C samples, the chunks' gradients summed exactly over
// replicas by the anchored accumulator, one rounding. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/anchored_accumulator.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/global_batch_check.hpp"
#include "lockstep/train/detail/gradient_collective.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

namespace lockstep::detail {

/// reduce::reproducible<C, G>: the global batch is cut into chunks [k C, min((k + 1) C, global));
/// this replica computes its contiguous run of chunks, one fn call per chunk on zeroed gradients
/// with scale = 1 / global. The anchored accumulator keeps every chunk's gradient but the last and
/// every chunk's loss, exchanges them, checks this replica's own values (its non-finite counts
/// name it) and sums each element exactly, rounded once into every replica's gradient; then the
/// step goes on as the synchronous one. Replica 0 adds the exact loss to the status sum, the
/// others 0. bn::ghost layers learn the global batch from the layers' step (begin(global)).
/// Never launched piece by piece: plan() is per tensor, for the checks.
/// ensures: every replica, for every replica count, holds the same bits.
template <std::size_t C, std::size_t G, class T, class Communicator>
class collective<reduce::reproducible<C, G>, T, Communicator> {
public:
    using system_type = typename Communicator::system_type;
    using accumulator_type =
        anchored_accumulator<T, system_type, anchored_exchange_for<Communicator>>;
    static constexpr std::size_t status_doubles = 0;

    static_assert(all_to_all_communicator<Communicator>,
                  "reduce::reproducible needs a communicator with all_to_all (thread_group, MPI, "
                  "NCCL, and hierarchical ones whose parts have it)");

    /// requires: params.micro_batches == 1 (else lockstep::error, invalid_argument).
    collective(Communicator& comm, const std::vector<tensor_info>& tensors,
               overlap_setting /*overlap*/ = {}, const train_params& params = {})
        : launcher_(plan_buckets(tensors, sizeof(T), 1, 1), tensors.size(), comm.rank()),
          acc_(flat_extent(tensors), comm.size(), comm.rank(), comm.system(), G) {
        LOCKSTEP_REQUIRE(params.micro_batches == 1, errc::invalid_argument, comm.rank(),
                         "data_parallel", "micro_batches = ", params.micro_batches,
                         ": reduce::reproducible cuts every global batch into chunks of ", C,
                         " samples itself (use 1)");
    }

    /// The step's gradient; returns 0 (the exact loss goes into the status's loss slot).
    template <class Stages, class Fn>
    double gradient(Stages& s, std::size_t global, Fn& fn) {
        const int rank = s.rank(), replicas = s.replicas();
        const std::span<T> grads = s.core().grads().first(acc_.size());
        s.core().check_global(global);
        const std::size_t chunks = (global + C - 1) / C;
        LOCKSTEP_REQUIRE(
            chunks + static_cast<std::size_t>(replicas) <= kernels::anchored_limits::max_terms,
            errc::invalid_argument, rank, "data_parallel.step", "global batch ", global,
            " in chunks of ", C, " samples is ", chunks, " chunks on ", replicas,
            " replicas; reduce::reproducible sums at most ", kernels::anchored_limits::max_terms,
            " chunks plus replicas: use a larger ChunkSamples (reduce::reproducible"
            "<C>) or a smaller global batch");
        check_same_global_batch(s.core().comm(), global, s.core().steps(), C);
        const step_view v = s.begin(global);
        const reduce::chunk_run mine = reduce::chunks_of(global, C, rank, replicas);
        const reduce::chunk_run busiest = reduce::chunks_of(global, C, 0, replicas);
        // A replica without chunks adds one of zeros.
        acc_.begin(std::max<std::size_t>(mine.count, 1), std::max<std::size_t>(busiest.count, 1));
        run_chunks(s, global, mine, fn, grads);
        acc_.exchange(s.core().comm(), std::span<const T>(grads));
        // The skip decision depends on no partial sum, only on this replica's own chunk values
        // and losses and the global sums: the same for every replica count.
        acc_.check_local(grads);
        auto& checks = s.checks();
        if (!acc_.reports_own())
            for (std::size_t k = 0; k < plan().size(); ++k)
                checks.check_piece(s.system(), std::span<const T>(grads), k, plan()[k]);
        acc_.finalize(s.core().comm(), grads);
        if (acc_.reports_own()) // the sums counted this replica's values
            checks.load_pieces(s.system(), &acc_.own_report()->own);
        collectives_.fetch_add(acc_.collectives(), std::memory_order_relaxed);
        acc_.add_status_loss(&v.totals->loss, rank == 0);
        return 0.0;
    }

    bool reduced_here(int /*rank*/) const noexcept { return true; }

    /// The reduced gradient checked (not read where the sums saw every element finite), then the
    /// status summed.
    template <class Stages>
    void agree(Stages& s) {
        if (acc_.sums_finite() && s.checks_reduced_as_left())
            s.checks().clear_reduced(s.system(), s.view().outcome);
        else
            s.check(s.core().optimizer_shard());
        s.sum_status();
    }

    template <class Stages>
    void update(Stages& s) {
        update_every_element(s);
    }

    const std::vector<bucket>& plan() const noexcept { return launcher_.plan(); }
    std::size_t collectives() const noexcept {
        return collectives_.load(std::memory_order_relaxed);
    }
    bool overlaps() const noexcept { return false; }
    void drain() noexcept {}

private:
    /// Forward and backward once per chunk of this replica's run (a replica without chunks calls
    /// fn once with an empty range, so its layers take part in the step), each with scale =
    /// 1 / global and its loss in the accumulator's chunk loss. The accumulator takes each part of
    /// the flat gradient once, as it is final: with a registry network, tensor by tensor in the
    /// per-tensor plan's order (reverse registration, backward's) as ctx.mark_ready completes
    /// them (while the backward may still hold them in the caches), the rest after fn returns
    /// (ordered_launcher); with a visitor network, the whole packed buffer. Taking a kept chunk
    /// leaves zeros, on which the next chunk starts.
    template <class Stages, class Fn>
    void run_chunks(Stages& s, std::size_t global, reduce::chunk_run mine, Fn& fn,
                    std::span<T> grads) {
        using core_type = std::remove_reference_t<decltype(s.core())>;
        auto& core = s.core();
        auto& ctx = core.context();
        double* chunk_loss = acc_.chunk_loss();
        const auto take = [&](const bucket& b) { acc_.take(grads, b.offset, b.size); };
        const step_scope scope(ctx, chunk_loss, &s.layers());
        const ready_hook_scope hook(ctx);
        ctx.set_step(core.steps(), true);
        const std::size_t calls = std::max<std::size_t>(mine.count, 1);
        for (std::size_t c = 0; c < calls; ++c) {
            shard_range r;
            r.begin = mine.count > 0 ? (mine.first + c) * C : global;
            r.end = std::min(global, r.begin + C);
            r.global_size = global;
            r.sample_offset = core.samples();
            r.scale = r.empty() ? 0.0 : 1.0 / static_cast<double>(global);
            if (c == 0 || core_type::uses_visitor)
                core.zero_grads(); // else the previous chunk's take left zeros
            zero(s.system(), std::span<double>(chunk_loss, 1));
            if constexpr (!core_type::uses_visitor) {
                launcher_.reset();
                ctx.set_ready_hook([&](std::size_t t) { launcher_.mark_ready(t, take); });
            }
            double host_loss = 0;
            if constexpr (std::is_void_v<decltype(fn(core.network(), r, ctx))>)
                fn(core.network(), r, ctx);
            else
                host_loss = static_cast<double>(fn(core.network(), r, ctx));
            core.pack_grads();
            if constexpr (core_type::uses_visitor) {
                acc_.take(grads, 0, grads.size()); // the last chunk stays
            } else {
                ctx.set_ready_hook({});
                launcher_.finish(take);
            }
            acc_.add(std::span<const T>(grads));
            acc_.add_loss(host_loss, chunk_loss);
        }
        ctx.set_step(core.steps(), false);
    }

    ordered_launcher launcher_; ///< the per-tensor plan: the checks' pieces, the takes' order
    accumulator_type acc_;
    std::atomic<std::size_t> collectives_{0};
};

} // namespace lockstep::detail

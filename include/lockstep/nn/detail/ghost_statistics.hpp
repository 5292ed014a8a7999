// lockstep/nn/detail/ghost_statistics.hpp: bn::ghost's statistics of one reproducible step: the
// chunks' statistics blocks, gathered at the step's end and applied in global chunk order.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/nn/detail/bn_agreement.hpp"
#include "lockstep/nn/detail/bn_state.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/system/buffer.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>

namespace lockstep::nn::detail {

/// bn::ghost, channel c: the running statistics updated from every chunk block of a step in
/// global chunk order (replica r's chunks are blocks [r per_replica, r per_replica + count_r),
/// count_r from reduce::chunks_of), as finish_statistics_fn updates them from one batch.
template <class Acc>
struct ghost_running_fn {
    const Acc* blocks;
    std::size_t stride;
    std::size_t per_replica;
    int replicas;
    std::size_t global;
    std::size_t chunk;
    Acc momentum;
    Acc* running_mean;
    Acc* running_var;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t c) const {
        Acc rm = running_mean[c];
        Acc rv = running_var[c];
        for (int r = 0; r < replicas; ++r) {
            const std::size_t count = reduce::chunks_of(global, chunk, r, replicas).count;
            for (std::size_t k = 0; k < count; ++k) {
                const Acc* b = blocks + (static_cast<std::size_t>(r) * per_replica + k) * stride;
                const double n = kernels::packed_moments::count(b);
                if (n > 1) {
                    const Acc unbiased =
                        b[kernels::packed_moments::m2(c)] / static_cast<Acc>(n - 1);
                    rm = (Acc(1) - momentum) * rm + momentum * b[kernels::packed_moments::mean(c)];
                    rv = (Acc(1) - momentum) * rv + momentum * unbiased;
                }
            }
        }
        running_mean[c] = rm;
        running_var[c] = rv;
    }
};

/// What a step's chunks change in the layer's running statistics.
template <class Acc>
struct ghost_running {
    std::span<Acc> mean, var; ///< the layer's running statistics (channels values each)
    Acc momentum;
};

/// bn::ghost<Chunk>'s statistics of one reduce::reproducible step for one layer: each call of
/// the layer (one chunk) leaves its packed statistics block here
/// (record); at the step's end (finish) every replica's blocks are gathered (one all_gather,
/// padded to the busiest replica's chunk count) and applied to the running statistics in global
/// chunk order, each with its own count: the same bits on every replica for every replica count.
/// The chunking is reduce::chunks_of's, the plan the reproducible step follows.
template <std::size_t Chunk, class Acc, class System>
class ghost_statistics {
    static_assert(Chunk >= 1, "bn::ghost<ChunkSamples> needs chunks of at least 1 sample.");

public:
    /// A new step: the chunks of the last one are forgotten and nothing is to gather.
    void begin_step() noexcept {
        chunks_ = 0;
        gather_ = nullptr;
    }

    /// Keeps one chunk's statistics block (kernels::packed_moments of the layer's channels, in
    /// sys's memory) when the chunk is not empty, and makes finish gather over comm for `step`.
    /// `agreement`: the layer's settings check, run over comm before the first gather.
    /// requires: comm, step and agreement outlive the step's finish; the same sys at every call.
    template <class Comm>
    void record(Comm& comm, const layer_step& step, std::span<const Acc> block, bool nonempty,
                const System& sys, settings_agreement& agreement) {
        gather_ = [this, &comm, &step, sys, &agreement](ghost_running<Acc> r) {
            return gather(comm, step, r, sys, agreement);
        };
        stride_ = block.size();
        if (!nonempty)
            return;
        const std::size_t at = chunks_ * stride_;
        grow(at + stride_, at, sys);
        kernels::for_each_index(
            sys, stride_, copy_if_fn<Acc>{block.data(), blocks_.data() + at, nullptr}, stride_);
        ++chunks_;
    }

    /// True when a chunk of this step was recorded (finish has work to do).
    bool pending() const noexcept { return static_cast<bool>(gather_); }

    /// The end of the step (collective over the communicator record was given): gathers every
    /// replica's blocks and updates r from them in global chunk order (replica order, then each
    /// replica's order). Returns the step's chunk count over every replica (what
    /// num_batches_tracked grows by). Throws lockstep::error (invalid_argument) when this
    /// replica recorded another number of non-empty chunks than the plan gives it.
    /// requires: pending().
    std::int64_t finish(ghost_running<Acc> r) {
        const auto g = std::exchange(gather_, nullptr);
        return g(r);
    }

private:
    /// blocks_ holds at least n values; the first `keep` are kept.
    void grow(std::size_t n, std::size_t keep, const System& sys) {
        if (blocks_.size() >= n)
            return;
        buffer<Acc, System> grown(2 * n, sys);
        if (keep != 0)
            kernels::for_each_index(sys, keep,
                                    copy_if_fn<Acc>{blocks_.data(), grown.data(), nullptr}, keep);
        blocks_ = std::move(grown);
    }

    template <class Comm>
    std::int64_t gather(Comm& comm, const layer_step& step, ghost_running<Acc> r, const System& sys,
                        settings_agreement& agreement) {
        const std::size_t global = step.ghost_global();
        const int size = comm.size();
        const reduce::chunk_run own = reduce::chunks_of(global, Chunk, comm.rank(), size);
        const reduce::chunk_run busiest = reduce::chunks_of(global, Chunk, 0, size);
        const reduce::chunk_run last = reduce::chunks_of(global, Chunk, size - 1, size);
        LOCKSTEP_REQUIRE(own.count == chunks_, errc::invalid_argument, comm.rank(),
                         "batch_norm.forward_train", "bn::ghost: the layer normalized ", chunks_,
                         " non-empty batches in this step, the replica computes ", own.count,
                         " chunks of ", Chunk,
                         " samples (call each ghost layer once per chunk of the step)");
        const std::size_t most = busiest.count;
        if (most != 0) {
            agreement.check(comm, "batch_norm.forward_train");
            grow(most * stride_, chunks_ * stride_, sys);
            const auto send = blocks_.span().first(most * stride_);
            auto all = ensure(gathered_, static_cast<std::size_t>(size) * most * stride_, sys);
            comm.all_gather(std::span<const Acc>(send), all);
            kernels::for_each_index(sys, r.mean.size(),
                                    ghost_running_fn<Acc>{.blocks = all.data(),
                                                          .stride = stride_,
                                                          .per_replica = most,
                                                          .replicas = size,
                                                          .global = global,
                                                          .chunk = Chunk,
                                                          .momentum = r.momentum,
                                                          .running_mean = r.mean.data(),
                                                          .running_var = r.var.data()},
                                    all.size());
        }
        chunks_ = 0;
        return static_cast<std::int64_t>(last.first + last.count); // where the last run ends
    }

    std::size_t stride_ = 0;       ///< values per block
    buffer<Acc, System> blocks_;   ///< this replica's chunk blocks of the step
    buffer<Acc, System> gathered_; ///< every replica's chunk blocks
    std::size_t chunks_ = 0;       ///< blocks kept in this step
    std::function<std::int64_t(ghost_running<Acc>)> gather_; ///< the step's end, over its comm
};

} // namespace lockstep::nn::detail

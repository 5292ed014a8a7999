// lockstep/train/detail/sharded_collective.hpp: the collective of reduce::sharded<Bytes,
// FirstBytes> (ZeRO stage 1): buckets reduce-scattered onto their shards, each replica checks,
// clips and updates its shard, the shards' checks summed in the step's status, the updated shards
// all-gathered. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/bucketed_collective.hpp"
#include "lockstep/train/detail/optimizer_shard.hpp"
#include "lockstep/train/detail/reduced_check_rows.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/step_state.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// reduce::sharded<Bytes, FirstBytes> (ZeRO stage 1): the buckets of reduce::bucketed<Bytes,
/// FirstBytes>; each bucket is reduce-scattered (sum) with counts = the bucket's intersection
/// with every replica's shard, so replica r receives, in place in the flat gradient buffer, the
/// reduced gradient of [o_r, o_r + c_r) (elements outside its shard keep its own gradient; the
/// optimizer's shard, replica_core::optimizer_shard(), is the same layout). Each replica checks
/// its shard; the shards' non-finite counts, first indices and squared norms travel in the status
/// all_reduce (shard rows), so every replica takes the same decision from the whole gradient;
/// each replica clips and updates its shard, then the updated shards are all-gathered so every
/// replica holds the same parameters: in place in the flat buffer when every shard has the same
/// size (the buffer is then exactly replicas x c elements in rank order), else through a staging
/// buffer of replicas x max c_r elements (all_gather needs equal counts: each shard is padded to
/// the largest).
template <std::size_t Bytes, std::size_t FirstBytes, class T, class Communicator>
class collective<reduce::sharded<Bytes, FirstBytes>, T, Communicator>
    : public piecewise_collective<collective<reduce::sharded<Bytes, FirstBytes>, T, Communicator>,
                                  T, Communicator> {
    using policy = reduce::sharded<Bytes, FirstBytes>;
    using base = piecewise_collective<collective, T, Communicator>;
    using system_type = typename Communicator::system_type;

public:
    /// The shards' check rows in the step's status (reduced_check_rows.hpp).
    static constexpr std::size_t status_doubles = check_row_doubles;

    collective(Communicator& comm, const std::vector<tensor_info>& tensors,
               overlap_setting overlap = {}, const train_params& /*params*/ = {})
        : base(comm, plan_buckets_of<policy>(tensors, sizeof(T)), tensors.size(), overlap),
          shards_(shard_layout(flat_extent(tensors), comm.size())) {
        std::size_t widest = 0;
        for (const shard_extent& e : shards_)
            widest = std::max(widest, e.count);
        slot_ = widest;
        even_ = std::all_of(shards_.begin(), shards_.end(),
                            [&](const shard_extent& e) { return e.count == widest; });
        if (!even_)
            staging_ = buffer<T, system_type>(slot_ * shards_.size(), comm.system());
        for (const bucket& b : this->plan()) {
            std::vector<std::size_t> counts;
            for (const shard_extent& e : shards_) {
                const std::size_t lo = std::max(b.offset, e.offset);
                const std::size_t hi = std::min(b.offset + b.size, e.offset + e.count);
                counts.push_back(hi > lo ? hi - lo : 0);
            }
            counts_.push_back(std::move(counts));
        }
    }

    /// One bucket: reduce-scattered over the shards, this replica's part in place.
    void reduce_piece(Communicator& c, std::span<T> piece, const bucket& b) {
        const auto k = static_cast<std::size_t>(&b - this->plan().data());
        const shard_extent& mine = shards_[static_cast<std::size_t>(c.rank())];
        const std::size_t lo = std::max(b.offset, mine.offset);
        const std::span<const std::size_t> counts(counts_[k]);
        const std::size_t n = counts[static_cast<std::size_t>(c.rank())];
        // A shard outside this bucket gets an empty part (its start clamped into the piece).
        const std::size_t at = std::min(lo - b.offset, piece.size());
        c.reduce_scatter(std::span<const T>(piece), piece.subspan(at, n), counts, reduce_op::sum);
    }

    /// This replica's shard checked; every shard's checks shared through the status.
    template <class Stages>
    void agree(Stages& s) {
        s.check(s.core().optimizer_shard());
        share_reduced_checks(s, true);
    }

    /// The shard clipped and updated, then every shard all-gathered.
    template <class Stages>
    void update(Stages& s) {
        const shard_extent own = s.core().optimizer_shard();
        s.clip(own);
        s.update(own);
        gather(s.core().values());
    }

    /// values: every replica's shard of values becomes its owner's (one all_gather).
    void gather(std::span<T> values) {
        auto& comm = this->comm();
        const auto sys = comm.system();
        const auto me = static_cast<std::size_t>(comm.rank());
        const shard_extent& mine = shards_[me];
        if (even_) { // shard r is [r c, (r + 1) c): values is the gathered layout itself
            comm.all_gather(std::span<const T>(values.subspan(mine.offset, mine.count)),
                            values.first(slot_ * shards_.size()));
            this->count_collective();
            return;
        }
        const std::span<T> all = staging_.span();
        std::span<T> slot = all.subspan(me * slot_, slot_);
        if (mine.count != 0)
            copy_async(sys, std::span<const T>(values.subspan(mine.offset, mine.count)),
                       slot.first(mine.count));
        comm.all_gather(std::span<const T>(slot), all);
        this->count_collective();
        for (std::size_t r = 0; r < shards_.size(); ++r)
            if (r != me && shards_[r].count != 0)
                copy_async(sys, std::span<const T>(all.subspan(r * slot_, shards_[r].count)),
                           values.subspan(shards_[r].offset, shards_[r].count));
    }

    /// The shards of every replica, in rank order.
    const std::vector<shard_extent>& shards() const noexcept { return shards_; }

private:
    std::vector<shard_extent> shards_;
    std::vector<std::vector<std::size_t>> counts_; ///< per bucket: its part in every shard
    std::size_t slot_ = 0;                         ///< elements per replica in the staging
    bool even_ = false;                            ///< every shard holds slot_ elements
    buffer<T, system_type> staging_;               ///< empty when even_
};

} // namespace lockstep::detail

// lockstep/train/detail/reduce_sharded.hpp: the reducer of reduce::sharded<Bytes, FirstBytes>
// (ZeRO stage 1), the shard layout, the cross-shard norm reduction of LARS/LAMB and the kernels
// that sum the sharded gradient checks in the step's status. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/segmented.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/reducer_base.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/shard.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep::detail {

/// One replica's shard of the flat parameter buffer: elements [offset, offset + count).
struct shard_extent {
    std::size_t offset = 0;
    std::size_t count = 0;
};

/// The shards of a flat buffer of n elements over `replicas` replicas: contiguous, in rank
/// order, balanced by element count (the first n % replicas shards hold one element more; a
/// shard is empty when n < replicas). ensures: the shards cover [0, n) without overlap.
inline std::vector<shard_extent> shard_layout(std::size_t n, int replicas) {
    std::vector<shard_extent> out;
    for (int r = 0; r < replicas; ++r) {
        const shard_range s = shard(0, n, r, replicas);
        out.push_back({s.begin, s.size()});
    }
    return out;
}

/// The optimizer segments of shard e: every segment of `whole` intersected with e, rebased to
/// the shard's first element, with `global` receiving each one's index in `whole`. A shard
/// that meets no segment gets one empty segment (mapped to segment 0) so that the optimizer is
/// not taken as one whole tensor; its norms contribute zero.
inline std::vector<tensor_segment> shard_segments(std::span<const tensor_segment> whole,
                                                  shard_extent e,
                                                  std::vector<std::uint32_t>& global) {
    std::vector<tensor_segment> out;
    global.clear();
    const std::size_t end = e.offset + e.count;
    for (std::size_t s = 0; s < whole.size(); ++s) {
        const std::size_t b = std::max(whole[s].offset, e.offset);
        const std::size_t f = std::min(whole[s].offset + whole[s].size, end);
        if (b >= f)
            continue;
        out.push_back(tensor_segment{b - e.offset, f - b, whole[s].decay, whole[s].adapt});
        global.push_back(static_cast<std::uint32_t>(s));
    }
    if (out.empty()) {
        out.push_back(tensor_segment{0, 0, false, false});
        global.push_back(0);
    }
    return out;
}

/// Per local segment i: global[2 map[i]] = local[i].a, global[2 map[i] + 1] = local[i].b.
struct scatter_norms_fn {
    const kernels::sum_pair* local;
    const std::uint32_t* map;
    double* global;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        global[2 * static_cast<std::size_t>(map[i])] = local[i].a;
        global[2 * static_cast<std::size_t>(map[i]) + 1] = local[i].b;
    }
};

/// Per local segment i: local[i] = {global[2 map[i]], global[2 map[i] + 1]}.
struct gather_norms_fn {
    const double* global;
    const std::uint32_t* map;
    kernels::sum_pair* local;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        local[i] = kernels::sum_pair{global[2 * static_cast<std::size_t>(map[i])],
                                     global[2 * static_cast<std::size_t>(map[i]) + 1]};
    }
};

/// The norm reduction of a sharded LARS/LAMB (optim::lars::set_norm_reduction): the partial
/// per-segment sums of this shard are written at their tensor's (whole segment's) index into a
/// vector of 2 x (segments of the whole buffer) doubles, summed over replicas by ONE all_reduce
/// and read back, so every replica's trust ratios use the norms of whole tensors. Every pass
/// is a kernel on the system's stream (no host read); the all_reduce runs on the replica's
/// thread, inside the optimizer's step.
template <class Communicator>
class sharded_norms {
public:
    using system_type = typename Communicator::system_type;

    /// requires: map[i] < whole_segments for every i; comm outlives this object.
    sharded_norms(Communicator& comm, std::size_t whole_segments,
                  const std::vector<std::uint32_t>& map)
        : comm_(&comm), global_(2 * whole_segments, comm.system()),
          map_(map.size(), comm.system()) {
        lockstep::copy(std::span<const std::uint32_t>(map), host_system{1}, map_.span(),
                       comm.system());
    }

    /// Replaces norms (this shard's per-segment partial sums) with the sums over replicas.
    /// Collective: every replica calls it in the same step. requires: norms.size() == the
    /// map's size.
    void operator()(std::span<kernels::sum_pair> norms) {
        LOCKSTEP_REQUIRE(norms.size() == map_.size(), errc::shape_mismatch, comm_->rank(),
                         "reduce::sharded.norms", "the optimizer has ", norms.size(),
                         " segments, the shard ", map_.size());
        const auto sys = comm_->system();
        kernels::with_policy_for(sys, global_.size(), [&](auto policy) {
            thrust::fill(policy, global_.data(), global_.data() + global_.size(), 0.0);
        });
        kernels::for_each_index(sys, norms.size(),
                                scatter_norms_fn{norms.data(), map_.data(), global_.data()});
        comm_->all_reduce(std::span<const double>(global_.span()), global_.span(), reduce_op::sum);
        kernels::for_each_index(sys, norms.size(),
                                gather_norms_fn{global_.data(), map_.data(), norms.data()});
    }

private:
    Communicator* comm_;
    buffer<double, system_type> global_;
    buffer<std::uint32_t, system_type> map_;
};

/// reduce::sharded<Bytes, FirstBytes> (ZeRO stage 1): the buckets of reduce::bucketed<Bytes,
/// FirstBytes>; each bucket is reduce-scattered (sum) with counts = the bucket's intersection
/// with every replica's shard, so replica r receives, in place in the flat gradient buffer, the
/// reduced gradient of [o_r, o_r + c_r) (elements outside its shard keep its own gradient).
/// apply() runs the update (the optimizer over the shard), then all-gathers the updated
/// shards so every replica holds the same parameters: in place in the flat buffer when every
/// shard has the same size (the buffer is then exactly replicas x c elements in rank order),
/// else through a staging buffer of replicas x max c_r elements (all_gather needs equal
/// counts: each shard is padded to the largest).
template <std::size_t Bytes, std::size_t FirstBytes, class T, class Communicator>
class reducer<reduce::sharded<Bytes, FirstBytes>, T, Communicator>
    : public reducer_base<reducer<reduce::sharded<Bytes, FirstBytes>, T, Communicator>, T,
                          Communicator> {
    using policy = reduce::sharded<Bytes, FirstBytes>;
    using base = reducer_base<reducer, T, Communicator>;
    using system_type = typename Communicator::system_type;

public:
    reducer(Communicator& comm, const std::vector<tensor_info>& tensors,
            overlap_setting overlap = {})
        : base(comm,
               plan_buckets(tensors, sizeof(T), policy::first_bucket_bytes, policy::bucket_bytes),
               tensors.size(), overlap),
          shards_(shard_layout(total(tensors), comm.size())) {
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

    /// The update (on this replica's shard), then the all_gather of every shard.
    template <class Update>
    void apply(std::span<T> values, Update&& update) {
        update();
        gather(values);
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
    static std::size_t total(const std::vector<tensor_info>& tensors) {
        std::size_t n = 0;
        for (const tensor_info& t : tensors)
            n = std::max(n, t.offset + t.size);
        return n;
    }

    std::vector<shard_extent> shards_;
    std::vector<std::vector<std::size_t>> counts_; ///< per bucket: its part in every shard
    std::size_t slot_ = 0;                         ///< elements per replica in the staging
    bool even_ = false;                            ///< every shard holds slot_ elements
    buffer<T, system_type> staging_;               ///< empty when even_
};

} // namespace lockstep::detail

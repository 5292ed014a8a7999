// lockstep/train/detail/optimizer_shard.hpp: the shards of the flat parameter buffer an
// optimizer updates (reduce::sharded: one per replica), their segments, and the cross-shard norm
// reduction of LARS/LAMB. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/segmented.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/shard.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <thrust/fill.h>

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

} // namespace lockstep::detail

// lockstep/train/detail/mark_order_hint.hpp: the likely cause named in a step's timeout when its
// buckets overlap on a side stream of the replica's GPU: replicas marking gradients ready at
// different points. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

namespace lockstep::detail {

/// `e` with the launch-order deadlock named, when it is a timeout or a peer's failure of a step
/// whose buckets overlap on a side stream of the replica's GPU (`side_stream_overlap`:
/// nccl_communicator with overlap on). There each process launches its kernels in its own host
/// order (NCCL_LAUNCH_ORDER_IMPLICIT), so replicas whose mark_ready calls fall at different
/// points relative to their batch-norm collectives wait for each other until the timeout (seen
/// on an H200 with 2 NCCL ranks). Otherwise `e` unchanged.
inline error with_mark_order_hint(const error& e, bool side_stream_overlap) {
    if (!side_stream_overlap || (e.code() != errc::timeout && e.code() != errc::peer_failure))
        return e;
    return {e.code(), e.replica(), e.operation(),
            concat(e.details(),
                   "; with overlap on this GPU's communicators, this is also what replicas get "
                   "whose ctx.mark_ready calls fall at different points relative to their "
                   "batch-norm layers' collectives (a replica that marks fewer tensors, or none): "
                   "call mark_ready at the same program points on every replica, or train with "
                   "overlap_mode::never (docs/train_api.md)")};
}

} // namespace lockstep::detail

// lockstep/comm/nccl_group.hpp: nccl_group, NCCL calls grouped so that one host thread can
// drive several replicas (ncclGroupStart/End). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

// NCCL needs the CUDA system, hence nvcc; elsewhere this header declares nothing.
#if LOCKSTEP_HAS_NCCL

#include <nccl.h>

namespace lockstep {

/// Groups NCCL calls so that one host thread can drive several replicas (ncclGroupStart on
/// construction, ncclGroupEnd in end() or the destructor): e.g.
/// `{ nccl_group g; for (auto& c : comms) c.all_reduce(...); g.end(); }`.
class nccl_group {
public:
    nccl_group() { LOCKSTEP_NCCL_CHECK(ncclGroupStart()); }
    nccl_group(const nccl_group&) = delete;
    nccl_group& operator=(const nccl_group&) = delete;
    /// Ends the group; errors of the grouped calls are thrown here (errc::nccl), without aborting
    /// the grouped communicators: on such an error call abort() on each of them, so their peers
    /// are released.
    void end() {
        if (!open_)
            return;
        open_ = false;
        LOCKSTEP_NCCL_CHECK(ncclGroupEnd());
    }
    /// Ends the group if end() was not called (errors are then lost: call end()).
    ~nccl_group() {
        if (open_)
            (void)ncclGroupEnd();
    }

private:
    bool open_ = true;
};

} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL

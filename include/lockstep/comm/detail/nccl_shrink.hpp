// lockstep/comm/detail/nccl_shrink.hpp: what nccl_communicator::shrink and split need of NCCL:
// ncclCommRevoke and ncclCommShrink looked up in the library loaded at run time, and a child
// communicator (a split, the survivors') made against a deadline (nccl_deadline.hpp).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/detail/nccl_deadline.hpp"
#include "lockstep/comm/detail/nccl_family.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include <dlfcn.h>
#include <nccl.h>

namespace lockstep::detail {

/// ncclCommRevoke and ncclCommShrink of the NCCL library loaded at run time (NCCL 2.28.7 and
/// newer), null where it has none: looked up by name (dlsym) rather than linked, so that a program
/// built against 2.28's headers still loads and runs everything but a shrink with NCCL 2.26
/// or 2.27.
struct nccl_fault_api {
    using revoke_fn = ncclResult_t (*)(ncclComm_t, int);
    using shrink_fn = ncclResult_t (*)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int);
    revoke_fn revoke = nullptr;
    shrink_fn shrink = nullptr;

    /// The loaded library's (looked up once).
    static const nccl_fault_api& loaded() {
        static const nccl_fault_api api = [] {
            nccl_fault_api a;
            // NOLINTBEGIN(cppcoreguidelines-pro-type-reinterpret-cast): dlsym's documented use
            a.revoke = reinterpret_cast<revoke_fn>(::dlsym(RTLD_DEFAULT, "ncclCommRevoke"));
            a.shrink = reinterpret_cast<shrink_fn>(::dlsym(RTLD_DEFAULT, "ncclCommShrink"));
            // NOLINTEND(cppcoreguidelines-pro-type-reinterpret-cast)
            return a;
        }();
        return api;
    }
    /// Why the loaded library cannot shrink a communicator, or "" when it can.
    std::string problem() const {
        if (revoke != nullptr && shrink != nullptr)
            return {};
        int v = 0;
        return "the NCCL library loaded at run time (" +
               (ncclGetVersion(&v) == ncclSuccess ? nccl_version_name(v) : std::string("?")) +
               ") has no ncclCommRevoke / ncclCommShrink: shrinking needs NCCL 2.28.7 or newer";
    }
};

/// Makes a child communicator of `parent` (a member of `family`) with `make(&child)`
/// (ncclCommSplit or ncclCommShrink) within `timeout` (nccl_make_within). When `make` fails,
/// `family` is aborted and errc::nccl thrown. Past the deadline the helper may still be inside
/// NCCL using the parent, so the parent is taken out of the family and left alive (leaked: an
/// abort would free it under the helper), the rest of the family aborted and errc::timeout
/// thrown naming `what`. Returns the child (null where `make` made none: a split with
/// NCCL_SPLIT_NOCOLOR).
template <class Make>
ncclComm_t nccl_child_within(ncclComm_t parent, int device, std::chrono::milliseconds timeout,
                             nccl_family& family, int rank, const std::string& op, const char* what,
                             Make make) {
    const nccl_made made = nccl_make_within(device, timeout, std::move(make));
    if (!made.in_time) {
        family.forget(parent);
        family.abort_all();
        fail(errc::timeout, rank, op, what, " was not made within ", timeout.count(),
             " ms: a replica did not take part; communicators aborted (the parent left to the "
             "NCCL call still waiting for it)");
    }
    if (made.result != ncclSuccess) {
        if (made.comm != nullptr) {
            cuda_device_guard_noexcept guard(device);
            (void)ncclCommAbort(made.comm);
        }
        family.abort_all();
        fail(errc::nccl, rank, op, what, ": ", ncclGetErrorString(made.result), " (ncclResult_t ",
             static_cast<int>(made.result), ")");
    }
    return made.comm;
}

/// The survivors' communicator out of the revoked `parent` (rank `rank`, device `device`):
/// ncclCommShrink without the ranks `excluded`, or, when none is excluded (every member came to
/// the decision: the failure lost nobody), ncclCommSplit of all of them (NCCL's shrink needs at
/// least one rank to leave out); within `timeout` (nccl_child_within). The parent stays the
/// caller's to abort on success. requires: the parent revoked, `excluded` ascending, without
/// `rank`.
inline ncclComm_t nccl_survivors_comm(ncclComm_t parent, int device, int rank,
                                      std::vector<int> excluded, std::chrono::milliseconds timeout,
                                      nccl_family& family, const std::string& op) {
    const auto shrink = nccl_fault_api::loaded().shrink;
    return nccl_child_within(
        parent, device, timeout, family, rank, op, "the survivors' communicator",
        [parent, rank, shrink, excluded](ncclComm_t* child) mutable {
            if (excluded.empty())
                return ncclCommSplit(parent, 0, rank, child, nullptr);
            // NCCL_SHRINK_DEFAULT: the parent is revoked already
            return shrink(parent, excluded.data(), static_cast<int>(excluded.size()), child,
                          nullptr, 0);
        });
}

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

// lockstep/comm/detail/nccl_shrink.hpp: what nccl_communicator::shrink and split need of NCCL:
// ncclCommRevoke looked up in the library loaded at run time, and a child communicator (a split,
// the survivors') made against a deadline (nccl_deadline.hpp).
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

/// ncclCommRevoke of the NCCL library loaded at run time (NCCL 2.28.7 and newer), null where it
/// has none: looked up by name (dlsym) rather than linked, so that a program built against 2.28's
/// headers still loads and runs everything but a shrink with NCCL 2.26 or 2.27.
struct nccl_fault_api {
    using revoke_fn = ncclResult_t (*)(ncclComm_t, int);
    revoke_fn revoke = nullptr;

    /// The loaded library's (looked up once).
    static const nccl_fault_api& loaded() {
        static const nccl_fault_api api = [] {
            nccl_fault_api a;
            // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): dlsym's documented use
            a.revoke = reinterpret_cast<revoke_fn>(::dlsym(RTLD_DEFAULT, "ncclCommRevoke"));
            return a;
        }();
        return api;
    }
    /// Why the loaded library cannot shrink a communicator, or "" when it can.
    std::string problem() const {
        if (revoke != nullptr)
            return {};
        int v = 0;
        return "the NCCL library loaded at run time (" +
               (ncclGetVersion(&v) == ncclSuccess ? nccl_version_name(v) : std::string("?")) +
               ") has no ncclCommRevoke: shrinking needs NCCL 2.28.7 or newer";
    }
};

/// Makes a child communicator of `parent` (a member of `family`) with `make(&child)`
/// (ncclCommSplit or ncclCommInitRank) within `timeout` (nccl_make_within). When `make` fails,
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
             " ms: a replica did not take part; communicators aborted",
             parent != nullptr ? " (the parent left to the NCCL call still waiting for it)" : "");
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

/// The survivors' communicator: ncclCommInitRank of `size` ranks from `id` (made by the first
/// survivor and shared through nccl_options::survivors) as rank `rank`, on `device`, within
/// `timeout` (nccl_child_within without a parent: on failure or past the deadline `family`, the
/// revoked old communicators, is aborted). Made afresh, not by ncclCommShrink of the revoked
/// parent: NCCL keeps a lost peer's remote error as the parent's asynchronous error (its proxy's),
/// and ncclCommShrink and ncclCommSplit refuse a parent in error (on an H200 with NCCL 2.28.9 and
/// a SIGKILLed peer, ncclCommShrink returned ncclRemoteError). `old_rank`: for the errors.
inline ncclComm_t nccl_survivors_comm(const ncclUniqueId& id, int size, int rank, int device,
                                      std::chrono::milliseconds timeout, nccl_family& family,
                                      int old_rank, const std::string& op) {
    return nccl_child_within(
        nullptr, device, timeout, family, old_rank, op,
        "the survivors' communicator (ncclCommInitRank)",
        [id, size, rank](ncclComm_t* child) { return ncclCommInitRank(child, size, id, rank); });
}

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

// lockstep/comm/detail/nccl_membership.hpp: nccl_membership, which generation of an NCCL
// communicator a replica is in and who its members are, and next(), the shrink that moves the
// survivors to the next generation. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_NCCL

#include "lockstep/comm/detail/nccl_handle.hpp"
#include "lockstep/comm/detail/nccl_shrink.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace lockstep::detail {

/// One replica's place in the generations of its NCCL communicator: a member is named by its
/// rank in generation 0 (the communicator as created), which never changes; a generation's
/// members are ascending and its ranks are their positions.
class nccl_membership {
public:
    std::uint64_t generation() const noexcept { return generation_; }

    /// Replaces `h` by the survivors' communicator (see nccl_communicator::shrink): revokes h's
    /// family, takes the survivors' decision (nccl_options::survivors, waiting at most two
    /// timeouts: a survivor can find the loss up to one timeout after another, since it waits
    /// for a survivor that already stopped answering), throws errc::peer_failure when it left
    /// this replica out, takes the NCCL id the first survivor makes (the agreement's share, at
    /// most two timeouts), makes the survivors' communicator from it (nccl_survivors_comm) on h's
    /// device and stream and aborts h's family. Returns the members left out, ascending.
    /// requires: h.shrink_problem() empty.
    std::vector<int> next(nccl_handle& h, const std::string& op) {
        if (members_.empty()) { // generation 0: the members are the ranks
            members_.resize(static_cast<std::size_t>(h.size()));
            std::iota(members_.begin(), members_.end(), 0);
            member_ = h.rank();
        }
        h.stop(); // revoke: nothing of this generation runs any more
        // Aborted (a revoke failed, or a split's deadline passed): nothing left to shrink, and
        // coming to the decision would make the others wait for this replica's shrink.
        LOCKSTEP_REQUIRE(!h.aborted(), errc::communication, h.rank(), op,
                         "the communicator was aborted, not revoked: it cannot be shrunk");
        const nccl_options options = h.options();
        std::vector<int> survivors;
        std::vector<std::byte> shared;
        try {
            survivors = options.survivors(generation_, member_, std::span<const int>(members_),
                                          2 * options.timeout);
            if (!std::binary_search(survivors.begin(), survivors.end(), member_))
                fail(errc::peer_failure, h.rank(), op, "the survivors of generation ", generation_,
                     " left this replica (member ", member_,
                     ") out: it came to their decision after its deadline; it must not continue");
            shared = options.survivors.share(generation_, member_, std::span<const int>(survivors),
                                             2 * options.timeout, [] {
                                                 ncclUniqueId id{};
                                                 LOCKSTEP_NCCL_CHECK(ncclGetUniqueId(&id));
                                                 std::vector<std::byte> b(sizeof id);
                                                 std::memcpy(b.data(), &id, sizeof id);
                                                 return b;
                                             });
        } catch (...) {
            h.abort();
            throw;
        }
        std::vector<int> lost;
        for (int m : members_)
            if (!std::binary_search(survivors.begin(), survivors.end(), m))
                lost.push_back(m);
        const int new_rank = static_cast<int>(
            std::lower_bound(survivors.begin(), survivors.end(), member_) - survivors.begin());
        if (shared.size() != sizeof(ncclUniqueId)) {
            h.abort();
            fail(errc::internal, h.rank(), op, "the survivors shared ", shared.size(),
                 " bytes, not an NCCL id of ", sizeof(ncclUniqueId));
        }
        ncclUniqueId id{};
        std::memcpy(&id, shared.data(), sizeof id);
        ncclComm_t fresh =
            nccl_survivors_comm(id, static_cast<int>(survivors.size()), new_rank, h.device(),
                                options.timeout, *h.family(), h.rank(), op);
        const nccl_handle::stream_source stream{
            .shared = h.owned_stream(), .adopted = h.adopted_stream() ? h.stream() : nullptr};
        h.abort(); // the old family: aborted, never destroyed (a destroy could wait for it)
        h = nccl_handle(fresh, h.device(), stream, std::make_shared<nccl_clique>(), nullptr,
                        options);
        LOCKSTEP_REQUIRE(h.rank() == new_rank && h.size() == static_cast<int>(survivors.size()),
                         errc::internal, h.rank(), op, "NCCL made rank ", h.rank(), " of ",
                         h.size(), " for member ", member_, " of ", survivors.size(), " survivors");
        members_ = survivors;
        ++generation_;
        return lost;
    }

private:
    std::vector<int> members_; // after a shrink: the generation's members (empty: 0..size-1)
    int member_ = 0;           // this replica's generation-0 rank (set by the first shrink)
    std::uint64_t generation_ = 0;
};

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_NCCL

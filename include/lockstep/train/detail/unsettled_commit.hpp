// lockstep/train/detail/unsettled_commit.hpp: unsettled_commit, a blocking save's commit that a
// lost replica 0 may still make after the survivors of a shrink went on without it.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/train/detail/checkpoint_commit.hpp"
#include "lockstep/train/detail/checkpoint_names.hpp"

#include <filesystem>
#include <optional>
#include <span>
#include <vector>

namespace lockstep::detail {

/// One trainer's blocking save (save_checkpoint) from the agreement on its shards, after which
/// replica 0 may commit it, to the agreement on that commit, after which every replica knows
/// whether it did. A save whose second agreement threw (replica 0 stalled in its commit past the
/// timeout, or lost) stays open here. When the group then shrinks without replica 0, that replica
/// (a stalled thread lockstep cannot stop) may still commit the save later, over the survivors'
/// newer saves to the same path, and remove their shards as the generation it replaced.
/// shrank() settles it under the commit lock (ckpt::commit_or_revoke): the save stands when its
/// marker is there now, else its shards are removed, so that the late commit is refused.
class unsettled_commit {
public:
    explicit unsettled_commit(int rank) : rank_(rank) {}

    /// Every replica, once the save's shards are agreed durable (before replica 0 commits).
    void open(const std::filesystem::path& path, const ckpt::save_id& id, int world_size) {
        save_ = save{path, id, world_size};
    }
    /// Every replica, once the agreement on the commit has returned.
    void close() noexcept { save_.reset(); }

    /// Collective over the survivors, after the group shrank (data_parallel's rebuild, with the
    /// shrunk communicator): one small all_gather of the survivors' ranks before the shrink.
    /// Where replica 0 is not among them, a survivor with a save open settles it
    /// (ckpt::commit_or_revoke; each under the commit lock, so the first decides for all).
    /// ensures: no save open; rank is the communicator's.
    template <class Comm>
    void shrank(Comm& comm) {
        const int mine = rank_;
        rank_ = comm.rank();
        std::vector<int> before(static_cast<std::size_t>(comm.size()));
        ckpt::tagged_all_gather(comm, std::span<const int>(&mine, 1), std::span<int>(before),
                                collective_tag("data_parallel.step"));
        bool root_kept = false;
        for (int r : before)
            root_kept = root_kept || r == 0;
        if (save_ && !root_kept)
            (void)ckpt::commit_or_revoke(save_->path, save_->id, save_->world_size);
        save_.reset();
    }

private:
    struct save {
        std::filesystem::path path;
        ckpt::save_id id;
        int world_size = 0;
    };
    int rank_; ///< this replica's rank (until the group shrinks)
    std::optional<save> save_;
};

} // namespace lockstep::detail

// lockstep/train/detail/background_save.hpp: background_save, a synchronous trainer's checkpoint
// save that does not stop training (save_checkpoint_async): a writer thread per replica, the
// levels each replica reports in its step's row, replica 0's commit once every row says its
// shard is durable, and the collective wait.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/checkpoint_cleanup.hpp"
#include "lockstep/train/detail/checkpoint_commit.hpp"
#include "lockstep/train/detail/duty_pacer.hpp"
#include "lockstep/train/step_state.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// One trainer's background saves, one at a time. A save begins at a step boundary with a
/// snapshot of the replica's shard on the host (ckpt::snapshot_shard, taken by the caller);
/// this replica's writer thread encodes it, sums its CRC32C and writes it durably (no
/// collective). Each later step's row carries this replica's level (word(); the status
/// all_reduce hands every replica every row); when replica 0 reads a step whose rows say every
/// shard is durable, its writer writes the commit marker; when it reads one that says a shard
/// failed, it refuses the save. The save's end is the level in replica 0's row (committed or
/// refused), which every replica reads from the same step's rows: observe() reports it at the
/// same step everywhere. Only steps that return their result are observed (one that throws its
/// errors reads nothing: a later step reports the end). resolve() (collective) waits for the
/// writers and decides what the steps have not decided yet.
class background_save final : public status_rider {
public:
    /// save_word::state: a replica's shard, then replica 0's decisions (committing, committed,
    /// refused).
    static constexpr int none = 0, writing = 1, durable = 2, failed = 3, committing = 4,
                         committed = 5, refused = 6;

    /// The save of replica `rank` of `size`; `steps` (if any) tells the trainer's step count
    /// (what the destructor's warning names as the save's step).
    background_save(int rank, int size, std::function<std::int64_t()> steps = {})
        : rank_(rank), size_(size), steps_(std::move(steps)) {}
    background_save(const background_save&) = delete;
    background_save& operator=(const background_save&) = delete;
    /// Waits for the writer. A save still unresolved whose end no step reported and that did not
    /// commit here is lost without a word otherwise: a destructor cannot throw, so it prints one
    /// line to stderr naming the replica, the save's step and path, and the fix (finish() or
    /// wait_checkpoint() before the trainer goes); lost_unawaited() tells the same.
    ~background_save() {
        join();
        if (!lost_unawaited())
            return;
        const std::string line =
            "lockstep: replica " + std::to_string(rank_) + ": the background checkpoint save of " +
            "step " + std::to_string(begun_step_) + " to '" + path_.string() +
            "' was neither committed nor awaited when its trainer was destroyed: it is lost" +
            (rank_ == 0 ? "" : " unless replica 0 committed it") +
            " (the previous checkpoint at that path stands); call finish() or wait_checkpoint() "
            "before the trainer goes\n";
        std::fputs(line.c_str(), stderr);
    }

    /// True when a save is unresolved, no step reported its end and it did not commit on this
    /// replica (replica 0 commits): what the destructor warns about.
    /// requires: the writer is joined (after resolve(), or in the destructor).
    bool lost_unawaited() const noexcept {
        return unresolved_ && !seen_ && abandoned_ != committed &&
               outcome_.load(std::memory_order_acquire) != committed;
    }

    /// True from begin() to resolve(): the same on every replica (both are collective).
    bool unresolved() const noexcept { return unresolved_; }

    /// Where replica 0 registers the next save's generation as in flight in its process (until
    /// resolve()): ckpt::agree_save_id's argument.
    std::optional<ckpt::inflight_scope>& inflight() noexcept { return inflight_; }

    /// Begins the save `id` to `path`: this replica's writer thread calls `ready` (which returns
    /// once the snapshot's bytes are all there: ckpt::snapshot_staging's wait()), encodes
    /// `snapshot` and writes it as its shard (`hook`: save_options::on_stage, called on the
    /// writer thread). `problem`: the snapshot could not be taken (the save fails; no thread);
    /// a writer thread that cannot start fails the save too.
    /// requires: !unresolved().
    void begin(const std::filesystem::path& path, const ckpt::save_id& id,
               ckpt::file_builder snapshot, std::function<void()> ready, ckpt::stage_hook hook,
               double share, std::string problem) {
        join(); // resolve() joined it; a writer must never be replaced while it runs
        path_ = path;
        id_ = id;
        begun_step_ = steps_ ? steps_() : -1;
        shard_rank_ = rank_;
        abandoned_ = none;
        abandon_reason_.clear();
        reported_ = checkpoint_event::none;
        hook_ = std::move(hook);
        share_ = share;
        ++index_;
        unresolved_ = true;
        seen_ = false;
        outcome_.store(none);
        shard_error_.clear();
        marker_error_.clear();
        shard_record_ = {};
        if (!problem.empty()) {
            shard_error_ = std::move(problem);
            shard_.store(failed, std::memory_order_release);
            return;
        }
        shard_.store(writing, std::memory_order_release);
        // At a lower priority (comm_stream.hpp): the steps go first, the writer takes the rest.
        // A writer that cannot start fails the save (as its failure would).
        std::string not_started = ckpt::failure_of(
            [&] {
                writer_ = std::thread([this, s = std::move(snapshot), r = std::move(ready)] {
                    lower_thread_priority();
                    write_shard(s, r);
                });
            },
            "unknown exception while starting the writer thread");
        if (!not_started.empty()) {
            shard_error_ = "cannot start the writer thread: " + not_started;
            shard_.store(failed, std::memory_order_release);
        }
    }

    /// This replica's level for its row: replica 0's decision once taken, else its shard's.
    save_word word() const override {
        if (index_ == 0)
            return {};
        const int decided = outcome_.load(std::memory_order_acquire);
        const int st = decided != none ? decided : shard_.load(std::memory_order_acquire);
        save_word w{static_cast<double>(index_), static_cast<double>(st), 0, 0};
        if (shard_.load(std::memory_order_acquire) == durable) {
            w.crc = static_cast<double>(shard_record_.crc);
            w.bytes = static_cast<double>(shard_record_.bytes);
        }
        return w;
    }

    /// From a step's rows: replica 0 decides (commits in the background once every shard is
    /// durable, refuses once one failed); every replica reports the end replica 0's row shows.
    checkpoint_event observe(std::span<const replica_row> rows) override {
        if (!unresolved_ || seen_ || rows.empty())
            return checkpoint_event::none;
        if (abandoned_ != none) { // decided when the group shrank, the same on every survivor
            seen_ = true;
            reported_ =
                abandoned_ == committed ? checkpoint_event::committed : checkpoint_event::failed;
            return reported_;
        }
        const auto cur = static_cast<double>(index_);
        if (rank_ == 0 && outcome_.load() == none) {
            bool all_durable = true, any_failed = false;
            for (const replica_row& r : rows) {
                // A row of an earlier save (a CUDA graph replays the word it captured) is not
                // this save's yet.
                all_durable = all_durable && r.save.index == cur && r.save.state == durable;
                any_failed = any_failed || (r.save.index == cur && r.save.state == failed);
            }
            if (any_failed) {
                outcome_.store(refused);
            } else if (all_durable) {
                std::vector<ckpt::shard_record> shards;
                for (const replica_row& r : rows)
                    shards.push_back({static_cast<std::uint32_t>(r.save.crc),
                                      static_cast<std::uint64_t>(r.save.bytes)});
                join(); // the shard is durable: the writer is done
                outcome_.store(committing);
                // A writer that cannot start refuses the save (as the marker's failure would).
                // The started writer owns marker_error_: the failure is kept apart until known.
                const std::string not_started = ckpt::failure_of(
                    [&] {
                        writer_ = std::thread([this, s = std::move(shards)] {
                            lower_thread_priority();
                            write_marker(s);
                        });
                    },
                    "unknown exception while starting the writer thread");
                if (!not_started.empty()) {
                    marker_error_ = "cannot start the writer thread: " + not_started;
                    outcome_.store(refused);
                }
            }
        }
        const save_word& w0 = rows[0].save;
        if (w0.index != cur)
            return checkpoint_event::none;
        if (w0.state == committed || w0.state == refused) {
            seen_ = true;
            reported_ =
                w0.state == committed ? checkpoint_event::committed : checkpoint_event::failed;
            return reported_;
        }
        return checkpoint_event::none;
    }

    /// Collective, when unresolved() (else nothing): waits for this replica's writer, then
    /// decides what the steps did not: replica 0 commits when every shard is durable and it has
    /// not yet. ensures: !unresolved(). Returns committed, or failed when the save failed and
    /// every replica's step results already reported it and `always_throw` is false; else
    /// throws one lockstep::error (checkpoint) on every replica naming each replica's problem.
    template <class Comm>
    checkpoint_event resolve(Comm& comm, const char* op, bool always_throw) {
        if (!unresolved_)
            return checkpoint_event::none;
        join();
        unresolved_ = false;
        if (abandoned_ != none) { // decided when the group shrank (shrank()), on every survivor
            const bool was_committed = abandoned_ == committed;
            abandoned_ = none;
            inflight_.reset();
            if (was_committed)
                return checkpoint_event::committed;
            if (seen_ && !always_throw)
                return checkpoint_event::failed;
            ckpt::fail_agreed(comm, abandon_reason_, op,
                              "saving checkpoint '" + path_.string() +
                                  "' in the background failed:");
        }
        // Joined: the shard is durable or failed (begin() stores failed for a writer that
        // never started); anything else is a failure too, never a shard to commit.
        const int level = shard_.load();
        std::string problem = level == durable ? std::string()
                              : !shard_error_.empty()
                                  ? shard_error_
                                  : "the shard was never written (its writer did not run)";
        // Per replica: its shard's record, whether it is durable, whether a step showed the end.
        const std::array<int, 3> record = shard_record_.pack();
        const int mine[5] = {record[0], record[1], record[2], problem.empty() ? 1 : 0,
                             seen_ ? 1 : 0};
        std::vector<int> all(5 * static_cast<std::size_t>(comm.size()));
        // Tagged with the caller: a replica that skips it is named by the call it skipped.
        ckpt::tagged_all_gather(comm, std::span<const int>(mine), std::span<int>(all),
                                collective_tag(op));
        bool shards_ok = true, all_seen = true;
        std::vector<ckpt::shard_record> shards;
        for (std::size_t r = 0; r < all.size(); r += 5) {
            shards.push_back(ckpt::shard_record::unpack(&all[r]));
            shards_ok = shards_ok && all[r + 3] == 1;
            all_seen = all_seen && all[r + 4] == 1;
        }
        if (rank_ == 0) {
            if (outcome_.load() == none && shards_ok)
                write_marker(shards);
            if (problem.empty())
                problem = marker_error_; // a shard's failure is its replica's to name
        }
        const bool any_bad = ckpt::any_problem(comm, problem);
        inflight_.reset();
        if (!any_bad)
            return checkpoint_event::committed;
        if (all_seen && !always_throw)
            return checkpoint_event::failed;
        ckpt::fail_agreed(comm, problem, op,
                          "saving checkpoint '" + path_.string() + "' in the background failed:");
    }

    /// Collective over the survivors, after the group shrank (data_parallel's rebuild, with
    /// the shrunk communicator): an unresolved save is decided here, the same on every survivor,
    /// and the next step's result (or wait_checkpoint / finish) reports it as it reports any
    /// save's end. Committed when a step had reported it committed, when replica 0's marker
    /// writer committed it (joined here when it is running on a survivor) or when any survivor
    /// reads a commit marker naming its generation; otherwise failed ("abandoned: the group
    /// shrank (replica N lost) before it committed": the lost shard can never be written, and the
    /// previous checkpoint stands). A shard writer still running is not waited for here (the next
    /// save, a wait or the destructor joins it). When replica 0 was lost, its marker writer
    /// (never joined) could commit the save later, over the survivors' newer saves: unless a
    /// survivor saw it committed, they decide it under the commit lock (ckpt::commit_or_revoke,
    /// one more small all_gather): committed when its marker is there now, else revoked, so
    /// that the late commit is refused. ensures: rank and size are the communicator's.
    template <class Comm>
    void shrank(Comm& comm) {
        const int old_rank = rank_, old_size = size_;
        rank_ = comm.rank();
        size_ = comm.size();
        if (!unresolved_ || abandoned_ != none) // the same on every survivor
            return;
        bool committed_here = seen_ && reported_ == checkpoint_event::committed;
        if (!seen_) {
            if (outcome_.load() == committing)
                join(); // replica 0's marker writer: its result decides
            committed_here = outcome_.load() == committed ||
                             ckpt::committed_generation(path_) == std::optional(id_.gen);
        }
        const int mine[2] = {old_rank, committed_here ? 1 : 0};
        std::vector<int> all(2 * static_cast<std::size_t>(comm.size()));
        ckpt::tagged_all_gather(comm, std::span<const int>(mine), std::span<int>(all),
                                collective_tag("data_parallel.step"));
        bool any_committed = false;
        std::vector<int> present(static_cast<std::size_t>(std::max(old_size, 0)), 0);
        for (std::size_t i = 0; i < all.size(); i += 2) {
            any_committed = any_committed || all[i + 1] == 1;
            if (all[i] >= 0 && all[i] < old_size)
                present[static_cast<std::size_t>(all[i])] = 1;
        }
        // Replica 0 lost before any survivor saw the save commit (the same on every survivor:
        // from the all_gather): its marker writer may still be running, unjoined.
        if (!any_committed && !present.empty() && present[0] == 0) {
            const int now = ckpt::commit_or_revoke(path_, id_, old_size) ? 1 : 0;
            std::vector<int> every(static_cast<std::size_t>(comm.size()));
            ckpt::tagged_all_gather(comm, std::span<const int>(&now, 1), std::span<int>(every),
                                    collective_tag("data_parallel.step"));
            any_committed = std::any_of(every.begin(), every.end(), [](int c) { return c != 0; });
        }
        std::string lost;
        for (std::size_t r = 0; r < present.size(); ++r)
            if (present[r] == 0)
                lost += (lost.empty() ? "" : ", ") + std::to_string(r);
        if (lost.empty())
            lost = "none named";
        if (seen_) {
            abandoned_ = reported_ == checkpoint_event::committed ? committed : refused;
            abandon_reason_ = "it failed (a step's result reported it) and the group shrank since "
                              "(replica(s) " +
                              lost + " lost)";
        } else {
            abandoned_ = any_committed ? committed : refused;
            abandon_reason_ = "abandoned: the group shrank (replica(s) " + lost +
                              " lost) before it committed; the previous checkpoint at '" +
                              path_.string() + "' stands";
        }
    }

private:
    void join() {
        if (writer_.joinable())
            writer_.join();
    }

    /// The writer: the snapshot's bytes awaited, the shard written (ckpt::write_shard, paced),
    /// then its level.
    void write_shard(const ckpt::file_builder& snapshot, const std::function<void()>& ready) {
        const duty_pacer pace(share_);
        shard_error_ = ckpt::failure_of(
            [&] {
                ready();
                shard_record_ = ckpt::write_shard(snapshot, path_, id_, shard_rank_, hook_,
                                                  [&pace] { pace(); });
            },
            "unknown exception while writing the shard");
        shard_.store(shard_error_.empty() ? durable : failed, std::memory_order_release);
    }

    /// Replica 0: the commit marker (ckpt::commit_save), then the decision.
    void write_marker(const std::vector<ckpt::shard_record>& shards) {
        marker_error_ = ckpt::failure_of([&] { ckpt::commit_save(path_, id_, shards, hook_); },
                                         "unknown exception while writing the commit marker");
        outcome_.store(marker_error_.empty() ? committed : refused, std::memory_order_release);
    }

    int rank_;
    /// The save's shard index: rank_ at begin(), read by the writer (shrank() changes rank_).
    int shard_rank_ = 0;
    int size_;                            ///< the replicas (until the group shrinks)
    std::function<std::int64_t()> steps_; ///< the trainer's step count (may be empty)
    std::int64_t begun_step_ = -1;        ///< the step count when the save began
    int abandoned_ = none;                ///< committed or refused: decided by shrank()
    std::string abandon_reason_;          ///< why shrank() refused it
    checkpoint_event reported_ = checkpoint_event::none; ///< what observe() reported
    std::filesystem::path path_;
    ckpt::save_id id_;
    ckpt::stage_hook hook_;
    double share_ = 1;
    std::optional<ckpt::inflight_scope> inflight_;
    std::int64_t index_ = 0; ///< saves begun (save_word::index of the last)
    bool unresolved_ = false;
    bool seen_ = false; ///< observe() reported the save's end
    std::thread writer_;
    // Written by the writer thread before it publishes the level it stores (release).
    std::atomic<int> shard_{none};
    std::atomic<int> outcome_{none}; ///< replica 0's decision
    ckpt::shard_record shard_record_;
    std::string shard_error_, marker_error_;
};

} // namespace lockstep::detail

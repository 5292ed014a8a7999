// lockstep/train/async_checkpoint.hpp: save_checkpoint_async and wait_checkpoint, checkpoints
// of synchronous data_parallel trainers that do not stop training: a snapshot at a step
// boundary, a background writer per replica, the commit agreed through later steps' status.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/system.hpp"
#include "lockstep/train/checkpoint.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/detail/background_save.hpp"
#include "lockstep/train/detail/checkpoint_commit.hpp"
#include "lockstep/train/detail/checkpoint_state.hpp"
#include "lockstep/train/train_params.hpp"

#include <filesystem>
#include <string>
#include <type_traits>
#include <utility>

namespace lockstep {

/// Begins saving dp to the checkpoint `path` in the background (collective: every replica calls
/// it between the same two steps with the same path). Waits first for the previous background
/// save of dp if it is still unresolved (as wait_checkpoint, except that a failure every
/// replica's step results already reported is not thrown again): at most one is in flight.
/// Then the replicas agree on the save's generation (one small all_gather) and each takes a
/// snapshot of its shard (everything save_checkpoint writes) before it returns: the steps that
/// follow never change what is saved. On the host it is copied at once; on CUDA the copies run
/// on a side stream into page-locked host memory the trainer keeps for its saves (the shard's
/// bytes), after the work enqueued so far, and the trainer's stream waits for them before the
/// next step's kernels: the host does not wait (ckpt::snapshot_staging). Each replica's writer
/// thread then encodes the snapshot (CRC32C of every section and of the shard) and writes it
/// durably as save_checkpoint does, issuing no collective; each step's status carries every
/// replica's progress (step_result::checkpoint; a step that throws its errors reports and decides
/// nothing): the first step whose status shows every shard durable makes replica 0's writer write
/// the commit marker, and a later step reports `committed` on every replica at the same step
/// (`failed` when a shard or the marker could not be written: the previous checkpoint at `path`
/// stands, and its files are removed by the next commit). finish() and wait_checkpoint() resolve a
/// save the steps did not. The format, the file names and the crash safety are save_checkpoint's: a
/// crash at any point leaves the previous checkpoint loadable. Memory: the snapshot (the shard's
/// size) until the shard is written (on CUDA: the page-locked staging, kept for the next save), and
/// the encoded header. options.on_stage runs on the writer thread (replica 0's manifest stages too:
/// on the thread of the step that decides the commit only in wait/finish). requires: a synchronous
/// trainer (sync::synchronous; local SGD's rows are its own and the asynchronous trainers have no
/// step status: compile error); no step in flight; the stream is not being captured into a CUDA
/// graph (else errc::invalid_argument, nothing saved).
template <class Network, class Optimizer, class Sync, class Reduce, class Comm>
void save_checkpoint_async(data_parallel<Network, Optimizer, Sync, Reduce, Comm>& dp,
                           const std::filesystem::path& path, const save_options& options = {}) {
    static_assert(std::is_same_v<Sync, sync::synchronous>,
                  "save_checkpoint_async agrees on the commit through the synchronous step's "
                  "status: use save_checkpoint with local SGD and the asynchronous trainers");
    namespace ck = detail::ckpt;
    detail::checkpoint_access::check_use(dp, "save_checkpoint_async");
    auto& comm = detail::checkpoint_access::core(dp).comm();
    LOCKSTEP_REQUIRE(!detail::capturing(comm.system()), errc::invalid_argument, comm.rank(),
                     "save_checkpoint_async",
                     "the stream is being captured into a CUDA graph: save between launches");
    LOCKSTEP_REQUIRE(options.background_share > 0 && options.background_share <= 1,
                     errc::invalid_argument, comm.rank(), "save_checkpoint_async",
                     "save_options::background_share = ", options.background_share,
                     " (must be in (0, 1]; 1: the writer never pauses)");
    auto& background = detail::checkpoint_access::background(dp);
    (void)background.resolve(comm, "save_checkpoint_async", false);
    const ck::save_id id =
        ck::agree_save_id(comm, background.inflight(), path, "save_checkpoint_async");
    ck::file_builder snapshot;
    auto& staging = detail::checkpoint_access::staging(dp);
    // A snapshot that fails fails the save on every replica, through the steps' status.
    std::string problem = ck::failure_of([&] { snapshot = ck::snapshot_shard(dp, staging); },
                                         "unknown exception while taking the snapshot");
    background.begin(
        path, id, std::move(snapshot), [&staging] { staging.wait(); }, options.on_stage,
        options.background_share, std::move(problem));
}

/// Waits for dp's background save (collective): each replica's writer finishes, replica 0
/// commits if every shard is durable and the steps had not yet decided. Returns
/// checkpoint_event::committed, or checkpoint_event::none when no save was begun since the last
/// wait. ensures: no save in flight. Throws one lockstep::error (checkpoint) on every replica
/// when the save failed, naming each replica's problem (even when step results reported it).
template <class Network, class Optimizer, class Sync, class Reduce, class Comm>
checkpoint_event wait_checkpoint(data_parallel<Network, Optimizer, Sync, Reduce, Comm>& dp) {
    static_assert(std::is_same_v<Sync, sync::synchronous>,
                  "wait_checkpoint waits for save_checkpoint_async (synchronous trainers)");
    detail::checkpoint_access::check_use(dp, "wait_checkpoint");
    auto& comm = detail::checkpoint_access::core(dp).comm();
    return detail::checkpoint_access::background(dp).resolve(comm, "wait_checkpoint", true);
}

} // namespace lockstep

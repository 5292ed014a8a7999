// lockstep/train/checkpoint.hpp: save_checkpoint / load_checkpoint for data_parallel (every
// SyncPolicy and ReducePolicy): one shard file per replica plus a commit marker.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/detail/checkpoint_cleanup.hpp"
#include "lockstep/train/detail/checkpoint_commit.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_marker.hpp"
#include "lockstep/train/detail/checkpoint_resize.hpp"
#include "lockstep/train/detail/checkpoint_state.hpp"
#include "lockstep/train/detail/durable_file.hpp"
#include "lockstep/train/detail/host_collective.hpp"

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep {

/// Options of save_checkpoint.
struct save_options {
    /// Fault injection: called on each replica at each stage of its save ("shard.partial",
    /// "shard.written", "shard.renamed", "manifest.partial", "manifest.written",
    /// "manifest.renamed", "cleanup.done"; the last four on replica 0 only) with the stage's name
    /// and the replica; a hook that throws simulates a crash at that point (the save then fails
    /// as a crash there would). Empty (the default): none. Each call's own: two trainers saving
    /// in one process never see each other's hook.
    std::function<void(std::string_view stage, int replica)> on_stage;
    /// save_checkpoint_async only: the share of its time each background writer works; it
    /// sleeps the rest, between slices of 4 MiB (summed or written), so that the steps running
    /// beside it keep more of the memory bandwidth (bench_checkpoint measures it). 1: no pause.
    /// requires: 0 < background_share <= 1.
    double background_share = 0.5;
};

/// Saves everything the next steps of dp depend on to the checkpoint `path` (collective: every
/// replica calls it with the same path, on a file system every replica sees). Each replica
/// writes its shard `<path>.<generation>.<pid>.<token>.shard<rank>`, names unique to this save
/// (temporary name, fsync, rename, directory fsync); after all shards are durable, replica 0
/// writes the commit marker `path` (the manifest with every shard's size and CRC32C) the same
/// way, then removes the files no save can need (ckpt::remove_stale). The format is described
/// in docs/checkpoints.md.
/// ensures: on success `path` loads into a compatible trainer; a failure or crash before the
/// marker's rename leaves the previous checkpoint at `path` loadable, one after it the new one
/// (its error says so), and a failure on any replica throws one lockstep::error (checkpoint) on
/// every replica. Jobs saving to the same path concurrently
/// leave a checkpoint that loads as one of their saves.
/// A background save of dp still unresolved (save_checkpoint_async) is waited for first, and
/// its failure thrown unless every replica's step results reported it. With sync::local_sgd<K>
/// the replicas' global_batch and lr of the steps since the last average are compared first,
/// as the average compares them: a difference throws lockstep::error on every replica (the
/// average's message), nothing written. A learning-rate schedule that throws at steps() fails
/// the save, naming the step (later steps it does not define are recorded as undefined).
/// requires: no step in flight on this replica (call it between steps, or from a synchronous
/// trainer's step function, where it saves the state the step started from; with
/// sync::asynchronous and sync::bounded_staleness<S>, between train() calls, when every replica
/// holds the server's parameters and state: from on_apply it throws errc::invalid_argument).
template <class Network, class Optimizer, class Sync, class Reduce, class Comm>
void save_checkpoint(data_parallel<Network, Optimizer, Sync, Reduce, Comm>& dp,
                     const std::filesystem::path& path, const save_options& options = {}) {
    namespace ck = detail::ckpt;
    if constexpr (is_asynchronous_v<Sync>)
        detail::checkpoint_access::check_between(
            dp, "save_checkpoint",
            "the workers are computing gradients, not saving, and the server's state is "
            "mid-train()");
    else
        detail::checkpoint_access::check_use(dp, "save_checkpoint");
    auto& core = detail::checkpoint_access::core(dp);
    auto& comm = core.comm();
    const int rank = comm.rank();
    const int size = comm.size();
    const std::string what = "saving checkpoint '" + path.string() + "' failed:";
    // A background save still in flight commits (or fails) first: it never replaces this one.
    detail::checkpoint_access::resolve_background(dp, comm, "save_checkpoint");
    // Local SGD's steps since the last average are checked now: a resumed run cannot.
    detail::checkpoint_access::verify_before_save(dp);

    // One fresh generation for this save, in flight in replica 0's process until it returns.
    std::optional<ck::inflight_scope> inflight;
    // The same all_gather compares the paths: replicas writing to different places would
    // commit a checkpoint that can never load.
    const ck::save_id id = ck::agree_save_id(comm, inflight, path, "save_checkpoint");

    ck::shard_record mine;
    std::string problem = ck::failure_of(
        [&] {
            ck::immediate_snapshot now;
            mine = ck::write_shard(ck::snapshot_shard(dp, now), path, id, rank, options.on_stage);
        },
        "unknown exception while writing the shard");
    const std::array<int, 3> info = mine.pack();
    std::vector<int> infos(3 * static_cast<std::size_t>(size));
    detail::host_all_gather(comm, std::span<const int>(info), std::span<int>(infos));
    ck::agree_or_fail(comm, problem, "save_checkpoint", what);

    // From here replica 0 may commit; open until every replica has the agreement on it (a shrink
    // without replica 0 settles it: unsettled_commit).
    detail::checkpoint_access::unsettled(dp, [&](auto& u) { u.open(path, id, size); });
    if (rank == 0) {
        std::vector<ck::shard_record> shards;
        for (std::size_t r = 0; r < infos.size(); r += 3)
            shards.push_back(ck::shard_record::unpack(&infos[r]));
        problem = ck::failure_of([&] { ck::commit_save(path, id, shards, options.on_stage); },
                                 "unknown exception while writing the commit marker");
    }
    // Once this agreement returns, replica 0 has left its commit: settled, failed or not.
    const bool failed = ck::any_problem(comm, problem);
    detail::checkpoint_access::unsettled(dp, [](auto& u) { u.close(); });
    if (failed)
        ck::fail_agreed(comm, problem, "save_checkpoint", what);
}

/// Restores dp from the checkpoint `path` written by save_checkpoint (collective), saved by the
/// same or another number of replicas. Every replica first reads the commit marker and the
/// shard it restores from and checks them: the shard's name (a plain file name of the form saves
/// write, in the marker's directory, no symbolic link) and recorded size against the file before
/// reading it, the marker and every section's CRC32C, and compatibility with dp (world size,
/// rank, element type, optimizer type and hyperparameters, learning rate at the resume step and
/// after, the frozen tensors, sync, reduce and BN policies, every section's presence, element type
/// and shape, no extra section, the counters' ranges), and that the marker still names the save
/// every replica read first (a save that commits meanwhile is refused, naming both generations).
/// When any replica finds a difference, every replica throws ONE lockstep::error (checkpoint)
/// listing them all and dp is unchanged. Otherwise dp gets the parameters (also in the network's
/// own buffers with the visitor), registry and visited state (BN running statistics), optimizer
/// buffers and step count, steps(), the sample offset, local SGD's steps since the last average and
/// the RNG seed: the steps that follow are bitwise those of the run that saved (synchronous and
/// local SGD; the asynchronous trainers continue from the same state, in an order the arrival of
/// gradients decides, as without a checkpoint). At another replica count (every trainer but local
/// SGD, which refuses it on every replica, naming both counts) every replica restores from the
/// shard of replica 0 (the asynchronous trainers' server, reduce::parameter_server<Root>'s Root:
/// the replica with the optimizer state), BN running statistics included; with reduce::sharded each
/// replica's new shard of the optimizer state is regathered from the old shards that overlap it
/// (their headers and optimizer sections only). See docs/checkpoints.md. A background save of dp
/// still unresolved is waited for first, as by save_checkpoint. requires: no step in flight on this
/// replica (asynchronous: between train() calls); inside a training call (the step function, the
/// gradient hook, on_apply) it throws errc::invalid_argument.
template <class Network, class Optimizer, class Sync, class Reduce, class Comm>
void load_checkpoint(data_parallel<Network, Optimizer, Sync, Reduce, Comm>& dp,
                     const std::filesystem::path& path) {
    namespace ck = detail::ckpt;
    using T = typename Optimizer::value_type;
    detail::checkpoint_access::check_between(
        dp, "load_checkpoint",
        "the call in progress would go on with gradients and state of the weights it replaced");
    auto& comm = detail::checkpoint_access::core(dp).comm();
    const std::string what = "checkpoint '" + path.string() + "' refused:";
    detail::checkpoint_access::resolve_background(dp, comm, "load_checkpoint");
    // Every replica must take the same path below: they compare the save they read.
    const auto saved = ck::read_committed_save(path, comm.rank());
    const ck::committed_save mine = saved.value_or(ck::committed_save{});
    const std::array<int, 2> hash = ck::path_hash(path);
    const int row[5] = {mine.world_size, static_cast<int>(static_cast<std::uint32_t>(mine.gen)),
                        static_cast<int>(static_cast<std::uint32_t>(mine.gen >> 32)), hash[0],
                        hash[1]};
    std::vector<int> rows(5 * static_cast<std::size_t>(comm.size()));
    // Tagged: a replica that does not call load_checkpoint is named by it in the mismatch.
    ck::tagged_all_gather(comm, std::span<const int>(row), std::span<int>(rows),
                          collective_tag("load_checkpoint"));
    if (!ck::same_path_hash(rows, 5, 3))
        ck::fail_different_paths(comm, path, "load_checkpoint");
    bool same = true;
    for (std::size_t i = 0; i < rows.size(); i += 5)
        same = same && rows[i] == row[0] && rows[i + 1] == row[1] && rows[i + 2] == row[2];
    if (!same) { // seen by every replica: each compares every row with its own
        std::string read;
        for (std::size_t i = 0; i < rows.size(); i += 5) {
            const std::uint64_t gen = std::uint64_t(static_cast<std::uint32_t>(rows[i + 1])) |
                                      std::uint64_t(static_cast<std::uint32_t>(rows[i + 2])) << 32;
            read += (read.empty() ? "" : ", ") + std::string("replica ") + std::to_string(i / 5) +
                    ": " +
                    (rows[i] == 0 && gen == 0 ? std::string("no readable marker")
                                              : "generation " + ck::hex16(gen) + " of " +
                                                    std::to_string(rows[i]) + " replica(s)");
        }
        ck::agree_or_fail(comm,
                          "the replicas read different commit markers (" + read +
                              "): a save committed meanwhile, or the replicas do not share one "
                              "file system (every replica must pass the same path, on a file "
                              "system all of them share)",
                          "load_checkpoint", what);
    }

    ck::loaded_shard shard;
    std::vector<std::vector<T>> slots;
    const bool resized = saved && saved->world_size != comm.size();
    std::string problem;
    try {
        const std::vector<std::string> problems =
            resized
                ? ck::validate_resized(dp, path, saved->world_size, saved->gen, shard, slots)
                : ck::validate(dp, path, saved ? std::optional(saved->gen) : std::nullopt, shard);
        for (const std::string& p : problems) {
            if (!problem.empty())
                problem += "; ";
            problem += p;
        }
    } catch (const std::exception& e) {
        problem = e.what();
    }
    ck::agree_or_fail(comm, problem, "load_checkpoint", what);
    constexpr bool sharded = Reduce::shards_optimizer_state;
    ck::restore(dp, shard, resized && sharded ? &slots : nullptr);
}

} // namespace lockstep

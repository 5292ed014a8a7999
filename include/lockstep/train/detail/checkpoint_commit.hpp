// lockstep/train/detail/checkpoint_commit.hpp: what every save does around writing the shards,
// blocking or in the background: the replicas agree on the save's generation, agree on failure,
// and replica 0 writes the commit marker naming every shard's size and CRC32C.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/core/detail/fnv1a.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/checkpoint_cleanup.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_marker.hpp"
#include "lockstep/train/detail/durable_file.hpp"
#include "lockstep/train/detail/host_collective.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

namespace lockstep::detail::ckpt {

/// Every replica's string (collective: two all_gathers).
template <class Comm>
std::vector<std::string> gather_strings(Comm& comm, const std::string& s) {
    const int ranks = comm.size();
    const int len = static_cast<int>(s.size());
    std::vector<int> lens(static_cast<std::size_t>(ranks));
    host_all_gather(comm, std::span<const int>(&len, 1), std::span<int>(lens));
    int longest = 0;
    for (int l : lens)
        longest = std::max(longest, l);
    const std::size_t words = (static_cast<std::size_t>(longest) + 3) / 4;
    std::vector<int> packed(words == 0 ? 1 : words, 0);
    std::memcpy(packed.data(), s.data(), s.size());
    std::vector<int> all(packed.size() * static_cast<std::size_t>(ranks));
    host_all_gather(comm, std::span<const int>(packed), std::span<int>(all));
    std::vector<std::string> out(static_cast<std::size_t>(ranks));
    for (std::size_t r = 0; r < out.size(); ++r) {
        out[r].resize(static_cast<std::size_t>(lens[r]));
        std::memcpy(out[r].data(), all.data() + r * packed.size(), out[r].size());
    }
    return out;
}

/// Collective (one all_gather of one int): whether any replica reports a problem (non-empty);
/// the same answer on every replica.
template <class Comm>
bool any_problem(Comm& comm, const std::string& problem) {
    const int mine = problem.empty() ? 0 : 1;
    std::vector<int> flags(static_cast<std::size_t>(comm.size()));
    host_all_gather(comm, std::span<const int>(&mine, 1), std::span<int>(flags));
    return std::any_of(flags.begin(), flags.end(), [](int f) { return f != 0; });
}

/// Collective, once any_problem() said true: every replica throws ONE lockstep::error
/// (checkpoint) listing every replica's problems.
template <class Comm>
[[noreturn]] void fail_agreed(Comm& comm, const std::string& problem, const char* op,
                              const std::string& what) {
    const std::vector<std::string> all = gather_strings(comm, problem);
    bool same = true;
    for (const auto& p : all)
        same = same && p == all[0];
    std::string msg = what;
    if (same && all.size() > 1)
        msg += " every replica: " + all[0];
    for (std::size_t r = 0; r < all.size() && !(same && all.size() > 1); ++r)
        if (!all[r].empty())
            msg += " replica " + std::to_string(r) + ": " + all[r];
    fail(errc::checkpoint, comm.rank(), op, msg);
}

/// Collective: when any replica reports a problem (non-empty), every replica throws ONE
/// lockstep::error (checkpoint) listing every replica's problems.
template <class Comm>
void agree_or_fail(Comm& comm, const std::string& problem, const char* op,
                   const std::string& what) {
    if (any_problem(comm, problem))
        fail_agreed(comm, problem, op, what);
}

/// host_all_gather tagged `tag` where the communicator takes a collective_tag (the thread
/// group's and MPI's), so that a replica that skips the checkpoint call is named by it in the
/// mismatch message ("tag 'save_checkpoint'"); untagged elsewhere (NCCL). Collective.
template <class Comm, class T>
void tagged_all_gather(Comm& comm, std::span<const T> send, std::span<T> recv,
                       const collective_tag& tag) {
    if constexpr (Comm::system_type::is_host && requires { comm.all_gather(send, recv, tag); })
        comm.all_gather(send, recv, tag);
    else
        host_all_gather(comm, send, recv);
}

/// A 64-bit FNV-1a hash of the path as the caller gave it (not canonicalised: an absolute path
/// may legitimately be spelt differently on another node's mounts), as two ints.
inline std::array<int, 2> path_hash(const std::filesystem::path& path) {
    const std::uint64_t h = fnv1a(path.string());
    return {static_cast<int>(static_cast<std::uint32_t>(h)),
            static_cast<int>(static_cast<std::uint32_t>(h >> 32))};
}

/// Once an all_gather of every replica's path_hash showed that they differ (the same answer on
/// every replica): every replica throws ONE lockstep::error (invalid_argument, operation `op`)
/// naming which replicas passed which path (collective: gather_strings).
template <class Comm>
[[noreturn]] void fail_different_paths(Comm& comm, const std::filesystem::path& path,
                                       const char* op) {
    const std::vector<std::string> paths = gather_strings(comm, path.string());
    std::vector<std::pair<std::string, std::string>> groups; // path, its replicas
    for (std::size_t r = 0; r < paths.size(); ++r) {
        auto g = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& p) { return p.first == paths[r]; });
        if (g == groups.end())
            g = groups.insert(groups.end(), {paths[r], std::string()});
        g->second += (g->second.empty() ? "" : ", ") + std::to_string(r);
    }
    std::string which;
    for (const auto& [p, replicas] : groups)
        which.append(which.empty() ? "" : "; ")
            .append("replica(s) ")
            .append(replicas)
            .append(" passed '")
            .append(p)
            .append("'");
    fail(errc::invalid_argument, comm.rank(), op, "the replicas passed different paths: ", which,
         ": every replica must pass the same path, on a file system all of them share (a "
         "relative path is compared as given: it must also name the same place in every "
         "replica's working directory)");
}

/// Whether the path_hash values at `at` of each `stride` ints of `all` are all the same.
inline bool same_path_hash(std::span<const int> all, std::size_t stride, std::size_t at) {
    for (std::size_t i = 0; i < all.size(); i += stride)
        if (all[i + at] != all[at] || all[i + at + 1] != all[at + 1])
            return false;
    return true;
}

/// One fresh save id (collective: one all_gather, tagged `op`: "save_checkpoint" or
/// "save_checkpoint_async"), drawn by replica 0; `inflight` is registered in replica 0's
/// process (clean-up leaves the save's files alone) before any replica learns it. The same
/// all_gather compares every replica's path (its path_hash): when they differ every replica
/// throws lockstep::error (invalid_argument) naming which replicas passed which path, before
/// anything is written.
template <class Comm>
save_id agree_save_id(Comm& comm, std::optional<inflight_scope>& inflight,
                      const std::filesystem::path& path, const char* op) {
    save_id id;
    const int rank = comm.rank();
    if (rank == 0) {
        std::random_device rd;
        id.gen =
            (std::uint64_t(rd()) << 32) ^ rd() ^
            static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
        id.owner = this_process();
    }
    inflight.emplace(id.gen, rank == 0);
    const std::array<int, 2> hash = path_hash(path);
    const int mine[6] = {static_cast<int>(static_cast<std::uint32_t>(id.gen)),
                         static_cast<int>(static_cast<std::uint32_t>(id.gen >> 32)),
                         static_cast<int>(id.owner.pid),
                         static_cast<int>(id.owner.token),
                         hash[0],
                         hash[1]};
    std::vector<int> ids(6 * static_cast<std::size_t>(comm.size()));
    tagged_all_gather(comm, std::span<const int>(mine), std::span<int>(ids), collective_tag(op));
    if (!same_path_hash(ids, 6, 4))
        fail_different_paths(comm, path, op);
    id.gen = std::uint64_t(static_cast<std::uint32_t>(ids[0])) |
             std::uint64_t(static_cast<std::uint32_t>(ids[1])) << 32;
    id.owner = {static_cast<std::uint32_t>(ids[2]), static_cast<std::uint32_t>(ids[3])};
    return id;
}

/// What the commit marker records of one replica's shard.
struct shard_record {
    std::uint32_t crc = 0;
    std::uint64_t bytes = 0;
    /// As three ints for a host all_gather: the CRC, the size's low and high halves.
    std::array<int, 3> pack() const noexcept {
        return {static_cast<int>(crc), static_cast<int>(static_cast<std::uint32_t>(bytes)),
                static_cast<int>(static_cast<std::uint32_t>(bytes >> 32))};
    }
    /// The record pack() wrote at v[0..3).
    static shard_record unpack(const int* v) noexcept {
        return {static_cast<std::uint32_t>(v[0]),
                std::uint64_t(static_cast<std::uint32_t>(v[1])) |
                    std::uint64_t(static_cast<std::uint32_t>(v[2])) << 32};
    }
};

/// What f() throws, as text for agree_or_fail ("" when it returns; `unknown` for an exception
/// that is not a std::exception).
template <class F>
std::string failure_of(F&& f, const char* unknown) {
    try {
        std::forward<F>(f)();
        return {};
    } catch (const std::exception& e) {
        return e.what();
    } catch (...) {
        return unknown;
    }
}

/// Writes the shard `snapshot` of replica `rank` of the save id next to `path` durably, from
/// the snapshot's own payloads (file_builder::encode: no copy of the file, each payload read
/// once for its CRC32C); `pace` (if any) between slices. Returns what the marker records of it.
/// No collective: a background writer calls it too.
inline shard_record write_shard(const file_builder& snapshot, const std::filesystem::path& path,
                                const save_id& id, int rank, const stage_hook& hook,
                                const std::function<void()>& pace = {}) {
    std::vector<std::byte> header;
    const file_builder::encoded_file file = snapshot.encode(shard_magic, header, pace);
    write_durably(shard_path(path, id, rank), shard_temp_path(path, id, rank),
                  std::span<const std::span<const std::byte>>(file.pieces), rank, "shard", hook,
                  pace);
    return {file.crc, file.size};
}

/// Serialises, for its lifetime, the commits (commit_save) and revocations (commit_or_revoke) of
/// the saves next to the marker `path`: this process's threads with one mutex, other processes
/// with an exclusive flock(2) of the marker's directory (unlocked explicitly at the end, so a
/// child forked meanwhile does not keep it; where the file system refuses flock on a directory,
/// only this process's threads are serialised). The waits have no deadline: a holder stalled in
/// the file system stalls the next commit or revocation with it.
class commit_lock {
public:
    explicit commit_lock(const std::filesystem::path& path) : hold_(mutex()) {
        std::filesystem::path dir = path.parent_path();
        if (dir.empty())
            dir = ".";
        dir_.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        while (dir_.fd >= 0 && ::flock(dir_.fd, LOCK_EX) != 0 && errno == EINTR) {
        }
    }
    commit_lock(const commit_lock&) = delete;
    commit_lock& operator=(const commit_lock&) = delete;
    ~commit_lock() {
        if (dir_.fd >= 0)
            ::flock(dir_.fd, LOCK_UN);
    }

private:
    static std::mutex& mutex() {
        static std::mutex m;
        return m;
    }
    std::unique_lock<std::mutex> hold_; ///< taken first, released last
    fd_guard dir_;
};

/// The survivors of a shrink that lost replica 0 before the save `id` (of `world_size` shards)
/// ended: that replica's marker writer is never joined and may still commit it, after they
/// reported it failed and after their own later saves to `path` (it would replace the newer
/// marker and remove its shards as the generation it replaced). Decides it once for all, under
/// the commit lock: true when the marker names it (that writer committed first); otherwise
/// removes its shards, so that its commit, if still to come, finds them missing and refuses
/// (the marker and the files of the saves that follow stand), and returns false.
inline bool commit_or_revoke(const std::filesystem::path& path, const save_id& id, int world_size) {
    const commit_lock lock(path);
    if (committed_generation(path) == std::optional(id.gen))
        return true;
    std::error_code ec;
    for (int r = 0; r < world_size; ++r)
        std::filesystem::remove(shard_path(path, id, r), ec);
    return false;
}

/// Replica 0, once every shard of the save id is durable: writes the commit marker `path` (the
/// manifest naming each shard, its size and CRC32C) durably, then removes the files no save can
/// need (remove_stale) and runs the hook's "cleanup.done". No collective: a background writer
/// calls it too. Throws lockstep::error (checkpoint) when the marker cannot be written, or when
/// a shard it would name is not at its place next to `path` with its recorded size as replica 0
/// sees it (the replicas wrote to different paths, or to a file system replica 0 does not
/// share: such a marker could never load; or the survivors of a shrink revoked the save:
/// commit_or_revoke); the previous marker then stands. The shards' check, the marker's rename
/// and the clean-up run under the commit lock.
inline void commit_save(const std::filesystem::path& path, const save_id& id,
                        std::span<const shard_record> shards, const stage_hook& hook) {
    const auto check_shards = [&] {
        std::string missing;
        for (std::size_t r = 0; r < shards.size(); ++r) {
            const std::filesystem::path shard = shard_path(path, id, static_cast<int>(r));
            std::error_code ec;
            const std::uintmax_t bytes = std::filesystem::file_size(shard, ec);
            if (!ec && bytes == shards[r].bytes)
                continue;
            missing += (missing.empty() ? "" : "; ") + std::string("the shard of replica ") +
                       std::to_string(r) + " '" + shard.string() + "' " +
                       (ec ? "is not there (" + ec.message() + ")"
                           : "has " + std::to_string(bytes) + " bytes, not the " +
                                 std::to_string(shards[r].bytes) + " its replica wrote");
        }
        LOCKSTEP_REQUIRE(missing.empty(), errc::checkpoint, 0, "save_checkpoint",
                         "not committed: replica 0 does not see every shard: ", missing,
                         ": every replica must pass the same path, on a file system all of them "
                         "share (the previous checkpoint at '",
                         path.string(), "' stands)");
    };
    check_shards(); // before the marker is written: the common failure leaves no temporary
    file_builder m;
    m.meta("generation", hex16(id.gen));
    m.meta("world_size", std::to_string(shards.size()));
    for (std::size_t r = 0; r < shards.size(); ++r) {
        const std::string key = "shard." + std::to_string(r);
        m.meta(key + ".file", shard_path(path, id, static_cast<int>(r)).filename().string());
        m.meta(key + ".size", std::to_string(shards[r].bytes));
        m.meta(key + ".crc32c", std::to_string(shards[r].crc));
    }
    const std::filesystem::path tmp = marker_temp_path(path, id);
    const std::vector<std::byte> marker = m.finish(manifest_magic);
    const std::span<const std::byte> pieces[1] = {marker};
    write_temp_durably(tmp, std::span<const std::span<const std::byte>>(pieces), 0, "manifest",
                       hook);
    // From here to the clean-up no other commit or revocation of a save of `path` runs: a save
    // revoked by the survivors of a shrink is found without its shards and never replaces the
    // marker of a save that followed it.
    const commit_lock lock(path);
    try {
        check_shards();
    } catch (...) {
        std::error_code ec;
        std::filesystem::remove(tmp, ec);
        throw;
    }
    // The generation this commit replaces: no save commits it again.
    const auto replaced = committed_generation(path);
    try {
        rename_durably(tmp, path, 0, "manifest", hook);
        remove_stale(path, id, replaced);
        stage(hook, "cleanup.done", 0);
    } catch (const std::exception& e) {
        // A failure after the marker's rename (the directory's fsync, the clean-up) comes after
        // the commit point: the save is the checkpoint now, and the report must not say that
        // the previous one stands.
        if (committed_generation(path) != std::optional(id.gen))
            throw;
        fail(errc::checkpoint, 0, "save_checkpoint", "the commit marker was renamed into place ",
             "before this failure, so '", path.string(), "' loads this save (generation ",
             hex16(id.gen), "), which may not be durable yet: ", e.what());
    }
}

} // namespace lockstep::detail::ckpt

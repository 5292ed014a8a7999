// lockstep/train/detail/checkpoint_resize.hpp: which shard a replica reads and checks on a load
// (at another replica count, or with another server), and reduce::sharded's regathering.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_marker.hpp"
#include "lockstep/train/detail/checkpoint_parser.hpp"
#include "lockstep/train/detail/checkpoint_state.hpp"
#include "lockstep/train/detail/durable_file.hpp"
#include "lockstep/train/detail/optimizer_shard.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace lockstep::detail::ckpt {

/// What a commit marker records of its save: the replica count and the generation.
struct committed_save {
    int world_size = 0;
    std::uint64_t gen = 0;
};

/// The save the commit marker `path` names, when it parses and records a positive world size
/// and a generation (nothing otherwise: the load then reports what is wrong).
inline std::optional<committed_save> read_committed_save(const std::filesystem::path& path,
                                                         int rank) {
    try {
        const std::vector<std::byte> bytes = read_file(path, rank);
        const parsed_header m = parse_header(bytes, manifest_magic, "commit marker", rank);
        const auto ws = m.find_meta("world_size");
        const auto gen = m.find_meta("generation");
        const auto n = ws ? parse_decimal(*ws) : std::nullopt;
        const auto g = gen ? name_detail::number(*gen, 16, 16) : std::nullopt;
        if (!n || *n == 0 || *n > 0x7FFFFFFFu || !g)
            return std::nullopt;
        return committed_save{static_cast<int>(*n), *g};
    } catch (const std::exception&) {
        return std::nullopt;
    }
}

/// Why a trainer of type DP does not load a checkpoint saved by `saved` replicas into
/// `replicas` replicas (empty: it does).
template <class DP>
std::string resize_refusal(int saved, int replicas) {
    using sync_type = typename DP::sync_policy_type;
    if constexpr (is_local_sgd_v<sync_type>)
        return concat("saved by ", saved, " replicas, loaded by ", replicas, ": ",
                      sync_type::name(),
                      " keeps each replica's own parameters and optimizer state between averages, "
                      "which no other replica count can take over; resume with ",
                      saved, " replicas");
    else
        return {};
}

/// Replica q's shard as a commit marker records it, opened, with its header alone read.
struct shard_head {
    recorded_shard rs;
    fd_guard f;
    std::vector<std::byte> bytes; ///< the header's bytes (parse_header_prefix with rs.size)
};

/// Opens replica q's shard recorded in the commit marker m (read from `path`) and reads its
/// header into out.bytes, its length bounded by the file's size before anything is allocated.
/// Returns the problem, if any.
inline std::string read_shard_head(const parsed_header& m, const std::filesystem::path& path, int q,
                                   shard_head& out) {
    if (std::string p = recorded_shard_of(m, path, q, out.rs); !p.empty())
        return p;
    if (std::string p = open_recorded_file(out.rs.file, out.rs.size, out.f); !p.empty())
        return p;
    out.bytes.assign(
        static_cast<std::size_t>(std::min<std::uint64_t>(out.rs.size, min_header_bytes)),
        std::byte{0});
    if (std::string p = read_at(out.f, out.rs.file, 0, out.bytes); !p.empty())
        return p;
    if (out.bytes.size() == min_header_bytes) {
        const std::uint64_t length = get_u64(out.bytes.data() + 16);
        if (length > out.bytes.size() && length <= out.rs.size) {
            out.bytes.resize(static_cast<std::size_t>(length));
            if (std::string p = read_at(out.f, out.rs.file, 0, out.bytes); !p.empty())
                return p;
        }
    }
    return {};
}

/// The server an asynchronous trainer's checkpoint records, from the header of one of its
/// shards (`what`): its "async.root", a replica of the `saved` that wrote it, into `root`.
/// Returns the problem, if any.
inline std::string recorded_async_root(const parsed_header& shard, const std::string& what,
                                       int saved, int& root) {
    const auto r = shard.find_meta("async.root");
    const auto v = r ? parse_decimal(*r) : std::nullopt;
    if (!v || *v >= static_cast<std::uint64_t>(saved))
        return concat(what, ": async.root ", r ? quote_value(*r) : std::string("missing"),
                      " is not a replica of the ", saved, " that saved it");
    root = static_cast<int>(*v);
    return {};
}

/// The old replica whose shard every replica reads at another replica count: the one that
/// holds the optimizer state (the server of the asynchronous trainers: `async_root`, the one
/// the checkpoint records, 0 when it records none; the root of
/// reduce::parameter_server<Root>; replica 0 otherwise).
template <class DP>
int source_replica(int async_root) {
    using reduce_type = typename DP::reduce_policy_type;
    if constexpr (is_asynchronous_v<typename DP::sync_policy_type>)
        return async_root >= 0 ? async_root : 0;
    else if constexpr (reduce_type::update_root >= 0)
        return reduce_type::update_root;
    else
        return 0;
}

/// Reads the whole shard of replica `src` of the `saved` replicas the commit marker m (read
/// from `path`) records into out, checks it against its record (size, CRC32C) and its own
/// record of its writer, and compares it with dp's trainer as that replica (check_shard; the
/// asynchronous trainers: with the server `async_root`, -1: the one the shard records).
/// Returns every problem found.
template <class DP>
std::vector<std::string> read_source_shard(DP& dp, const parsed_header& m,
                                           const std::filesystem::path& path, int saved, int src,
                                           int async_root, loaded_shard& out) {
    const int rank = checkpoint_access::core(dp).comm().rank();
    recorded_shard rs;
    if (std::string p = recorded_shard_of(m, path, src, rs); !p.empty())
        return {p};
    if (std::string p = read_recorded_shard(rs, out.bytes); !p.empty())
        return {p};
    // The shard's own record of its world, before the comparison with the trainer (whose
    // "trainer" side would be the marker's count here).
    if (const parsed_header h = parse_header(out.bytes, shard_magic, rs.file.string(), rank);
        h.find_meta("world_size") != std::to_string(saved) ||
        h.find_meta("rank") != std::to_string(src))
        return {concat("shard '", rs.file.string(), "' was written by replica ",
                       h.find_meta("rank").value_or("(missing)"), " of ",
                       h.find_meta("world_size").value_or("(missing)"),
                       ", the commit marker records it as replica ", src, " of ", saved)};
    std::vector<std::string> problems;
    check_shard(dp, rs.file, {saved, src, async_root}, out, problems);
    return problems;
}

/// Reads the commit marker and this replica's shard and compares them with the trainer.
/// `generation`: the marker's generation the replicas agreed on (none: no valid marker was
/// read); a marker that names another is refused (read_committed_shard). The asynchronous
/// trainers constructed with another server than the run that saved restore every replica
/// from the saved server's shard (the only one with the optimizer state; the parameters and
/// state are the same on every replica between train() calls).
/// Returns every difference found (empty: compatible and intact); `out` holds the shard then.
template <class DP>
std::vector<std::string> validate(DP& dp, const std::filesystem::path& path,
                                  std::optional<std::uint64_t> generation, loaded_shard& out) {
    auto& core = checkpoint_access::core(dp);
    const int rank = core.comm().rank();
    const int replicas = core.comm().size();
    std::filesystem::path file;
    std::vector<std::string> problems =
        read_committed_shard(path, rank, replicas, generation, out.bytes, file);
    if (file.empty())
        return problems;
    if constexpr (is_asynchronous_v<typename DP::sync_policy_type>) {
        // A root the shard does not record as a replica is reported by check_shard, with the
        // shard's other differences.
        int root = -1;
        const std::string what = "shard '" + file.string() + "'";
        const parsed_header h = parse_header(out.bytes, shard_magic, what, rank);
        if (problems.empty() && recorded_async_root(h, what, replicas, root).empty() &&
            root != dp.params().root && root != rank) {
            const std::string where = "commit marker '" + path.string() + "'";
            const std::vector<std::byte> marker = read_file(path, rank);
            const parsed_header m = parse_header(marker, manifest_magic, where, rank);
            if (const auto now = m.find_meta("generation");
                !generation || now != hex16(*generation))
                return {marker_changed(where, generation, now)};
            return read_source_shard(dp, m, path, replicas, root, root, out);
        }
    }
    check_shard(dp, file, own_shard(dp), out, problems);
    return problems;
}

/// The shard of shard_layout(n, replicas) that holds element e (requires: e < n).
inline int shard_holding(std::size_t n, int replicas, std::size_t e) {
    const auto s = static_cast<std::size_t>(replicas);
    const std::size_t base = n / s, extra = n % s;
    const std::size_t longer = extra * (base + 1); // the first `extra` shards hold base + 1
    return static_cast<int>(e < longer ? e / (base + 1) : extra + (e - longer) / base);
}

/// reduce::sharded: copies into `slots` (this replica's new shard, state().slots order) the
/// elements of replica q's old shard `old` that overlap the new shard `mine`, reading from q's
/// file only its header and its optimizer sections (each checked against its CRC32C and the
/// header against q's metadata): never a second copy of the parameters.
template <class DP>
void read_old_shard_slots(DP& dp, const parsed_header& marker, const std::filesystem::path& path,
                          int saved, int q, std::int64_t steps, shard_extent old, shard_extent mine,
                          std::vector<std::vector<typename DP::value_type>>& slots,
                          std::vector<std::string>& problems) {
    using T = typename DP::value_type;
    const int rank = checkpoint_access::core(dp).comm().rank();
    shard_head head;
    if (std::string p = read_shard_head(marker, path, q, head); !p.empty()) {
        problems.push_back(std::move(p));
        return;
    }
    const recorded_shard& rs = head.rs;
    const fd_guard& f = head.f;
    const std::string what = "shard '" + rs.file.string() + "'";
    const parsed_header h = parse_header_prefix(head.bytes, rs.size, shard_magic, what, rank);
    const std::size_t before = problems.size();
    compare_header(h, describe_trainer(dp, steps, {saved, q}), expected_sections(dp, {saved, q}),
                   what + ": ", problems);
    if (problems.size() == before)
        if (std::string p = layout_refusal(dp, h); !p.empty())
            problems.push_back(what + ": " + p);
    if (problems.size() != before)
        return;
    const auto view = checkpoint_access::core(dp).optimizer().state();
    const std::size_t from = std::max(old.offset, mine.offset);
    const std::size_t to = std::min(old.offset + old.count, mine.offset + mine.count);
    for (std::size_t k = 0; k < view.slots.size(); ++k) {
        // Shape and type were compared: the section holds old.count elements of T.
        const section_entry e = *h.find_section("optimizer." + std::string(view.slots[k].name));
        std::vector<std::byte> bytes(static_cast<std::size_t>(e.length));
        if (std::string p = read_at(f, rs.file, e.offset, bytes); !p.empty()) {
            problems.push_back(std::move(p));
            return;
        }
        if (const std::uint32_t c = crc32c(std::span<const std::byte>(bytes)); c != e.crc) {
            problems.push_back(concat(what, ": section '", e.name, "' is corrupted (CRC32C stored ",
                                      e.crc, ", computed ", c, ")"));
            return;
        }
        std::memcpy(slots[k].data() + (from - mine.offset),
                    bytes.data() + (from - old.offset) * sizeof(T), (to - from) * sizeof(T));
    }
}

/// Reads and checks, for a trainer of dp's type with another replica count than the `saved`
/// replicas of the checkpoint `path` (generation `gen`), what this replica restores: the whole
/// shard of source_replica(dp) into `out` (parameters, BN and registry state, optimizer step
/// and, unless sharded, buffers, counters, loss scale) and, with reduce::sharded, this replica's
/// new shard of every optimizer buffer into `slots`, regathered from the old shards that overlap
/// it. Returns every problem found (empty: `out` and `slots` are ready for restore()).
template <class DP>
std::vector<std::string>
validate_resized(DP& dp, const std::filesystem::path& path, int saved, std::uint64_t gen,
                 loaded_shard& out, std::vector<std::vector<typename DP::value_type>>& slots) {
    using T = typename DP::value_type;
    auto& core = checkpoint_access::core(dp);
    const int rank = core.comm().rank();
    if (std::string r = resize_refusal<DP>(saved, core.comm().size()); !r.empty())
        return {r};
    std::vector<std::string> problems;
    const std::string where = "commit marker '" + path.string() + "'";
    const std::vector<std::byte> marker = read_file(path, rank);
    const parsed_header m = parse_header(marker, manifest_magic, where, rank);
    if (const auto now = m.find_meta("generation"); now != hex16(gen))
        return {marker_changed(where, gen, now)};
    int async_root = -1;
    if constexpr (is_asynchronous_v<typename DP::sync_policy_type>) {
        // The saved server (not this trainer's, which may be another or not exist among the
        // old replicas) holds the optimizer state: its number is in every shard's header.
        shard_head head;
        if (std::string p = read_shard_head(m, path, 0, head); !p.empty())
            return {p};
        // A root it does not record as a replica: shard 0 is compared, and check_shard reports
        // that with the shard's other differences.
        const std::string what = "shard '" + head.rs.file.string() + "'";
        if (!recorded_async_root(
                 parse_header_prefix(head.bytes, head.rs.size, shard_magic, what, rank), what,
                 saved, async_root)
                 .empty())
            async_root = -1;
    }
    const int src = source_replica<DP>(async_root);
    problems = read_source_shard(dp, m, path, saved, src, async_root, out);
    if (!problems.empty())
        return problems;
    if constexpr (DP::reduce_policy_type::shards_optimizer_state) {
        const std::int64_t steps =
            static_cast<std::int64_t>(section_values<std::uint64_t>(out, "trainer.counters")[0]);
        const std::size_t n = core.values().size();
        const shard_extent mine = core.optimizer_shard();
        const auto view = core.optimizer().state();
        slots.assign(view.slots.size(), std::vector<T>(mine.count));
        // Only the old shards that overlap mine, from the one holding its first element (the
        // saved world size comes from the file: nothing grows with it).
        const int first = mine.count == 0 ? saved : shard_holding(n, saved, mine.offset);
        for (int q = first; q < saved && problems.empty(); ++q) {
            const shard_extent o = owned_extent(n, {saved, q});
            if (o.offset >= mine.offset + mine.count)
                break;
            const std::size_t from = std::max(o.offset, mine.offset);
            const std::size_t to = std::min(o.offset + o.count, mine.offset + mine.count);
            if (from >= to)
                continue;
            if (q != src) {
                read_old_shard_slots(dp, m, path, saved, q, steps, o, mine, slots, problems);
                continue;
            }
            for (std::size_t k = 0; k < view.slots.size(); ++k) {
                const section_entry e =
                    *out.header.find_section("optimizer." + std::string(view.slots[k].name));
                std::memcpy(slots[k].data() + (from - mine.offset),
                            out.bytes.data() + e.offset + (from - o.offset) * sizeof(T),
                            (to - from) * sizeof(T));
            }
        }
    }
    return problems;
}

} // namespace lockstep::detail::ckpt

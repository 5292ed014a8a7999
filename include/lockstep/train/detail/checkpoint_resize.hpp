// lockstep/train/detail/checkpoint_resize.hpp: loading a checkpoint saved with another replica
// count: which shard a replica reads, and the regathering of reduce::sharded's optimizer state.
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

/// The old replica whose shard every replica reads at another replica count: the one that
/// holds the optimizer state (the server of the asynchronous trainers, the root of
/// reduce::parameter_server<Root>, replica 0 otherwise).
template <class DP>
int source_replica(const DP& dp) {
    using reduce_type = typename DP::reduce_policy_type;
    if constexpr (is_asynchronous_v<typename DP::sync_policy_type>)
        return dp.params().root;
    else if constexpr (reduce_type::update_root >= 0)
        return reduce_type::update_root;
    else
        return 0;
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
    recorded_shard rs;
    if (std::string p = recorded_shard_of(marker, path, q, rs); !p.empty()) {
        problems.push_back(std::move(p));
        return;
    }
    fd_guard f;
    if (std::string p = open_recorded_file(rs.file, rs.size, f); !p.empty()) {
        problems.push_back(std::move(p));
        return;
    }
    const std::string what = "shard '" + rs.file.string() + "'";
    std::vector<std::byte> head(std::min<std::uint64_t>(rs.size, min_header_bytes));
    if (std::string p = read_at(f, rs.file, 0, head); !p.empty()) {
        problems.push_back(std::move(p));
        return;
    }
    // The header's length, bounded by the file's size before anything is allocated.
    if (head.size() == min_header_bytes) {
        const std::uint64_t length = get_u64(head.data() + 16);
        if (length > head.size() && length <= rs.size) {
            head.resize(static_cast<std::size_t>(length));
            if (std::string p = read_at(f, rs.file, 0, head); !p.empty()) {
                problems.push_back(std::move(p));
                return;
            }
        }
    }
    const parsed_header h = parse_header_prefix(head, rs.size, shard_magic, what, rank);
    const std::size_t before = problems.size();
    compare_header(h, describe_trainer(dp, steps, {saved, q}), expected_sections(dp, {saved, q}),
                   what + ": ", problems);
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
    const int src = source_replica(dp);
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
    check_shard(dp, rs.file, {saved, src}, out, problems);
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

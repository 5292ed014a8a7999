// lockstep/train/detail/checkpoint_names.hpp: the names of a checkpoint's files (who writes a
// save, the paths of its shards and temporaries) and their parsing.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

namespace lockstep::detail::ckpt {

inline std::string hex_digits(std::uint64_t v, int width) {
    char b[17];
    std::snprintf(b, sizeof b, "%0*llx", width, static_cast<unsigned long long>(v));
    return b;
}
inline std::string hex16(std::uint64_t v) {
    return hex_digits(v, 16);
}

/// The process that writes a save (replica 0's): its id and a random token drawn once per
/// process, since process ids repeat across hosts and over time.
struct save_owner {
    std::uint32_t pid = 0;
    std::uint32_t token = 0;
    bool operator==(const save_owner&) const = default;
};

inline save_owner this_process() {
    static const std::uint32_t token = [] {
        std::random_device rd;
        return static_cast<std::uint32_t>(rd());
    }();
    return {static_cast<std::uint32_t>(::getpid()), token};
}

/// One save: its generation (64 random bits drawn for it) and the process that commits it.
struct save_id {
    std::uint64_t gen = 0;
    save_owner owner;
};

/// "<path>.<gen: 16 hex>.<pid>.<token: 8 hex>": the prefix of every file of the save id.
inline std::filesystem::path save_prefix(const std::filesystem::path& path, const save_id& id) {
    std::filesystem::path p = path;
    p += "." + hex16(id.gen) + "." + std::to_string(id.owner.pid) + "." +
         hex_digits(id.owner.token, 8);
    return p;
}
/// The shard file of replica r of the save id next to the commit marker `path`.
inline std::filesystem::path shard_path(const std::filesystem::path& path, const save_id& id,
                                        int r) {
    std::filesystem::path p = save_prefix(path, id);
    p += ".shard" + std::to_string(r);
    return p;
}
/// The temporary a shard is written to before its rename.
inline std::filesystem::path shard_temp_path(const std::filesystem::path& path, const save_id& id,
                                             int r) {
    std::filesystem::path p = shard_path(path, id, r);
    p += ".tmp";
    return p;
}
/// The temporary the commit marker of the save id is written to before its rename.
inline std::filesystem::path marker_temp_path(const std::filesystem::path& path,
                                              const save_id& id) {
    std::filesystem::path p = save_prefix(path, id);
    p += ".marker.tmp";
    return p;
}

/// What a file name next to a marker of base name `base` is, when a save of it wrote it.
struct save_file {
    enum class kind { shard, shard_temp, marker_temp };
    kind what = kind::shard;
    std::optional<std::uint64_t> gen; ///< none: the marker temporary of the first format
    std::optional<save_owner> owner;  ///< none: a file of the first format (no owner in it)
    std::string gen_text;             ///< the generation's 16 hex digits as written
    std::uint64_t rank = 0;           ///< shards
};

namespace name_detail {
inline bool all_of(std::string_view s, std::string_view set) {
    return !s.empty() && s.find_first_not_of(set) == std::string_view::npos;
}
inline std::optional<std::uint64_t> number(std::string_view s, int base, std::size_t max_len) {
    if (s.size() > max_len || !all_of(s, base == 16 ? "0123456789abcdef" : "0123456789"))
        return std::nullopt;
    std::uint64_t v = 0;
    for (char c : s) {
        const std::uint64_t d = c <= '9' ? std::uint64_t(c - '0') : std::uint64_t(c - 'a' + 10);
        if (v > (~std::uint64_t{0} - d) / std::uint64_t(base))
            return std::nullopt;
        v = v * std::uint64_t(base) + d;
    }
    return v;
}
} // namespace name_detail

/// A decimal number of at most 20 digits that fits 64 bits (no sign, no spaces).
inline std::optional<std::uint64_t> parse_decimal(std::string_view s) {
    return name_detail::number(s, 10, 20);
}

/// Parses `name` as one of the files a save of the marker `base` writes:
/// "<base>.<gen>.<pid>.<token>.shard<r>[.tmp]", "<base>.<gen>.<pid>.<token>.marker.tmp", and the
/// first format's "<base>.<gen>.shard<r>[.tmp.<r>]" and "<base>.tmp.<r>". Nothing else matches:
/// no separator, no "..", nothing outside those characters.
inline std::optional<save_file> parse_save_file(std::string_view name, std::string_view base) {
    using name_detail::number;
    if (name.size() <= base.size() + 1 || name.substr(0, base.size()) != base ||
        name[base.size()] != '.')
        return std::nullopt;
    std::vector<std::string_view> f;
    for (std::string_view rest = name.substr(base.size() + 1);;) {
        const auto dot = rest.find('.');
        f.push_back(rest.substr(0, dot));
        if (dot == std::string_view::npos)
            break;
        rest.remove_prefix(dot + 1);
    }
    auto shard_rank = [&](std::string_view s) -> std::optional<std::uint64_t> {
        if (s.substr(0, 5) != "shard")
            return std::nullopt;
        return number(s.substr(5), 10, 9);
    };
    save_file out;
    if (f.size() == 2 && f[0] == "tmp" && number(f[1], 10, 9)) {
        out.what = save_file::kind::marker_temp;
        return out;
    }
    if (f[0].size() != 16 || !number(f[0], 16, 16))
        return std::nullopt;
    out.gen = number(f[0], 16, 16);
    out.gen_text = std::string(f[0]);
    if (f.size() == 2 || (f.size() == 4 && f[2] == "tmp" && number(f[3], 10, 9))) {
        const auto r = shard_rank(f[1]);
        if (!r)
            return std::nullopt;
        out.rank = *r;
        out.what = f.size() == 2 ? save_file::kind::shard : save_file::kind::shard_temp;
        return out;
    }
    if (f.size() < 4 || f.size() > 5)
        return std::nullopt;
    const auto pid = number(f[1], 10, 10);
    const auto token = f[2].size() == 8 ? number(f[2], 16, 8) : std::nullopt;
    if (!pid || *pid > 0xFFFFFFFFu || !token)
        return std::nullopt;
    out.owner = save_owner{static_cast<std::uint32_t>(*pid), static_cast<std::uint32_t>(*token)};
    if (f.size() == 5 && f[3] == "marker" && f[4] == "tmp") {
        out.what = save_file::kind::marker_temp;
        return out;
    }
    const auto r = shard_rank(f[3]);
    if (!r || (f.size() == 5 && f[4] != "tmp"))
        return std::nullopt;
    out.rank = *r;
    out.what = f.size() == 4 ? save_file::kind::shard : save_file::kind::shard_temp;
    return out;
}

} // namespace lockstep::detail::ckpt

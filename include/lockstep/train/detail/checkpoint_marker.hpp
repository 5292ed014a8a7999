// lockstep/train/detail/checkpoint_marker.hpp: the names of a checkpoint's files, the checked
// reading of the shard a commit marker names, and the clean-up that concurrent saves survive.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_parser.hpp"
#include "lockstep/train/detail/durable_file.hpp"

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
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

/// A value from a file, quoted for an error message: at most 120 bytes, non-printable bytes as
/// \xNN.
inline std::string quote_value(std::string_view v) {
    std::string q = "'";
    for (std::size_t i = 0; i < v.size() && i < 120; ++i) {
        const auto c = static_cast<unsigned char>(v[i]);
        if (c < 0x20 || c >= 0x7F || c == '\'' || c == '\\')
            q += "\\x" + hex_digits(c, 2);
        else
            q += static_cast<char>(c);
    }
    return q + (v.size() > 120 ? "'..." : "'");
}

/// Opens the regular file p, which the marker records as `expected` bytes, into f. Refuses a
/// symbolic link, anything but a regular file, and a file whose size is not `expected`. Returns
/// the problem, if any (f is then closed or never opened).
inline std::string open_recorded_file(const std::filesystem::path& p, std::uint64_t expected,
                                      fd_guard& f) {
    const std::string what = "shard '" + p.string() + "'";
    struct ::stat st {};
    if (::lstat(p.c_str(), &st) != 0)
        return concat(what, ": ", std::strerror(errno));
    if (S_ISLNK(st.st_mode))
        return what + " is a symbolic link: a shard must be a regular file in the checkpoint's "
                      "directory";
    // O_NOFOLLOW: a link swapped in after the lstat is refused too; O_NONBLOCK: a FIFO does not
    // block the open.
    f.fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (f.fd < 0)
        return concat(what, ": ", std::strerror(errno));
    if (::fstat(f.fd, &st) != 0)
        return concat(what, ": ", std::strerror(errno));
    if (!S_ISREG(st.st_mode))
        return what + " is not a regular file";
    const auto actual = static_cast<std::uint64_t>(st.st_size);
    if (actual != expected)
        return concat(what, " has ", actual, " bytes, the commit marker records ", expected);
    return {};
}

/// Reads bytes [offset, offset + out.size()) of the open file f (named p in messages) into out.
/// Returns the problem, if any.
inline std::string read_at(const fd_guard& f, const std::filesystem::path& p, std::uint64_t offset,
                           std::span<std::byte> out) {
    std::size_t done = 0;
    while (done < out.size()) {
        const ::ssize_t r = ::pread(f.fd, out.data() + done, out.size() - done,
                                    static_cast<::off_t>(offset + done));
        if (r < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (r < 0)
            return concat("shard '", p.string(), "': ", std::strerror(errno));
        if (r == 0)
            return "shard '" + p.string() + "' shrank while read";
        done += static_cast<std::size_t>(r);
    }
    return {};
}

/// Reads the regular file p, which the marker records as `expected` bytes, into out. Refuses a
/// symbolic link, anything but a regular file, and a file whose size is not `expected`, all
/// before allocating: out never gets more bytes than the file has. Returns the problem, if any.
inline std::string read_recorded_file(const std::filesystem::path& p, std::uint64_t expected,
                                      std::vector<std::byte>& out) {
    fd_guard f;
    if (std::string problem = open_recorded_file(p, expected, f); !problem.empty())
        return problem;
    out.assign(static_cast<std::size_t>(expected), std::byte{0});
    return read_at(f, p, 0, out);
}

/// The shard of one replica as the commit marker records it.
struct recorded_shard {
    std::filesystem::path file; ///< in the marker's directory
    std::uint64_t size = 0;
    std::uint32_t crc = 0;
};

/// The shard of replica `rank` the commit marker m (read from `path`) records, after checking
/// that its name is a plain file name of the form save_checkpoint writes for this replica and
/// the marker's generation (no separator, no "..", not absolute), and its size and CRC32C are
/// numbers. Returns the problem, if any (`out` is then unspecified).
inline std::string recorded_shard_of(const parsed_header& m, const std::filesystem::path& path,
                                     int rank, recorded_shard& out) {
    const std::string where = "commit marker '" + path.string() + "'";
    const std::string key = "shard." + std::to_string(rank);
    const auto file = m.find_meta(key + ".file");
    const auto size = m.find_meta(key + ".size");
    const auto crc = m.find_meta(key + ".crc32c");
    if (!file || !size || !crc)
        return concat("the commit marker lists no shard for replica ", rank);
    const auto gen = m.find_meta("generation");
    const std::string base = path.filename().string();
    const auto parsed = parse_save_file(*file, base);
    if (!gen || !parsed || parsed->what != save_file::kind::shard || parsed->gen_text != *gen ||
        parsed->rank != static_cast<std::uint64_t>(rank))
        return concat(where, ": ", key, ".file ", quote_value(*file),
                      " is not the name of a shard of this checkpoint (expected '", base,
                      ".<generation>.<pid>.<token>.shard", rank,
                      "' in the marker's directory, generation ",
                      gen ? quote_value(*gen) : std::string("missing"), ")");
    const auto bytes = parse_decimal(*size);
    const auto sum = parse_decimal(*crc);
    if (!bytes || !sum || *sum > 0xFFFFFFFFu)
        return concat(where, ": ", key, bytes ? ".crc32c " : ".size ",
                      quote_value(bytes ? *crc : *size),
                      bytes ? " is not a CRC32C" : " is not a byte count");
    const std::filesystem::path dir = path.parent_path();
    out.file = (dir.empty() ? std::filesystem::path(".") : dir) / *file;
    out.size = *bytes;
    out.crc = static_cast<std::uint32_t>(*sum);
    return {};
}

/// Reads the whole shard `s` into `shard` and checks it against its record (size, CRC32C).
/// Returns the problem, if any.
inline std::string read_recorded_shard(const recorded_shard& s, std::vector<std::byte>& shard) {
    if (std::string p = read_recorded_file(s.file, s.size, shard); !p.empty())
        return p;
    const std::uint32_t actual = crc32c(std::span<const std::byte>(shard));
    if (actual != s.crc)
        return concat("shard '", s.file.string(), "' does not match the commit marker (", s.size,
                      " bytes with CRC32C ", s.crc, " committed, found CRC32C ", actual, ")");
    return {};
}

/// Why a load stops when the commit marker (`where`) names another generation (`now`: its
/// text, if any) than the one the replicas agreed on having read (`agreed`; none: no valid one).
inline std::string marker_changed(const std::string& where, std::optional<std::uint64_t> agreed,
                                  const std::optional<std::string>& now) {
    return concat(where,
                  " changed while the replicas read it (a save committed meanwhile): generation ",
                  agreed ? hex16(*agreed) : std::string("none"), " agreed, ",
                  now ? quote_value(*now) : std::string("none"), " read now");
}

/// Reads the commit marker `path` and the shard of replica `rank` it names into `shard`,
/// checking, before anything is allocated or read from the shard: the marker's container
/// (parse_header), its world size against `world_size`, its generation against `generation`
/// (the one the replicas agreed on having read: a marker that names another, or a valid one
/// when none was agreed on, changed while the replicas read it and stops the reading), that the
/// shard's name is a plain file name of the form save_checkpoint writes for this replica and
/// the marker's generation (no separator, no "..", not absolute), its recorded size and CRC32C
/// as numbers, that the file is no symbolic link and has the recorded size; then its CRC32C.
/// Returns every problem found (the world size's does not stop the reading). ensures:
/// `file_read` is the shard's path when `shard` holds the file the marker committed, empty
/// otherwise. A marker that does not parse throws lockstep::error (checkpoint).
inline std::vector<std::string> read_committed_shard(const std::filesystem::path& path, int rank,
                                                     int world_size,
                                                     std::optional<std::uint64_t> generation,
                                                     std::vector<std::byte>& shard,
                                                     std::filesystem::path& file_read) {
    file_read.clear();
    std::vector<std::string> problems;
    const std::vector<std::byte> marker = read_file(path, rank);
    const std::string where = "commit marker '" + path.string() + "'";
    const parsed_header m = parse_header(marker, manifest_magic, where, rank);
    const auto ws = m.find_meta("world_size");
    if (!ws || *ws != std::to_string(world_size))
        problems.push_back(concat("world size: checkpoint ", ws ? *ws : std::string("missing"),
                                  ", trainer ", world_size));
    // Without an agreed generation, a marker that names none (or one that does not parse) is
    // refused below anyway; a world size that differs is refused above.
    const auto gen_text = m.find_meta("generation");
    const auto gen = gen_text ? name_detail::number(*gen_text, 16, 16) : std::nullopt;
    if (gen != generation && (generation || (gen && problems.empty()))) {
        problems.push_back(marker_changed(where, generation, gen_text));
        return problems;
    }
    recorded_shard s;
    if (std::string p = recorded_shard_of(m, path, rank, s); !p.empty()) {
        problems.push_back(std::move(p));
        return problems;
    }
    if (std::string p = read_recorded_file(s.file, s.size, shard); !p.empty()) {
        problems.push_back(concat(where, ": shard.", rank, ".size ", s.size, ": ", p));
        return problems;
    }
    const std::uint32_t actual = crc32c(std::span<const std::byte>(shard));
    if (actual != s.crc)
        problems.push_back(
            concat("shard '", s.file.string(), "' does not match the commit marker (", s.size,
                   " bytes with CRC32C ", s.crc, " committed, found CRC32C ", actual, ")"));
    else
        file_read = s.file;
    return problems;
}

/// The generations of saves running in this process, from before replica 0 publishes one until
/// the save returns: clean-up never removes their files.
struct inflight_saves {
    std::mutex mutex;
    std::multiset<std::uint64_t> gens;
    static inflight_saves& get() {
        static inflight_saves s;
        return s;
    }
};

/// Registers a generation as in flight for its lifetime (replica 0 only: active == false does
/// nothing).
class inflight_scope {
public:
    inflight_scope(std::uint64_t gen, bool active) : gen_(gen), active_(active) {
        if (active_) {
            std::lock_guard lock(inflight_saves::get().mutex);
            inflight_saves::get().gens.insert(gen_);
        }
    }
    inflight_scope(const inflight_scope&) = delete;
    inflight_scope& operator=(const inflight_scope&) = delete;
    ~inflight_scope() {
        if (active_) {
            std::lock_guard lock(inflight_saves::get().mutex);
            auto& g = inflight_saves::get().gens;
            g.erase(g.find(gen_));
        }
    }

private:
    std::uint64_t gen_;
    bool active_;
};

/// The generation the commit marker `path` names now, if it can be read.
inline std::optional<std::uint64_t> committed_generation(const std::filesystem::path& path) {
    try {
        const std::vector<std::byte> bytes = read_file(path, 0);
        const parsed_header m = parse_header(bytes, manifest_magic, "commit marker", 0);
        if (const auto g = m.find_meta("generation"))
            return name_detail::number(*g, 16, 16);
    } catch (const std::exception&) {
    }
    return std::nullopt;
}

/// Files of another process's saves younger than this may belong to a save in flight.
inline constexpr std::chrono::hours stale_after{24};

/// After the save `ours` committed (replica 0): removes the files of other saves of `path` that
/// no save can need: those of `replaced` (the generation the marker named before our commit:
/// replaced, it is never committed again), and, unless in flight in this process or named by
/// the marker now, those this process's saves wrote and those older than stale_after.
/// The directory is listed before the in-flight set is read and the marker last, so a save
/// that commits meanwhile is either seen in flight or named by the marker. Failures to remove
/// are ignored: the commit stands.
inline void remove_stale(const std::filesystem::path& path, const save_id& ours,
                         std::optional<std::uint64_t> replaced) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path dir = path.parent_path();
    if (dir.empty())
        dir = ".";
    const std::string base = path.filename().string();
    std::vector<std::pair<fs::path, save_file>> found;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (auto f = parse_save_file(name, base))
            found.emplace_back(it->path(), std::move(*f));
    }
    std::multiset<std::uint64_t> inflight;
    {
        std::lock_guard lock(inflight_saves::get().mutex);
        inflight = inflight_saves::get().gens;
    }
    const std::uint64_t keep = committed_generation(path).value_or(ours.gen);
    const save_owner me = this_process();
    const auto now = fs::file_time_type::clock::now();
    for (const auto& [p, f] : found) {
        // Our own generation is in flight until we return: replaced, it goes now.
        const bool ours_replaced = f.gen && *f.gen == ours.gen && keep != ours.gen;
        if (f.gen && !ours_replaced && (*f.gen == keep || inflight.count(*f.gen) != 0))
            continue;
        bool doomed = ours_replaced || (f.gen && replaced && *f.gen == *replaced) ||
                      (f.owner && *f.owner == me);
        if (!doomed) {
            const auto t = fs::last_write_time(p, ec);
            doomed = !ec && now - t > stale_after;
        }
        if (doomed)
            fs::remove(p, ec);
    }
}

} // namespace lockstep::detail::ckpt

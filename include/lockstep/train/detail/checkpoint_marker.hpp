// lockstep/train/detail/checkpoint_marker.hpp: the checked reading of the shard a commit marker
// names (file names: checkpoint_names.hpp; clean-up: checkpoint_cleanup.hpp).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_names.hpp"
#include "lockstep/train/detail/checkpoint_parser.hpp"
#include "lockstep/train/detail/durable_file.hpp"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lockstep::detail::ckpt {

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

} // namespace lockstep::detail::ckpt

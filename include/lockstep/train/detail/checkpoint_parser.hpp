// lockstep/train/detail/checkpoint_parser.hpp: the checkpoint container's bounds-checked parser
// (parsed_header, parse_header_prefix, parse_header) and the section CRC check.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep::detail::ckpt {

class parsed_header;
inline parsed_header parse_header_prefix(std::span<const std::byte> head, std::uint64_t size,
                                         const magic_type& magic, std::string_view what,
                                         int replica = -1);
inline std::vector<std::string> verify_sections(std::span<const std::byte> file,
                                                const parsed_header& h);

/// A parsed and checked header: a view of the file (which must outlive it) with the positions
/// of its metadata entries and sections. Its tables take fewer bytes than the header they
/// describe (8 bytes per metadata entry of at least 8, 32 + 4 per section entry of at least
/// 36), so parsing never allocates more than the file's size, whatever the header claims.
class parsed_header {
public:
    std::uint64_t header_length() const noexcept { return header_; }
    std::size_t meta_count() const noexcept { return meta_.size(); }
    /// Metadata entry i as (key, value) views into the file.
    std::pair<std::string_view, std::string_view> meta(std::size_t i) const {
        const std::uint64_t p = meta_[i];
        const std::uint32_t kn = get_u32(file_.data() + p);
        const std::uint32_t vn = get_u32(file_.data() + p + 4 + kn);
        return {view(p + 4, kn), view(p + 8 + kn, vn)};
    }
    std::optional<std::string> find_meta(std::string_view key) const {
        for (std::size_t i = 0; i < meta_.size(); ++i)
            if (auto [k, v] = meta(i); k == key)
                return std::string(v);
        return std::nullopt;
    }
    std::size_t section_count() const noexcept { return sections_.size(); }
    /// Section i (in file order), decoded.
    section_entry section(std::size_t i) const {
        const located& l = sections_[i];
        std::uint64_t p = l.entry;
        section_entry s;
        const std::uint32_t n = get_u32(file_.data() + p);
        s.name = std::string(view(p + 4, n));
        p += 4 + n;
        s.type = static_cast<dtype>(get_u32(file_.data() + p));
        const std::uint32_t ndim = get_u32(file_.data() + p + 8);
        p += 12;
        for (std::uint32_t d = 0; d < ndim; ++d, p += 8)
            s.shape.push_back(get_u64(file_.data() + p));
        s.offset = l.offset;
        s.length = l.length;
        s.crc = l.crc;
        return s;
    }
    std::optional<section_entry> find_section(std::string_view name) const {
        // Binary search of the names parse_header_prefix sorted (a loader looks up every
        // section: a scan would make loading quadratic in the number of tensors).
        const auto at = std::lower_bound(
            by_name_.begin(), by_name_.end(), name,
            [&](std::uint32_t i, std::string_view n) { return section_name(i) < n; });
        if (at != by_name_.end() && section_name(*at) == name)
            return section(*at);
        return std::nullopt;
    }
    std::string_view section_name(std::size_t i) const {
        const std::uint64_t p = sections_[i].entry;
        return view(p + 4, get_u32(file_.data() + p));
    }

private:
    friend parsed_header parse_header_prefix(std::span<const std::byte>, std::uint64_t,
                                             const magic_type&, std::string_view, int);
    friend std::vector<std::string> verify_sections(std::span<const std::byte>,
                                                    const parsed_header&);
    struct located {
        std::uint64_t entry;  ///< header offset of the entry's name length
        std::uint64_t offset; ///< payload
        std::uint64_t length;
        std::uint32_t crc;
    };
    // The bound on allocations: each table entry is smaller than its smallest encoding.
    static_assert(sizeof(located) + sizeof(std::uint32_t) <= min_section_bytes &&
                  sizeof(std::uint64_t) <= min_meta_bytes);
    std::string_view view(std::uint64_t p, std::uint64_t n) const {
        return {reinterpret_cast<const char*>(file_.data() + p), static_cast<std::size_t>(n)};
    }

    std::span<const std::byte> file_;
    std::uint64_t header_ = 0;
    std::vector<std::uint64_t> meta_;
    std::vector<located> sections_;
    std::vector<std::uint32_t> by_name_; ///< section indices in name order
};

/// Parses and checks the header of a checkpoint file of `size` bytes from `head`, its first
/// bytes (at least the header; the sections need not be there): the magic (`magic`, named `what`
/// in messages), version, endianness, lengths against size, the header CRC32C, every count and
/// length against the bytes that remain BEFORE anything is allocated, shapes (no overflow,
/// product * element size == length), offsets (after the header, inside the file, no two
/// sections overlapping), unique names and keys. Section payload CRCs are checked by
/// verify_sections (whole files) or by the reader of a section. Throws lockstep::error
/// (checkpoint) naming the first problem. ensures: no single allocation larger than head.size()
/// bytes; the result views `head`.
inline parsed_header parse_header_prefix(std::span<const std::byte> head, std::uint64_t size,
                                         const magic_type& magic, std::string_view what,
                                         int replica) {
    const std::span<const std::byte> file = head;
    const char* op = "checkpoint";
    auto bad = [&](auto&&... args) {
        fail(errc::checkpoint, replica, op, what, ": ", std::forward<decltype(args)>(args)...);
    };
    if (size < min_header_bytes || file.size() < min_header_bytes)
        bad("the file has ", size, " bytes, fewer than the smallest header (", min_header_bytes,
            " bytes)");
    if (std::memcmp(file.data(), magic.data(), magic.size()) != 0)
        bad("not a lockstep ", std::string_view(magic.data(), magic.size()), " file (wrong magic)");
    const std::uint32_t version = get_u32(file.data() + 8);
    if (version != format_version)
        bad("format version ", version, ", this build reads version ", format_version);
    if (get_u32(file.data() + 12) != endian_marker)
        bad("endianness marker ", get_u32(file.data() + 12),
            " is not 0x01020304 stored little-endian");
    const std::uint64_t header = get_u64(file.data() + 16);
    const std::uint64_t length = get_u64(file.data() + 24);
    if (header < min_header_bytes || header > size)
        bad("header length ", header, " is outside [", min_header_bytes, ", ", size,
            "] (the file's size)");
    if (length != size)
        bad("the header records a file of ", length, " bytes, the file has ", size,
            length > size ? " (truncated)" : " (bytes appended)");
    if (header > file.size())
        bad("header length ", header, " is more than the ", file.size(), " bytes read");
    const std::uint32_t stored_crc = get_u32(file.data() + header - 4);
    const std::uint32_t actual_crc = crc32c(file.first(header - 4));
    if (stored_crc != actual_crc)
        bad("header CRC32C mismatch (stored ", stored_crc, ", computed ", actual_crc, ")");
    const std::uint64_t meta_count = get_u32(file.data() + 32);
    const std::uint64_t section_count = get_u32(file.data() + 36);
    const std::uint64_t table_bytes = header - min_header_bytes;
    if (meta_count > table_bytes / min_meta_bytes ||
        section_count > table_bytes / min_section_bytes ||
        meta_count * min_meta_bytes + section_count * min_section_bytes > table_bytes)
        bad(meta_count, " metadata entries and ", section_count,
            " sections do not fit in a header of ", header, " bytes");

    std::uint64_t pos = fixed_header_bytes;
    const std::uint64_t end = header - 4;
    auto need = [&](std::uint64_t n, const char* field) {
        if (n > end - pos)
            bad(field, " needs ", n, " bytes at header offset ", pos, ", only ", end - pos,
                " remain");
    };
    auto u32 = [&](const char* field) {
        need(4, field);
        const std::uint32_t v = get_u32(file.data() + pos);
        pos += 4;
        return v;
    };
    auto u64 = [&](const char* field) {
        need(8, field);
        const std::uint64_t v = get_u64(file.data() + pos);
        pos += 8;
        return v;
    };
    auto skip_string = [&](const char* field) {
        const std::uint32_t n = u32(field);
        need(n, field);
        const std::string_view s(reinterpret_cast<const char*>(file.data() + pos), n);
        pos += n;
        return s;
    };

    parsed_header h;
    h.file_ = file;
    h.header_ = header;
    // Both counts were checked against the header's bytes: these tables are smaller than it.
    h.meta_.reserve(meta_count);
    for (std::uint64_t i = 0; i < meta_count; ++i) {
        h.meta_.push_back(pos);
        skip_string("metadata key");
        skip_string("metadata value");
    }
    h.sections_.reserve(section_count);
    for (std::uint64_t i = 0; i < section_count; ++i) {
        const std::uint64_t entry = pos;
        const std::string_view name = skip_string("section name");
        const std::uint32_t code = u32("section dtype");
        const std::uint32_t elem = u32("section element size");
        if (dtype_size(static_cast<dtype>(code)) == 0 ||
            elem != dtype_size(static_cast<dtype>(code)))
            bad("section '", name, "': element type code ", code, " with element size ", elem,
                " is not a known type");
        const std::uint32_t ndim = u32("section rank");
        if (ndim > max_ndim)
            bad("section '", name, "' has ", ndim, " dimensions (at most ", max_ndim, ")");
        std::uint64_t count = 1;
        for (std::uint32_t d = 0; d < ndim; ++d) {
            const std::uint64_t e = u64("section extent");
            if (e != 0 && count > std::numeric_limits<std::uint64_t>::max() / e)
                bad("section '", name, "': the product of its shape overflows 64 bits");
            count *= e;
        }
        const std::uint64_t offset = u64("section offset");
        const std::uint64_t len = u64("section length");
        const std::uint32_t crc = u32("section CRC32C");
        if (count > std::numeric_limits<std::uint64_t>::max() / elem || count * elem != len)
            bad("section '", name, "': ", len, " bytes do not hold its shape of ", count,
                " elements of ", elem, " bytes");
        if (offset < header || offset > size || len > size - offset)
            bad("section '", name, "': bytes [", offset, ", +", len,
                ") are not between the header (", header, " bytes) and the end of the file (", size,
                " bytes)");
        h.sections_.push_back({entry, offset, len, crc});
    }
    if (pos != end)
        bad(end - pos, " unaccounted bytes at the end of the header");
    // Unique keys and names, by sorting indices (4 bytes per entry: the bound above holds).
    {
        std::vector<std::uint32_t> by_key(h.meta_.size());
        std::iota(by_key.begin(), by_key.end(), std::uint32_t{0});
        std::sort(by_key.begin(), by_key.end(), [&](std::uint32_t a, std::uint32_t b) {
            return h.meta(a).first < h.meta(b).first;
        });
        for (std::size_t i = 1; i < by_key.size(); ++i)
            if (h.meta(by_key[i - 1]).first == h.meta(by_key[i]).first)
                bad("metadata key '", h.meta(by_key[i]).first, "' appears twice");
    }
    {
        // Kept: find_section searches it.
        std::vector<std::uint32_t>& by_name = h.by_name_;
        by_name.resize(h.sections_.size());
        std::iota(by_name.begin(), by_name.end(), std::uint32_t{0});
        std::sort(by_name.begin(), by_name.end(), [&](std::uint32_t a, std::uint32_t b) {
            return h.section_name(a) < h.section_name(b);
        });
        for (std::size_t i = 1; i < by_name.size(); ++i)
            if (h.section_name(by_name[i - 1]) == h.section_name(by_name[i]))
                bad("section '", h.section_name(by_name[i]), "' appears twice");
    }
    std::vector<std::uint32_t> order(h.sections_.size());
    std::iota(order.begin(), order.end(), std::uint32_t{0});
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
        return h.sections_[a].offset < h.sections_[b].offset;
    });
    for (std::size_t i = 1; i < order.size(); ++i) {
        const auto& a = h.sections_[order[i - 1]];
        const auto& b = h.sections_[order[i]];
        if (a.offset + a.length > b.offset)
            bad("sections '", h.section_name(order[i - 1]), "' and '", h.section_name(order[i]),
                "' overlap");
    }
    return h;
}

/// parse_header_prefix of a whole file held in `file`. ensures: no single allocation larger
/// than file.size() bytes; the result views `file`.
inline parsed_header parse_header(std::span<const std::byte> file, const magic_type& magic,
                                  std::string_view what, int replica = -1) {
    return parse_header_prefix(file, file.size(), magic, what, replica);
}

/// Problems of the payload of h in `file`, one message each: a section whose bytes do not match
/// its CRC32C, or a non-zero byte outside every section (the alignment padding, which no CRC
/// covers, must be zero so that every bit of a file is checked).
inline std::vector<std::string> verify_sections(std::span<const std::byte> file,
                                                const parsed_header& h) {
    std::vector<std::string> bad;
    std::vector<std::uint32_t> order(h.sections_.size());
    std::iota(order.begin(), order.end(), std::uint32_t{0});
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
        return h.sections_[a].offset < h.sections_[b].offset;
    });
    std::uint64_t at = h.header_;
    auto check_gap = [&](std::uint64_t from, std::uint64_t to) {
        for (std::uint64_t i = from; i < to; ++i)
            if (file[i] != std::byte{0}) {
                bad.push_back(concat("non-zero padding byte at offset ", i));
                return;
            }
    };
    for (std::uint32_t k : order) {
        const auto& s = h.sections_[k];
        check_gap(at, s.offset);
        at = std::max(at, s.offset + s.length);
        const std::uint32_t c = crc32c(file.subspan(s.offset, s.length));
        if (c != s.crc)
            bad.push_back(concat("section '", h.section_name(k), "' is corrupted (CRC32C stored ",
                                 s.crc, ", computed ", c, ")"));
    }
    check_gap(at, file.size());
    return bad;
}

} // namespace lockstep::detail::ckpt

// lockstep/train/detail/checkpoint_format.hpp: the checkpoint container (header, metadata, named
// sections with CRC32C): its constants and element types, and file_builder, which writes it.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

namespace lockstep::detail::ckpt {

/// The element type of a section. Values are stored little-endian.
enum class dtype : std::uint32_t { u8 = 0, f32 = 1, f64 = 2, i64 = 3, u64 = 4 };

/// Bytes per element of t, 0 for an unknown code.
constexpr std::size_t dtype_size(dtype t) noexcept {
    switch (t) {
    case dtype::u8:
        return 1;
    case dtype::f32:
        return 4;
    case dtype::f64:
    case dtype::i64:
    case dtype::u64:
        return 8;
    }
    return 0;
}
inline std::string dtype_name(dtype t) {
    switch (t) {
    case dtype::u8:
        return "u8";
    case dtype::f32:
        return "f32";
    case dtype::f64:
        return "f64";
    case dtype::i64:
        return "i64";
    case dtype::u64:
        return "u64";
    }
    return "dtype#" + std::to_string(static_cast<std::uint32_t>(t));
}
template <class T>
constexpr dtype dtype_of() {
    if constexpr (std::is_same_v<T, float>)
        return dtype::f32;
    else if constexpr (std::is_same_v<T, double>)
        return dtype::f64;
    else if constexpr (std::is_same_v<T, std::int64_t>)
        return dtype::i64;
    else if constexpr (std::is_same_v<T, std::uint64_t>)
        return dtype::u64;
    else {
        static_assert(std::is_same_v<T, std::uint8_t>,
                      "checkpoint sections hold float, double, int64, uint64 or uint8 elements.");
        return dtype::u8;
    }
}

using magic_type = std::array<char, 8>;
inline constexpr magic_type shard_magic = {'L', 'S', 'T', 'P', 'S', 'H', 'R', 'D'};
inline constexpr magic_type manifest_magic = {'L', 'S', 'T', 'P', 'M', 'N', 'F', 'T'};
inline constexpr std::uint32_t format_version = 1;
inline constexpr std::uint32_t endian_marker = 0x01020304u;
/// magic, version, endianness, header length, file length, meta count, section count.
inline constexpr std::size_t fixed_header_bytes = 40;
/// The fixed part plus the header's CRC32C.
inline constexpr std::size_t min_header_bytes = fixed_header_bytes + 4;
/// The smallest encoding of one metadata entry (two lengths) and of one section entry.
inline constexpr std::size_t min_meta_bytes = 8;
inline constexpr std::size_t min_section_bytes = 4 + 4 + 4 + 4 + 8 + 8 + 4;
inline constexpr std::uint32_t max_ndim = 8;
inline constexpr std::size_t payload_alignment = 8;

/// One section of a file: its name, element type, shape, and where its bytes are.
struct section_entry {
    std::string name;
    dtype type = dtype::u8;
    std::vector<std::uint64_t> shape;
    std::uint64_t offset = 0; ///< from the start of the file
    std::uint64_t length = 0; ///< bytes: product(shape) * dtype_size(type)
    std::uint32_t crc = 0;    ///< CRC32C of the section's bytes
};

inline std::uint32_t get_u32(const std::byte* p) {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i)
        v |= std::uint32_t(std::to_integer<unsigned>(p[i])) << (8 * i);
    return v;
}
inline std::uint64_t get_u64(const std::byte* p) {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i)
        v |= std::uint64_t(std::to_integer<unsigned>(p[i])) << (8 * i);
    return v;
}

inline void put_u32(std::vector<std::byte>& out, std::uint32_t v) {
    for (int i = 0; i < 4; ++i)
        out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFFu));
}
inline void put_u64(std::vector<std::byte>& out, std::uint64_t v) {
    for (int i = 0; i < 8; ++i)
        out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFFu));
}
inline void put_string(std::vector<std::byte>& out, std::string_view s) {
    put_u32(out, static_cast<std::uint32_t>(s.size()));
    for (char c : s)
        out.push_back(static_cast<std::byte>(c));
}

/// The slices a paced writer works in (file_builder::encode, write_durably) between its pauses.
inline constexpr std::size_t slice_bytes = std::size_t{4} << 20;

/// Builds one checkpoint file in memory: metadata and sections in the order they are added.
class file_builder {
public:
    void meta(std::string key, std::string value) {
        meta_.emplace_back(std::move(key), std::move(value));
    }
    /// Adds a section of elements of type E (copied). requires: product(shape) == data.size().
    template <class E>
    void section(std::string name, std::vector<std::uint64_t> shape, std::span<const E> data) {
        static_assert(std::endian::native == std::endian::little,
                      "lockstep checkpoints store little-endian elements: this host is not "
                      "little-endian.");
        const auto* b = reinterpret_cast<const std::byte*>(data.data());
        raw_section(std::move(name), dtype_of<E>(), std::move(shape),
                    std::vector<std::byte>(b, b + data.size_bytes()));
    }

    /// Adds a section of already encoded little-endian bytes (copied, or taken over).
    void raw_section(std::string name, dtype type, std::vector<std::uint64_t> shape,
                     std::span<const std::byte> bytes) {
        raw_section(std::move(name), type, std::move(shape),
                    std::vector<std::byte>(bytes.begin(), bytes.end()));
    }
    void raw_section(std::string name, dtype type, std::vector<std::uint64_t> shape,
                     std::vector<std::byte>&& bytes) {
        sections_.push_back(pending{std::move(name), type, std::move(shape), std::move(bytes)});
    }
    /// Adds a section of encoded little-endian bytes that the builder does not copy: the caller
    /// keeps them alive and unchanged until the builder's last encode() or finish() has been
    /// written (a device snapshot's page-locked staging).
    void borrowed_section(std::string name, dtype type, std::vector<std::uint64_t> shape,
                          std::span<const std::byte> bytes) {
        sections_.push_back(pending{std::move(name), type, std::move(shape), {}, bytes});
    }

    /// The whole file: header (with its CRC32C), then the 8-byte aligned section payloads.
    /// Throws lockstep::error (invalid_argument) when two sections or two metadata entries share
    /// a name (e.g. a registry state tensor and a visited state tensor): the file would be
    /// refused when loaded.
    std::vector<std::byte> finish(const magic_type& magic) const {
        std::vector<std::byte> header;
        const encoded_file file = encode(magic, header);
        std::vector<std::byte> out;
        out.reserve(file.size);
        for (const auto& p : file.pieces)
            out.insert(out.end(), p.begin(), p.end());
        return out;
    }

    /// The file finish() returns, as the pieces it concatenates.
    struct encoded_file {
        /// In order: the header, then per section its padding and its payload.
        std::vector<std::span<const std::byte>> pieces;
        std::uint32_t crc = 0;  ///< CRC32C of the whole file
        std::uint64_t size = 0; ///< bytes of the whole file
    };
    /// The file as pieces: the header written into `header_out`, the payloads views of this
    /// builder (a writer need not copy them); its CRC32C combined from the sections' own
    /// (crc32c_combine), so the payloads are read once. Throws as finish() does.
    /// `pace` (if any) is called after every slice of slice_bytes summed (a background writer
    /// sleeps there).
    encoded_file encode(const magic_type& magic, std::vector<std::byte>& header_out,
                        const std::function<void()>& pace = {}) const {
        // A set, not a pairwise check: a shard holds a section per tensor.
        std::unordered_set<std::string_view> names;
        for (const auto& s : sections_) {
            const bool first = names.insert(s.name).second;
            LOCKSTEP_REQUIRE(first, errc::invalid_argument, -1, "save_checkpoint",
                             "two sections are named '", s.name,
                             "': give the tensors distinct names");
        }
        for (std::size_t i = 0; i < meta_.size(); ++i)
            for (std::size_t j = 0; j < i; ++j)
                LOCKSTEP_REQUIRE(meta_[i].first != meta_[j].first, errc::invalid_argument, -1,
                                 "save_checkpoint", "metadata key '", meta_[i].first,
                                 "' is set twice");
        std::vector<std::byte> table;
        for (const auto& [k, v] : meta_) {
            put_string(table, k);
            put_string(table, v);
        }
        std::size_t header = fixed_header_bytes + 4;
        for (const auto& s : sections_)
            header += min_section_bytes + s.name.size() + 8 * s.shape.size();
        header += table.size();
        std::uint64_t offset = round_up(header);
        std::vector<std::uint32_t> section_crcs;
        for (const auto& s : sections_) {
            put_string(table, s.name);
            put_u32(table, static_cast<std::uint32_t>(s.type));
            put_u32(table, static_cast<std::uint32_t>(dtype_size(s.type)));
            put_u32(table, static_cast<std::uint32_t>(s.shape.size()));
            for (std::uint64_t d : s.shape)
                put_u64(table, d);
            put_u64(table, offset);
            put_u64(table, s.bytes().size());
            std::uint32_t crc = 0;
            for (std::size_t at = 0; at < s.bytes().size(); at += slice_bytes) {
                crc = crc32c_update(
                    crc, s.bytes().subspan(at, std::min(slice_bytes, s.bytes().size() - at)));
                if (pace)
                    pace();
            }
            section_crcs.push_back(crc);
            put_u32(table, section_crcs.back());
            offset = round_up(offset + s.bytes().size());
        }
        const std::uint64_t file_length =
            sections_.empty() ? header : offset - pad(sections_.back().bytes().size());
        std::vector<std::byte>& out = header_out;
        out.clear();
        for (char c : magic)
            out.push_back(static_cast<std::byte>(c));
        put_u32(out, format_version);
        put_u32(out, endian_marker);
        put_u64(out, header);
        put_u64(out, file_length);
        put_u32(out, static_cast<std::uint32_t>(meta_.size()));
        put_u32(out, static_cast<std::uint32_t>(sections_.size()));
        out.insert(out.end(), table.begin(), table.end());
        put_u32(out, crc32c(std::span<const std::byte>(out)));
        static constexpr std::byte zeros[payload_alignment] = {};
        encoded_file file;
        file.pieces.emplace_back(out);
        file.crc = crc32c(std::span<const std::byte>(out));
        file.size = out.size();
        for (std::size_t i = 0; i < sections_.size(); ++i) {
            const std::span<const std::byte> padding(zeros,
                                                     static_cast<std::size_t>(pad(file.size)));
            file.pieces.push_back(padding);
            file.crc = crc32c_update(file.crc, padding);
            file.pieces.emplace_back(sections_[i].bytes());
            file.crc = crc32c_combine(file.crc, section_crcs[i], sections_[i].bytes().size());
            file.size += padding.size() + sections_[i].bytes().size();
        }
        return file;
    }

private:
    struct pending {
        std::string name;
        dtype type;
        std::vector<std::uint64_t> shape;
        std::vector<std::byte> owned;             ///< the payload, unless borrowed
        std::span<const std::byte> borrowed = {}; ///< the payload when borrowed, else empty
        /// The payload (a view computed on use, so a copied builder views its own bytes).
        std::span<const std::byte> bytes() const noexcept {
            return borrowed.empty() ? std::span<const std::byte>(owned) : borrowed;
        }
    };
    static std::uint64_t round_up(std::uint64_t n) {
        return (n + payload_alignment - 1) / payload_alignment * payload_alignment;
    }
    static std::uint64_t pad(std::uint64_t n) { return round_up(n) - n; }

    std::vector<std::pair<std::string, std::string>> meta_;
    std::vector<pending> sections_;
};

} // namespace lockstep::detail::ckpt

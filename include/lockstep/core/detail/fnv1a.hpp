// lockstep/core/detail/fnv1a.hpp: 64-bit FNV-1a, the hash the library's identity checks share
// (collective names and call sites, network signatures, checkpoint paths, per-replica counts,
// hierarchical calls). Not for integrity: checkpoint sections carry CRC32C (core/crc32c.hpp).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lockstep::detail {

/// FNV-1a's 64-bit offset basis, the start of every hash below unless the caller seeds another.
inline constexpr std::uint64_t fnv1a_basis = 14695981039346656037ull;

/// 64-bit FNV-1a of the bytes, continuing from `h`. ensures: the same value on every platform.
constexpr std::uint64_t fnv1a(std::string_view bytes, std::uint64_t h = fnv1a_basis) noexcept {
    for (const char c : bytes)
        h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return h;
}

/// 64-bit FNV-1a of `size` bytes of an object, continuing from `h` (its in-memory bytes: the
/// value depends on the platform's byte order, so compare it only between processes of one
/// build on machines of one byte order).
inline std::uint64_t fnv1a_bytes(const void* data, std::size_t size,
                                 std::uint64_t h = fnv1a_basis) noexcept {
    return fnv1a(std::string_view(static_cast<const char*>(data), size), h);
}

/// 64-bit FNV-1a of v's 8 bytes, least significant first (the same on every byte order),
/// continuing from `h`.
constexpr std::uint64_t fnv1a_u64(std::uint64_t v, std::uint64_t h) noexcept {
    for (int b = 0; b < 8; ++b)
        h = (h ^ ((v >> (8 * b)) & 0xffu)) * 1099511628211ull;
    return h;
}

} // namespace lockstep::detail

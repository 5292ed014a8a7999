// lockstep/core/crc32c.hpp: CRC32C (Castagnoli), software slicing-by-8, for checkpoint sections.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace lockstep {

namespace detail {
/// The eight 256-entry tables of slicing-by-8 for the reflected polynomial 0x82F63B78; table 0
/// is the classic byte-at-a-time table, table k advances a byte k more positions.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc32c_tables() {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
        std::uint32_t c = i;
        for (int k = 0; k < 8; ++k)
            c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        t[0][i] = c;
    }
    for (std::size_t k = 1; k < 8; ++k)
        for (std::size_t i = 0; i < 256; ++i)
            t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
    return t;
}
inline constexpr auto crc32c_tables = make_crc32c_tables();
} // namespace detail

/// Continues a CRC32C: crc32c_update(crc32c_update(0, a), b) == crc32c(a followed by b).
/// ensures: the CRC-32C of iSCSI (RFC 3720) and ext4; crc32c of "123456789" is 0xE3069283.
inline std::uint32_t crc32c_update(std::uint32_t crc, std::span<const std::byte> data) noexcept {
    const auto& t = detail::crc32c_tables;
    std::uint32_t c = ~crc;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(data.data());
    std::size_t n = data.size();
    // Eight bytes per round, assembled little-endian whatever the host's byte order.
    while (n >= 8) {
        const std::uint32_t lo = c ^ (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 |
                                      std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24);
        c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
            t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n-- > 0)
        c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFFu];
    return ~c;
}

namespace detail {
/// mat (32 columns over GF(2)) times vec.
constexpr std::uint32_t gf2_times(const std::uint32_t* mat, std::uint32_t vec) noexcept {
    std::uint32_t sum = 0;
    for (; vec != 0; vec >>= 1, ++mat)
        if ((vec & 1u) != 0)
            sum ^= *mat;
    return sum;
}
/// square = mat * mat.
constexpr void gf2_square(std::uint32_t* square, const std::uint32_t* mat) noexcept {
    for (int n = 0; n < 32; ++n)
        square[n] = gf2_times(mat, mat[n]);
}
} // namespace detail

/// The CRC32C of a followed by b from crc_a = crc32c(a), crc_b = crc32c(b) and b's length,
/// without reading the bytes (zlib's crc32_combine with the Castagnoli polynomial: the operator
/// that appends len_b zero bytes, applied by repeated squaring; O(log len_b)).
constexpr std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                                       std::uint64_t len_b) noexcept {
    if (len_b == 0)
        return crc_a;
    std::uint32_t even[32] = {}; // the operator for 2^k zero bits, alternately
    std::uint32_t odd[32] = {};
    odd[0] = 0x82F63B78u; // the reflected polynomial: one zero bit
    std::uint32_t row = 1;
    for (int n = 1; n < 32; ++n) {
        odd[n] = row;
        row <<= 1;
    }
    detail::gf2_square(even, odd); // two zero bits
    detail::gf2_square(odd, even); // four
    do {
        detail::gf2_square(even, odd); // one zero byte, then 4, 16, ... (with odd: 2, 8, ...)
        if ((len_b & 1u) != 0)
            crc_a = detail::gf2_times(even, crc_a);
        len_b >>= 1;
        if (len_b == 0)
            break;
        detail::gf2_square(odd, even);
        if ((len_b & 1u) != 0)
            crc_a = detail::gf2_times(odd, crc_a);
        len_b >>= 1;
    } while (len_b != 0);
    return crc_a ^ crc_b;
}

/// The CRC32C of data (0 for an empty span).
inline std::uint32_t crc32c(std::span<const std::byte> data) noexcept {
    return crc32c_update(0, data);
}

} // namespace lockstep

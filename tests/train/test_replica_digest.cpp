// The digests of train_params::verify_every in one pass (detail::section_digests) against an
// independent per-tensor loop: empty tensors anywhere, odd float counts, tensors of many tiles,
// one and several host threads. SPDX-License-Identifier: Apache-2.0
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/detail/replica_digest.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace {

/// The digest as the check defines it, written out: words of 64 bits (two floats, low one
/// first, or one double), each term mix(word + (index + 1) * golden), summed modulo 2^64.
std::uint64_t finalise(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <class T>
std::int64_t reference_digest(const std::vector<T>& v) {
    std::vector<unsigned char> bytes(v.size() * sizeof(T));
    if (!v.empty())
        std::memcpy(bytes.data(), v.data(), bytes.size());
    bytes.resize((bytes.size() + 7) / 8 * 8, 0); // an odd float count: the high half is zero
    std::uint64_t h = 0;
    for (std::size_t j = 0; j < bytes.size() / 8; ++j) {
        std::uint64_t w = 0;
        for (int b = 7; b >= 0; --b)
            w = (w << 8) | bytes[8 * j + static_cast<std::size_t>(b)]; // little-endian
        h += finalise(w + (j + 1) * 0x9e3779b97f4a7c15ull);
    }
    return static_cast<std::int64_t>(h);
}

template <class T>
std::vector<T> values(std::size_t n, std::uint64_t seed) {
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = static_cast<T>(static_cast<double>(seed >> 11) * 0x1.0p-53 - 0.5) *
               static_cast<T>(i % 7 + 1);
    }
    return v;
}

} // namespace

TEMPLATE_TEST_CASE("section_digests equals the per-tensor digest of every tensor",
                   "[train][verify]", float, double) {
    using T = TestType;
    const int threads = GENERATE(1, 3);
    CAPTURE(threads);
    constexpr std::size_t tile_elements = lockstep::detail::digest_tile * (sizeof(T) == 4 ? 2 : 1);
    // Empty first, between and last; one element; a tile exactly; a tile and one; many tiles
    // and an odd count.
    const std::vector<std::size_t> sizes = {
        0, 1, 0, tile_elements, tile_elements + 1, 7, 5 * tile_elements + 3, 0, 64, 0};
    std::vector<std::vector<T>> tensors;
    std::vector<lockstep::detail::consistency_section<T>> sections;
    for (std::size_t k = 0; k < sizes.size(); ++k)
        tensors.push_back(values<T>(sizes[k], 17 + k));
    for (std::size_t k = 0; k < sizes.size(); ++k)
        sections.push_back(
            {"t" + std::to_string(k), std::span<const T>(tensors[k].data(), tensors[k].size())});

    const lockstep::host_system sys{threads};
    lockstep::detail::section_digests<lockstep::host_system, T> d(sys, sections);
    d.enqueue();
    REQUIRE(d.digests().size() == sections.size());
    for (std::size_t k = 0; k < sections.size(); ++k) {
        CAPTURE(k, sizes[k]);
        CHECK(d.digests()[k] == reference_digest(tensors[k]));
    }

    // One flipped bit in the last word of a many-tile tensor changes its digest only.
    std::vector<std::int64_t> before(d.digests().begin(), d.digests().end());
    T& last = tensors[6].back();
    std::uint64_t bits = 0;
    std::memcpy(&bits, &last, sizeof(T));
    bits ^= 1;
    std::memcpy(&last, &bits, sizeof(T));
    lockstep::detail::section_digests<lockstep::host_system, T> again(sys, sections);
    again.enqueue();
    for (std::size_t k = 0; k < sections.size(); ++k) {
        CAPTURE(k);
        CHECK((again.digests()[k] != before[k]) == (k == 6));
    }
}

TEST_CASE("section_digests of no tensors is empty", "[train][verify]") {
    lockstep::detail::section_digests<lockstep::host_system, float> d(
        lockstep::host_system{1}, std::vector<lockstep::detail::consistency_section<float>>{});
    d.enqueue();
    CHECK(d.digests().empty());
}

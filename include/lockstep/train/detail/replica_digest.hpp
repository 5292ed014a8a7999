// lockstep/train/detail/replica_digest.hpp: the digest of train_params::verify_every (its terms,
// and the digests of many tensors in one pass on any system). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/host_collective.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::detail {

/// One tensor the replicas must hold bit for bit ("param.fc1.weight", "optimizer.m").
template <class T>
struct consistency_section {
    std::string name;
    std::span<const T> data;
};

/// The bits of x as an unsigned integer of its size.
template <class T>
LOCKSTEP_HOST_DEVICE std::uint64_t element_bits(T x) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "verify_every digests 32- and 64-bit values");
    if constexpr (sizeof(T) == 4)
        return std::bit_cast<std::uint32_t>(x);
    else
        return std::bit_cast<std::uint64_t>(x);
}

/// splitmix64's finaliser: every input bit changes about half of the output bits.
LOCKSTEP_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/// The digest term of element i, for locating a difference: mix64 of its bits and its index.
template <class T>
struct digest_term_fn {
    const T* data;
    LOCKSTEP_HOST_DEVICE std::uint64_t operator()(std::size_t i) const {
        return mix64(element_bits(data[i]) + (i + 1) * 0x9e3779b97f4a7c15ull);
    }
};

/// The 64-bit words of a tensor of n elements of T (two floats, or one double, per word).
template <class T>
LOCKSTEP_HOST_DEVICE constexpr std::size_t digest_words(std::size_t n) {
    return sizeof(T) == 4 ? (n + 1) / 2 : n;
}

/// The digest term of 64-bit word j of a tensor of n elements (two floats, or one double; a
/// float tensor's last word holds one element when n is odd): mix64 of the word plus a
/// multiple of its index. A tensor's digest is the sum of its terms modulo 2^64: a sum, so any
/// reduction order (any system, any thread count, any tiling) gives the same digest; mix64 is
/// a bijection, so one changed word always changes the digest; the index makes it
/// position-dependent.
template <class T>
struct digest_word_fn {
    const T* data;
    std::size_t n;
    LOCKSTEP_HOST_DEVICE std::uint64_t operator()(std::size_t j) const {
        std::uint64_t w = 0;
        if constexpr (sizeof(T) == 4) {
            w = element_bits(data[2 * j]);
            if (2 * j + 1 < n)
                w |= element_bits(data[2 * j + 1]) << 32;
        } else {
            w = element_bits(data[j]);
        }
        return mix64(w + (j + 1) * 0x9e3779b97f4a7c15ull);
    }
};

/// Words per tile of the one-pass digests: a tile never spans two tensors.
inline constexpr std::size_t digest_tile = 1024;

/// A tensor of the one-pass digests: its data and its first tile (a table in the system's
/// memory, so one launch covers every tensor).
template <class T>
struct digest_entry {
    const T* data;
    std::size_t n;
    std::size_t first_tile;
};

/// Task t: the sum of the terms of tile t (of the tensor whose tiles hold t) into partial[t].
template <class T>
struct digest_tile_fn {
    const digest_entry<T>* table;
    std::size_t entries;
    std::uint64_t* partial;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t t) const {
        // The last entry whose first tile is <= t (an empty tensor shares its first tile with the
        // next one, which owns the tile).
        std::size_t lo = 0, hi = entries;
        while (hi - lo > 1) {
            const std::size_t mid = lo + (hi - lo) / 2;
            if (table[mid].first_tile <= t)
                lo = mid;
            else
                hi = mid;
        }
        const digest_entry<T> e = table[lo];
        const std::size_t words = digest_words<T>(e.n);
        const std::size_t begin = (t - e.first_tile) * digest_tile;
        const std::size_t end = begin + digest_tile < words ? begin + digest_tile : words;
        const digest_word_fn<T> term{e.data, e.n};
        std::uint64_t h = 0;
        for (std::size_t j = begin; j < end; ++j)
            h += term(j);
        partial[t] = h;
    }
};

/// Task s: tensor s's digest, the sum of its tiles' partial sums, into out[s] (as int64, what
/// the communicators exchange).
template <class T>
struct digest_sum_fn {
    const digest_entry<T>* table;
    std::size_t entries, tiles;
    const std::uint64_t* partial;
    std::int64_t* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t s) const {
        const std::size_t end = s + 1 < entries ? table[s + 1].first_tile : tiles;
        std::uint64_t h = 0;
        for (std::size_t t = table[s].first_tile; t < end; ++t)
            h += partial[t];
        out[s] = static_cast<std::int64_t>(h);
    }
};

/// The digests of many tensors (in sys's memory) in two launches whatever their number: one task
/// per tile of every tensor, then one per tensor. Construction allocates everything (the table
/// goes to sys's memory through staged_upload: on CUDA an asynchronous copy from pinned memory);
/// enqueue() only launches, so a collective enqueued after it has no allocation between it and
/// its wait. The digests equal, bit for bit, the sum modulo 2^64 of each tensor's
/// digest_word_fn terms (0 for an empty tensor), on every system.
template <class System, class T>
class section_digests {
public:
    /// requires: the sections' data are memory of sys and outlive the enqueued work.
    section_digests(const System& sys, const std::vector<consistency_section<T>>& sections)
        : sys_(sys), table_(make_table(sections, tiles_, words_), sys), partial_(tiles_, sys),
          digests_(sections.size(), sys) {}

    /// Queues the digests behind sys's work (the host system computes them now).
    void enqueue() {
        const std::size_t entries = digests_.size();
        if (entries == 0)
            return;
        const digest_entry<T>* table = table_.device.data();
        kernels::for_each_index(sys_, tiles_, digest_tile_fn<T>{table, entries, partial_.data()},
                                words_);
        kernels::for_each_index(
            sys_, entries,
            digest_sum_fn<T>{table, entries, tiles_, partial_.data(), digests_.data()}, tiles_);
    }

    /// One digest per section, in order, in sys's memory (complete once the enqueued work is).
    std::span<const std::int64_t> digests() const noexcept {
        return std::span<const std::int64_t>(digests_.data(), digests_.size());
    }

private:
    static std::vector<digest_entry<T>>
    make_table(const std::vector<consistency_section<T>>& sections, std::size_t& tiles,
               std::size_t& words) {
        std::vector<digest_entry<T>> table;
        table.reserve(sections.size());
        tiles = 0;
        words = 0;
        for (const auto& s : sections) {
            const std::size_t w = digest_words<T>(s.data.size());
            table.push_back({s.data.data(), s.data.size(), tiles});
            tiles += (w + digest_tile - 1) / digest_tile;
            words += w;
        }
        return table;
    }

    System sys_;
    std::size_t tiles_ = 0, words_ = 0; // set by make_table before the buffers below
    staged_upload<digest_entry<T>, System> table_;
    buffer<std::uint64_t, System> partial_;
    buffer<std::int64_t, System> digests_;
};

} // namespace lockstep::detail

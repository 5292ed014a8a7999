// lockstep/train/detail/compressed_all_reduce.hpp: the sum of reduce::compressed<Wire>, a
// reduce-scatter (all_to_all) and all_gather of 16-bit wire values. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep {
class thread_communicator; // comm/thread_communicator.hpp (only compared, never used)
} // namespace lockstep

namespace lockstep::detail {

/// How compressed_all_reduce splits a chunk of `n` elements over `ranks` replicas: shard j is
/// elements [j * shard, min((j + 1) * shard, n)) (empty when n is small), and every block of the
/// exchanges holds `shard` 16-bit slots (shard / 2 int words). shard is a multiple of 64 slots
/// (128 bytes), so blocks start on cache lines; every replica computes the same boundaries.
struct compressed_shards {
    std::size_t n = 0;
    std::size_t ranks = 1;
    std::size_t shard = 0; ///< slots (elements) per replica, a multiple of 64

    static compressed_shards of(std::size_t n, std::size_t ranks) {
        constexpr std::size_t align = 64;
        std::size_t per = (n + ranks - 1) / ranks;
        per = (per + align - 1) / align * align;
        return {n, ranks, per};
    }
    /// Words per block (two slots per int).
    std::size_t block_words() const noexcept { return shard / 2; }
    /// Words of the send / receive / reduced buffers.
    std::size_t total_words() const noexcept { return ranks * block_words(); }
    /// First element of replica j's shard (may be >= n).
    std::size_t first(std::size_t j) const noexcept { return std::min(n, j * shard); }
    /// One past the last element of replica j's shard.
    std::size_t last(std::size_t j) const noexcept { return std::min(n, (j + 1) * shard); }
};

/// Elements compressed_all_reduce handles per round of collectives (two collectives a round),
/// by communicator. Measured with bench_reduce's ResNet-50 list on 2 replicas, quiet machine:
/// - MPI (and any other host communicator): 64 Ki elements. The chunk (256 KiB of float) and
///   its three 16-bit buffers (128 KiB each) stay in a core's L2 cache between the passes, so
///   memory sees one read and one write of the gradient; 256 Ki-1 Mi chunks were 20-30% slower.
/// - thread_communicator: 512 Ki elements. Its rendezvous spin for microseconds and then sleep,
///   and replicas a few microseconds apart pay a wake-up (~20 us) per rendezvous: 64 Ki chunks
///   were 1.5x slower than 512 Ki ones, whose buffers spill to L3.
/// - a device: 64 Mi elements (a whole bucket).
template <class Communicator>
inline constexpr std::size_t compressed_chunk_elements =
    !Communicator::system_type::is_host                 ? std::size_t{1} << 26
    : std::is_same_v<Communicator, thread_communicator> ? std::size_t{1} << 19
                                                        : std::size_t{1} << 16;

/// The scratch buffers of compressed_all_reduce on one replica: the packed send blocks, the
/// received blocks and the reduced (gathered) slots, each sized for one chunk.
template <class T, class System>
class compressed_workspace {
public:
    compressed_workspace() = default;
    /// Buffers for pieces of up to max_elements on `replicas` replicas, reduced in chunks of at
    /// most chunk_elements (compressed_chunk_elements<Communicator> is the measured choice).
    /// requires: replicas >= 1, chunk_elements >= 1 and equal on every replica (it decides the
    /// collectives issued).
    compressed_workspace(const System& sys, int replicas, std::size_t max_elements,
                         std::size_t chunk_elements)
        : replicas_(replicas), chunk_(chunk_elements) {
        LOCKSTEP_REQUIRE(replicas >= 1 && chunk_elements >= 1, errc::invalid_argument, -1,
                         "compressed_workspace", replicas, " replicas, chunks of ", chunk_elements,
                         " elements");
        const auto s = compressed_shards::of(std::min(max_elements, chunk_elements),
                                             static_cast<std::size_t>(replicas));
        words_ = s.total_words();
        send_ = buffer<int, System>(words_, sys);
        recv_ = buffer<int, System>(words_, sys);
        reduced_ = buffer<int, System>(words_, sys);
    }

    /// Elements per round of collectives.
    std::size_t chunk_elements() const noexcept { return chunk_; }
    /// The replica count the buffers were sized for.
    int replicas() const noexcept { return replicas_; }
    /// Words of each buffer.
    std::size_t words() const noexcept { return words_; }
    int* send() noexcept { return send_.data(); }
    int* recv() noexcept { return recv_.data(); }
    int* reduced() noexcept { return reduced_.data(); }

private:
    int replicas_ = 1;
    std::size_t chunk_ = 1;
    std::size_t words_ = 0;
    buffer<int, System> send_, recv_, reduced_;
};

/// The sum over replicas of `piece`, in place, through 16-bit Wire values (lockstep::half or
/// lockstep::bfloat16). A collective: every replica calls it with the same piece size and a
/// workspace of the same chunk size. Per chunk of ws.chunk_elements() elements:
///   1. every replica rounds its chunk to Wire (nearest even) and sends shard j of it to
///      replica j (all_to_all; compressed_shards gives the shards);
///   2. replica j sums the size() contributions to its shard in float, in rank order, rounds
///      the sum to Wire and writes it back to its piece in T;
///   3. all_gather of the rounded shards; every replica converts the other shards back to T.
/// Every replica ends with identical bits. Bytes each replica sends: 2 x (size-1)/size x 2
/// bytes per element, half of a float ring all-reduce's.
///
/// Error bound, per element, with g_r replica r's value, u = Wire::unit_roundoff (2^-11 half,
/// 2^-8 bfloat16): each contribution is rounded once and the float sum once, so
///   |result - sum_r g_r| <= u * sum_r |g_r| + u * |sum_r g_r| + (size - 1) * 2^-24 * sum_r |g_r|
/// (the last term is the float additions; T = double adds the rounding of each g_r to float
/// first). half is subnormal below 2^-14: there each of the size() + 1 roundings adds up to
/// 2^-25 absolutely. Overflow: a half contribution or sum beyond 65504 becomes infinity (NaN
/// stays NaN), so the step's non-finite check sees it.
///
/// requires: Communicator models all_to_all_communicator; ws was made for comm.size() replicas
/// and piece.size() elements or more; piece is memory of comm.system().
/// ensures: returns the number of collectives issued (2 per chunk).
template <class Wire, class T, class Communicator>
std::size_t compressed_all_reduce(Communicator& comm, std::span<T> piece,
                                  compressed_workspace<T, typename Communicator::system_type>& ws) {
    static_assert(is_wire_float16_v<Wire>,
                  "compressed_all_reduce sends 16-bit floats: Wire must be lockstep::half or "
                  "lockstep::bfloat16.");
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "compressed_all_reduce sums float or double gradients.");
    static_assert(all_to_all_communicator<Communicator>,
                  "reduce::compressed needs a communicator with all_to_all (thread_group, MPI and "
                  "NCCL communicators have it): its reduce-scatter exchanges 16-bit shards.");
    using system_type = typename Communicator::system_type;
    const auto sys = comm.system();
    const std::size_t ranks = static_cast<std::size_t>(comm.size());
    const std::size_t me = static_cast<std::size_t>(comm.rank());
    LOCKSTEP_REQUIRE(ws.replicas() == comm.size(), errc::invalid_argument, comm.rank(),
                     "compressed_all_reduce", "the workspace was made for ", ws.replicas(),
                     " replicas, the communicator has ", comm.size());
    const std::size_t tile = system_type::is_host ? wire_host_tile : 2;
    const auto tasks = [&](std::size_t slots) { return (slots + tile - 1) / tile; };
    std::size_t collectives = 0;
    for (std::size_t at = 0; at < piece.size(); at += ws.chunk_elements()) {
        const std::size_t n = std::min(ws.chunk_elements(), piece.size() - at);
        const auto s = compressed_shards::of(n, ranks);
        LOCKSTEP_REQUIRE(s.total_words() <= ws.words(), errc::invalid_argument, comm.rank(),
                         "compressed_all_reduce", "a chunk of ", n, " elements needs ",
                         s.total_words(), " words per buffer, the workspace holds ", ws.words());
        T* x = piece.data() + at;
        const std::size_t words = s.total_words(), block = s.block_words();
        kernels::for_each_index(sys, tasks(2 * words),
                                pack_wire_fn<Wire, T>{x, n, ws.send(), 2 * words, tile});
        comm.all_to_all(std::span<const int>(ws.send(), words), std::span<int>(ws.recv(), words));
        const std::size_t first = s.first(me);
        kernels::for_each_index(sys, tasks(s.shard),
                                sum_wire_fn<Wire, T>{ws.recv(), s.shard, comm.size(),
                                                     ws.reduced() + me * block, x + first,
                                                     s.last(me) - first, tile});
        comm.all_gather(std::span<const int>(ws.reduced() + me * block, block),
                        std::span<int>(ws.reduced(), words));
        // The other shards: before and after this replica's (shard boundaries are even, so
        // they start on whole words).
        kernels::for_each_index(sys, tasks(first),
                                unpack_wire_fn<Wire, T>{ws.reduced(), x, first, tile});
        const std::size_t after = s.last(me);
        kernels::for_each_index(
            sys, tasks(n - after),
            unpack_wire_fn<Wire, T>{ws.reduced() + after / 2, x + after, n - after, tile});
        collectives += 2;
    }
    return collectives;
}

} // namespace lockstep::detail

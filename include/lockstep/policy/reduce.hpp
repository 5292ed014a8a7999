// lockstep/policy/reduce.hpp: ReducePolicy tags (how gradients travel between replicas) and
// their concept. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/float16.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>

namespace lockstep {

namespace reduce {

/// What a ReducePolicy tells the trainer about itself, with the values of a plain all-reduce;
/// each tag derives from it and overrides what differs.
/// - update_root: the replica that alone applies the update (and broadcasts the result), or -1
///   when every replica updates the whole buffer.
/// - shards_optimizer_state: each replica's optimizer updates (and keeps state for) its shard
///   of the flat buffer only.
/// - chunk_samples: the step cuts every global batch into chunks of this many samples and calls
///   the step function once per chunk (0: micro-batches as train_params says).
/// - rounds_on_wire: what travels is rounded (the sum differs from the values' exact sum by
///   more than the reduction order).
struct policy_traits {
    static constexpr int update_root = -1;
    static constexpr bool shards_optimizer_state = false;
    static constexpr std::size_t chunk_samples = 0;
    static constexpr bool rounds_on_wire = false;
};

/// One all_reduce per parameter tensor, in reverse registration order (the order backward
/// produces gradients). The baseline: many small collectives pay latency per tensor.
struct per_tensor : policy_traits {
    /// The policy's name: what checkpoints record and the agreement check compares.
    static std::string name() { return "reduce::per_tensor"; }
};

/// Tensors packed into buckets of about Bytes (the first bucket FirstBytes, so the first
/// collective starts early, as PyTorch DDP does), in reverse registration order; one all_reduce
/// per bucket, launched as soon as every tensor of the bucket is marked ready. The last bucket
/// launched (the first tensors registered, the last gradients backward produces) is kept below
/// FirstBytes as well (at least one tensor), because its reduction is the part left exposed
/// after backward ends. With the registry a bucket is a contiguous range of the flat gradient
/// buffer, reduced in place.
/// requires: Bytes >= 1, FirstBytes >= 1.
template <std::size_t Bytes = std::size_t{25} << 20, std::size_t FirstBytes = std::size_t{1} << 20>
struct bucketed : policy_traits {
    static_assert(Bytes >= 1 && FirstBytes >= 1,
                  "reduce::bucketed<Bytes, FirstBytes> needs buckets of at least one byte.");
    /// Target bytes of every bucket but the first.
    static constexpr std::size_t bucket_bytes = Bytes;
    /// Target bytes of the first bucket (the last tensors registered, the first gradients
    /// backward produces).
    static constexpr std::size_t first_bucket_bytes = std::min(FirstBytes, Bytes);
    static std::string name() {
        return "reduce::bucketed<" + std::to_string(Bytes) + ", " + std::to_string(FirstBytes) +
               ">";
    }
};

/// Synchronous parameter server: gradients are summed onto replica Root, Root applies the
/// optimizer (only Root holds optimizer state that moves), then broadcasts the parameters.
/// requires: 0 <= Root < replicas (checked at construction).
template <int Root = 0>
struct parameter_server : policy_traits {
    static_assert(Root >= 0, "reduce::parameter_server<Root> needs a non-negative root rank.");
    static constexpr int root = Root;
    static constexpr int update_root = Root;
    static std::string name() { return "reduce::parameter_server<" + std::to_string(Root) + ">"; }
};

/// Gradients cast to a 16-bit Wire type (lockstep::half or lockstep::bfloat16, rounded to
/// nearest even) for the wire; each replica sums one shard of every bucket in float in rank
/// order and rounds the sum to Wire (reduce-scatter by all_to_all), the rounded shards are
/// all-gathered, so every replica gets the same bits; applied in float. Halves the bytes each
/// replica sends; costs two roundings (each contribution and the sum: error <= u sum |g_r| +
/// u |sum g_r|, u = Wire::unit_roundoff). Needs a communicator with all_to_all.
template <class Wire>
struct compressed : policy_traits {
    static_assert(is_wire_float16_v<Wire>,
                  "reduce::compressed<Wire> sends gradients as 16-bit floats: Wire must be "
                  "lockstep::half or lockstep::bfloat16.");
    static constexpr bool rounds_on_wire = true;
    using wire_type = Wire;
    static std::string name() {
        return std::string("reduce::compressed<") +
               (std::is_same_v<Wire, half> ? "half" : "bfloat16") + ">";
    }
};

/// ZeRO stage 1 (sharded optimizer state): the flat parameter buffer is split into one
/// contiguous shard per replica, balanced by element count (replica r owns [o_r, o_r + c_r);
/// a shard is empty when there are fewer elements than replicas). The buckets are those of
/// reduce::bucketed<Bytes, FirstBytes>; each bucket is reduce-scattered (sum) so that every
/// replica receives, in place, the reduced gradient of the bucket's intersection with its own
/// shard. Replica r's optimizer holds state for its c_r elements only (about 1/N of the
/// unsharded optimizer state) and updates its shard; the updated shards are then all-gathered,
/// so every replica holds the same parameters bit for bit. LARS and LAMB combine their
/// per-tensor partial norms over replicas with one all_reduce of 2 x (tensors) doubles per step.
/// Works with sync::synchronous only (policy/compat.hpp).
/// requires: Bytes >= 1, FirstBytes >= 1.
template <std::size_t Bytes = std::size_t{25} << 20, std::size_t FirstBytes = std::size_t{1} << 20>
struct sharded : policy_traits {
    static_assert(Bytes >= 1 && FirstBytes >= 1,
                  "reduce::sharded<Bytes, FirstBytes> needs buckets of at least one byte.");
    static constexpr bool shards_optimizer_state = true;
    /// Target bytes of every bucket but the first (as reduce::bucketed).
    static constexpr std::size_t bucket_bytes = Bytes;
    /// Target bytes of the first bucket (as reduce::bucketed).
    static constexpr std::size_t first_bucket_bytes = std::min(FirstBytes, Bytes);
    static std::string name() {
        return "reduce::sharded<" + std::to_string(Bytes) + ", " + std::to_string(FirstBytes) + ">";
    }
};

} // namespace reduce

// --- reduce::reproducible -------------------------------------------------------------------

namespace reduce {

/// reduce::reproducible's default GatherValues.
inline constexpr std::size_t default_gather_values = std::size_t{1} << 16;

/// Results that do not depend on the replica count. Every global batch is cut into chunks of
/// ChunkSamples samples aligned to global positions, [k C, min((k + 1) C, global)) (the last one
/// may be shorter); whole chunks go to replicas, contiguously and balanced by chunk count (a
/// replica may get none). The step function is called once per chunk; the chunk gradients are
/// summed in fixed point anchored at each element's largest exponent (kernels/anchored_sum.hpp)
/// wherever every value of an element has arrived, and rounded once to T. How they travel
/// depends on the communicator: on the thread group, one all_combine pass at every size; on the
/// others, when replicas x (the busiest replica's chunks) x parameters <= GatherValues, one
/// all_gather brings every chunk to every replica, which sums every element itself (a small
/// network's step then pays for one collective instead of several); otherwise an all_to_all per
/// chunk index (on MPI, all_to_all_others, the owner reading its own values in place) brings
/// every replica's values of a block of elements to the block's owner, which sums its block,
/// and an all_gather returns the blocks. Either way an element's sum is a function of its
/// values alone, so the choice does not change a bit. The loss is the same anchored sum of
/// every chunk's loss. The communicator must have
/// all_to_all. Given the same global batches, seed and policies, and a network whose own kernels
/// are deterministic for a given input, the weights, optimizer state and BN running statistics
/// (bn::ghost<ChunkSamples>) are bitwise the same for every replica count.
/// requires: ChunkSamples >= 1; sync::synchronous; every BN layer bn::ghost<ChunkSamples>.
template <std::size_t ChunkSamples, std::size_t GatherValues = default_gather_values>
struct reproducible : policy_traits {
    static_assert(ChunkSamples >= 1,
                  "reduce::reproducible<ChunkSamples> needs chunks of at least one sample.");
    /// Samples per chunk (the last chunk of a global batch may be shorter).
    static constexpr std::size_t chunk_samples = ChunkSamples;
    /// The most values (replicas x chunks x parameters) the exchange gathers to every replica.
    static constexpr std::size_t gather_values = GatherValues;
    /// "reduce::reproducible<C>", with ", G" when GatherValues is not the default (replicas and
    /// checkpoints compare it: the exchanges differ).
    static std::string name() {
        return "reduce::reproducible<" + std::to_string(ChunkSamples) +
               (GatherValues == default_gather_values ? std::string()
                                                      : ", " + std::to_string(GatherValues)) +
               ">";
    }
};

/// The chunks [first, first + count) replica `rank` of `size` computes when a global batch of
/// `global` samples is cut into chunks of `chunk` samples (reduce::reproducible<chunk>'s plan,
/// which bn::ghost<chunk> layers follow): contiguous, balanced by chunk count (the first
/// replicas get one more chunk). requires: chunk >= 1, 0 <= rank < size: else, on the host,
/// lockstep::error (errc::invalid_argument) naming the values (in a constant expression it does
/// not compile; device code does not check).
struct chunk_run {
    std::size_t first;
    std::size_t count;
};
inline constexpr chunk_run chunks_of(std::size_t global, std::size_t chunk, int rank, int size) {
#if !defined(__CUDA_ARCH__)
    LOCKSTEP_REQUIRE(chunk >= 1 && size >= 1 && rank >= 0 && rank < size, errc::invalid_argument,
                     -1, "reduce::chunks_of", "chunk = ", chunk, ", rank = ", rank,
                     ", size = ", size, " (requires chunk >= 1 and 0 <= rank < size)");
#endif
    const std::size_t chunks = global / chunk + (global % chunk != 0 ? 1 : 0);
    const auto s = static_cast<std::size_t>(size), r = static_cast<std::size_t>(rank);
    const std::size_t base = chunks / s, extra = chunks % s;
    return {r * base + (r < extra ? r : extra), base + (r < extra ? 1 : 0)};
}

} // namespace reduce

/// A ReducePolicy is an empty tag with a `name()` (what checkpoints record and the
/// construction-time agreement check compares) and the traits of reduce::policy_traits (derive
/// from it and override what differs): what the trainer needs to know of it. What it does in a
/// step is its collective, a specialisation of train/detail's `collective<Policy, T,
/// Communicator>` (gradient_collective.hpp; docs/writing_a_reduce_policy.md).
template <class P>
concept reduce_policy = std::is_empty_v<P> && requires {
    { P::name() } -> std::convertible_to<std::string>;
    { P::update_root } -> std::convertible_to<int>;
    { P::shards_optimizer_state } -> std::convertible_to<bool>;
    { P::chunk_samples } -> std::convertible_to<std::size_t>;
    { P::rounds_on_wire } -> std::convertible_to<bool>;
};

} // namespace lockstep

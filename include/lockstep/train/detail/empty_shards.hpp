// lockstep/train/detail/empty_shards.hpp: the replicas whose step function saw no sample in a
// step, named in the error of a collective that some replicas skipped there.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/shard.hpp"

#include <cstddef>
#include <string>

namespace lockstep::detail {

/// The replicas of `size` that get no sample of a global batch of `global` in some call of the
/// step function (a micro-batch of `micro_batches`, or no chunk of `chunk_samples` under
/// reduce::reproducible when it is not 0), as "replica 3" or "replicas 2, 3"; empty when none.
inline std::string empty_shard_replicas(std::size_t global, std::size_t micro_batches,
                                        std::size_t chunk_samples, int size) {
    std::string out;
    int count = 0;
    for (int r = 0; r < size; ++r) {
        bool empty = false;
        if (chunk_samples > 0) {
            empty = reduce::chunks_of(global, chunk_samples, r, size).count == 0;
        } else {
            for (std::size_t m = 0; m < micro_batches && !empty; ++m) {
                const shard_range mb = micro_batch(global, m, micro_batches);
                empty = shard(mb.begin, mb.end, r, size).empty();
            }
        }
        if (empty) {
            out += (count == 0 ? "" : ", ") + std::to_string(r);
            ++count;
        }
    }
    return count == 0 ? out : (count == 1 ? "replica " : "replicas ") + out;
}

/// e, or (when e is a collective whose replicas called different collectives or counts, and some
/// replica's step function saw no sample) e with the empty shards named: the usual cause is a
/// communicating layer (batch norm) skipped on an empty shard. Rethrows.
[[noreturn]] inline void rethrow_naming_empty_shards(const error& e, std::size_t global,
                                                     std::size_t micro_batches,
                                                     std::size_t chunk_samples, int size) {
    const bool mismatch = e.code() == errc::shape_mismatch || e.code() == errc::count_mismatch ||
                          e.code() == errc::invalid_argument;
    const bool collective = e.operation().find(" #") != std::string::npos;
    const std::string empty = mismatch && collective
                                  ? empty_shard_replicas(global, micro_batches, chunk_samples, size)
                                  : std::string();
    if (empty.empty())
        throw e;
    throw error(e.code(), e.replica(), e.operation(),
                concat(e.details(), "; in this step the step function saw no sample on ", empty,
                       " (global batch ", global, " over ", size,
                       " replicas): it must still call every layer that communicates (batch norm: "
                       "forward_train and backward with 0 samples), or the replicas call "
                       "different collectives"));
}

} // namespace lockstep::detail

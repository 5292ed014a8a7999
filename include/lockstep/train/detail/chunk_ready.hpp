// lockstep/train/detail/chunk_ready.hpp: which parameter tensors the backward of one chunk has
// marked ready, so that each part of the flat gradient is taken exactly once: as it is marked,
// or with the rest after the step function returns. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// The ready marks of one chunk's backward over the parameter tensors of a registry network
/// (tensors in offset order, not overlapping, inside a flat gradient of n elements). Per chunk:
/// reset(); mark(t, take) for each replica_context::mark_ready; rest(take) after the step
/// function. take(first, count) is called once for each marked tensor (the first time it is
/// marked) and once for each maximal run of elements in no marked tensor (unmarked tensors and
/// anything between tensors), so together the calls cover [0, n) exactly once.
class chunk_ready {
public:
    chunk_ready(std::span<const tensor_info> tensors, std::size_t n, int rank)
        : tensors_(tensors), n_(n), rank_(rank), marked_(tensors.size(), 0) {}

    /// Starts a chunk: no tensor marked.
    void reset() { std::fill(marked_.begin(), marked_.end(), static_cast<unsigned char>(0)); }

    /// Tensor t is final for this chunk: take(offset, size) unless t was marked before.
    /// requires: t < the number of tensors (else lockstep::error, invalid_argument).
    template <class Take>
    void mark(std::size_t t, Take&& take) {
        LOCKSTEP_REQUIRE(t < marked_.size(), errc::invalid_argument, rank_, "mark_ready",
                         "tensor index ", t, " is not one of the ", marked_.size(),
                         " parameter tensors");
        if (marked_[t] != 0)
            return;
        marked_[t] = 1;
        take(tensors_[t].offset, tensors_[t].size);
    }

    /// After the step function: take(first, count) for each maximal run of [0, n) in no marked
    /// tensor.
    template <class Take>
    void rest(Take&& take) const {
        std::size_t at = 0;
        for (std::size_t t = 0; t < tensors_.size(); ++t) {
            if (marked_[t] == 0)
                continue;
            if (tensors_[t].offset > at)
                take(at, tensors_[t].offset - at);
            at = tensors_[t].offset + tensors_[t].size;
        }
        if (at < n_)
            take(at, n_ - at);
    }

private:
    std::span<const tensor_info> tensors_;
    std::size_t n_;
    int rank_;
    std::vector<unsigned char> marked_;
};

} // namespace lockstep::detail

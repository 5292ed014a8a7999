// lockstep/train/detail/bucket_plan.hpp: how a flat gradient buffer is cut into reduction pieces
// (per tensor or ~Bytes buckets, reverse registration order) and the in-order launch of pieces as
// their tensors become ready. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstddef>
#include <functional>
#include <vector>

namespace lockstep::detail {

/// One reduction piece: the contiguous elements [offset, offset + size) of the flat buffer,
/// covering tensors [first_tensor, last_tensor] (registration indices).
struct bucket {
    std::size_t offset = 0;
    std::size_t size = 0;
    std::size_t first_tensor = 0;
    std::size_t last_tensor = 0;
};

/// Buckets in launch order: tensors walked from the last registered to the first, a bucket
/// closed once it holds >= its target bytes (first_bytes for the first bucket, bytes for the
/// others). The last bucket launched is cut small as well: it holds the longest prefix of the
/// registration order (at least one tensor) whose bytes stay below first_bytes, because its
/// reduction is the one left exposed after backward ends (the first tensors registered are the
/// last gradients backward produces). Tensors are never split. Because the flat buffer is in
/// registration order, each bucket is one contiguous range. per-tensor reduction is
/// bytes = first_bytes = 1.
inline std::vector<bucket> plan_buckets(const std::vector<tensor_info>& tensors,
                                        std::size_t elem_bytes, std::size_t first_bytes,
                                        std::size_t bytes) {
    std::vector<bucket> out;
    if (tensors.empty())
        return out;
    auto make = [&](std::size_t first, std::size_t last) {
        bucket b;
        b.first_tensor = first;
        b.last_tensor = last;
        b.offset = tensors[first].offset;
        b.size = tensors[last].offset + tensors[last].size - b.offset;
        return b;
    };
    // The tail: tensors [0, tail) become the last bucket.
    std::size_t tail = 1;
    for (std::size_t held = tensors[0].size * elem_bytes;
         tail < tensors.size() && held + tensors[tail].size * elem_bytes < first_bytes; ++tail)
        held += tensors[tail].size * elem_bytes;
    std::size_t i = tensors.size();
    while (i > tail) {
        const std::size_t target = out.empty() ? first_bytes : bytes;
        const std::size_t last = i - 1;
        std::size_t held = 0;
        while (i > tail && (held == 0 || held < target)) {
            --i;
            held += tensors[i].size * elem_bytes;
        }
        out.push_back(make(i, last));
    }
    out.push_back(make(0, tail - 1));
    return out;
}

/// The buckets of a policy with `first_bucket_bytes` and `bucket_bytes` (reduce::bucketed<>,
/// reduce::sharded<>) over `tensors` of elements of `elem_bytes` bytes.
template <class Buckets>
std::vector<bucket> plan_buckets_of(const std::vector<tensor_info>& tensors,
                                    std::size_t elem_bytes) {
    return plan_buckets(tensors, elem_bytes, Buckets::first_bucket_bytes, Buckets::bucket_bytes);
}

/// The elements a flat buffer laid out as `tensors` spans: the largest offset + size.
inline std::size_t flat_extent(const std::vector<tensor_info>& tensors) noexcept {
    std::size_t n = 0;
    for (const tensor_info& t : tensors)
        n = t.offset + t.size > n ? t.offset + t.size : n;
    return n;
}

/// Tracks which tensors of the step are ready and launches buckets strictly in plan order, each
/// as soon as it and every bucket before it are complete: every replica then issues the same
/// collectives in the same order whatever order (or whether) it marks tensors ready.
class ordered_launcher {
public:
    ordered_launcher() = default;
    /// rank: the replica that errors name.
    ordered_launcher(std::vector<bucket> plan, std::size_t tensors, int rank)
        : plan_(std::move(plan)), bucket_of_(tensors, 0), pending_(plan_.size(), 0),
          ready_(tensors, false), rank_(rank) {
        for (std::size_t b = 0; b < plan_.size(); ++b)
            for (std::size_t t = plan_[b].first_tensor; t <= plan_[b].last_tensor; ++t)
                bucket_of_[t] = b;
        reset();
    }

    const std::vector<bucket>& plan() const noexcept { return plan_; }

    /// Starts a step: nothing ready, nothing launched.
    void reset() {
        next_ = 0;
        for (std::size_t b = 0; b < plan_.size(); ++b)
            pending_[b] = plan_[b].last_tensor - plan_[b].first_tensor + 1;
        ready_.assign(ready_.size(), false);
    }
    /// Marks tensor t ready (again is a no-op) and launches every bucket now launchable.
    template <class Launch>
    void mark_ready(std::size_t t, Launch&& launch) {
        LOCKSTEP_REQUIRE(t < ready_.size(), errc::invalid_argument, rank_, "mark_ready",
                         "tensor index ", t, " out of range (", ready_.size(), " parameters)");
        if (ready_[t])
            return;
        ready_[t] = true;
        --pending_[bucket_of_[t]];
        while (next_ < plan_.size() && pending_[next_] == 0)
            launch(plan_[next_++]);
    }
    /// Launches every bucket not launched yet, in order.
    template <class Launch>
    void finish(Launch&& launch) {
        while (next_ < plan_.size())
            launch(plan_[next_++]);
    }
    /// Buckets launched so far in this step.
    std::size_t launched() const noexcept { return next_; }

private:
    std::vector<bucket> plan_;
    std::vector<std::size_t> bucket_of_;
    std::vector<std::size_t> pending_;
    std::vector<bool> ready_;
    int rank_ = -1;
    std::size_t next_ = 0;
};

} // namespace lockstep::detail

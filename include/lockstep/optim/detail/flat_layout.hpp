// lockstep/optim/detail/flat_layout.hpp: segments cut into tiles, and the segmented drivers.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/kernels/segmented.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/system/buffer.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <thrust/copy.h>
#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>

namespace lockstep::optim::detail {

/// Elements per tile. Host: one thread runs a whole tile as a vectorized loop, so tiles are
/// large enough to amortise loading the segment's scalars and small enough to balance threads.
/// Device: one thread per element (kernels::tile_lanes), tiles of 1024 (32 warps share one tile
/// record). Keyed on is_host, not on the system type: the tile size is part of the layout
/// (the summation order of reduce()), the same for every system whose memory the host reads.
template <execution_system System>
inline constexpr std::size_t tile_elements = System::is_host ? 8192 : 1024;

/// Runs f over every element of the tiles (n elements in all): one lane per element on any
/// system (kernels::tile_lanes).
template <execution_system System, class F>
void apply_tiles(const System& sys, const kernels::tile* tiles, std::size_t tile_count,
                 std::size_t n, const F& f, const int* noop) {
    constexpr std::size_t ts = tile_elements<System>;
    kernels::for_each_index(sys, tile_count * ts, kernels::tile_lanes<F, ts>{tiles, f, noop}, n);
}

/// On the host system: one task per tile, a vectorized loop (kernels::tile_apply); the same
/// arithmetic per element as the lanes.
template <class F>
void apply_tiles(const host_system& sys, const kernels::tile* tiles, std::size_t tile_count,
                 std::size_t n, const F& f, const int* noop) {
    kernels::for_each_index(sys, tile_count, kernels::tile_apply<F>{tiles, f, noop}, n);
}

/// Copies a host vector into a new buffer in sys's memory.
template <class T, class System>
buffer<T, System> to_system(const std::vector<T>& v, const System& sys) {
    buffer<T, System> b(v.size(), sys);
    lockstep::copy(std::span<const T>(v), host_system{1}, b.span(), sys);
    return b;
}

/// The tiles, per-segment flags and per-segment tile ranges of a flat buffer of n elements.
template <execution_system System>
class flat_layout {
public:
    /// requires: segments sorted by offset, not overlapping, inside [0, n); an empty list means
    /// one segment [0, n) with decay and adapt. Throws lockstep::error (invalid_argument)
    /// naming `op` and the offending segment otherwise.
    flat_layout(std::size_t n, std::span<const tensor_segment> segments, const System& sys,
                const char* op)
        : n_(n) {
        if (segments.empty()) {
            segments_.push_back({0, n, true, true});
        } else {
            segments_.assign(segments.begin(), segments.end());
        }
        LOCKSTEP_REQUIRE(segments_.size() < std::numeric_limits<std::uint32_t>::max(),
                         errc::invalid_argument, -1, op, "too many segments: ", segments_.size());
        std::vector<kernels::tile> tiles;
        std::vector<kernels::segment_flags> flags;
        std::vector<kernels::tile_range> ranges;
        std::size_t end_prev = 0;
        for (std::size_t s = 0; s < segments_.size(); ++s) {
            const tensor_segment& seg = segments_[s];
            LOCKSTEP_REQUIRE(seg.offset <= n && seg.size <= n - seg.offset, errc::invalid_argument,
                             -1, op, "segment ", s, " [", seg.offset, ", ", seg.offset + seg.size,
                             ") exceeds the buffer of ", n, " elements");
            LOCKSTEP_REQUIRE(seg.offset >= end_prev, errc::invalid_argument, -1, op, "segment ", s,
                             " starts at ", seg.offset, ", before the end of segment ", s - 1, " (",
                             end_prev, "): segments must be sorted and not overlap");
            end_prev = seg.offset + seg.size;
            kernels::tile_range r{tiles.size(), tiles.size()};
            for (std::size_t b = seg.offset; b < end_prev; b += tile_elements<System>)
                tiles.push_back({b, std::min(end_prev, b + tile_elements<System>),
                                 static_cast<std::uint32_t>(s)});
            r.last = tiles.size();
            ranges.push_back(r);
            flags.push_back({seg.decay, seg.adapt});
        }
        tiles_ = to_system(tiles, sys);
        flags_ = to_system(flags, sys);
        ranges_ = to_system(ranges, sys);
    }

    std::size_t size() const noexcept { return n_; }
    std::size_t segment_count() const noexcept { return segments_.size(); }
    std::size_t tile_count() const noexcept { return tiles_.size(); }
    const std::vector<tensor_segment>& segments() const noexcept { return segments_; }
    const kernels::segment_flags* flags() const noexcept { return flags_.data(); }
    /// Runs f(s) for every segment s (per-tensor scalars such as trust ratios); nothing when
    /// the noop flag (an int in System memory, or null) is set when the kernel runs.
    template <class F>
    void for_each_segment(const System& sys, const F& f, const int* noop = nullptr) const {
        kernels::for_each_index(sys, segments_.size(), kernels::unless_noop<F>{f, noop},
                                segments_.size());
    }
    /// The tiles (System memory), in element order.
    const kernels::tile* tiles() const noexcept { return tiles_.data(); }

    /// Runs f over every segmented element in one pass: a for_each over the tiles on the host
    /// (a vectorized loop per tile), over the elements (one lane each) on a device. Nothing is
    /// touched when the noop flag (an int in System memory, or null) is set when the kernel
    /// runs: each tile (host) or lane (device) reads it once.
    template <class F>
    void apply(const System& sys, const F& f, const int* noop = nullptr) const {
        apply_tiles(sys, tiles_.data(), tiles_.size(), n_, f, noop);
    }

    /// Runs f (returning kernels::sum_pair) over every segmented element in one pass and writes
    /// the per-segment sums to out (segment_count() entries, System memory). Deterministic:
    /// the summation order depends on the layout only, never on the thread count. On every
    /// system it runs one task per tile (1024 elements on CUDA), then one per segment. When the
    /// noop flag (an int in System memory, or null) is set, f is not called and out is zero.
    /// partial is resized here only when it does not hold tile_count() entries (size it at
    /// construction so that steps never allocate).
    template <class F>
    void reduce(const System& sys, const F& f, buffer<kernels::sum_pair, System>& partial,
                kernels::sum_pair* out, const int* noop = nullptr) const {
        if (partial.size() != tiles_.size())
            partial = buffer<kernels::sum_pair, System>(tiles_.size(), sys);
        kernels::for_each_index(sys, tiles_.size(),
                                kernels::tile_reduce<F>{tiles_.data(), partial.data(), f, noop},
                                n_);
        kernels::for_each_index(sys, segments_.size(),
                                kernels::segment_sum{ranges_.data(), partial.data(), out},
                                tiles_.size());
    }

private:
    std::size_t n_;
    std::vector<tensor_segment> segments_;
    buffer<kernels::tile, System> tiles_;
    buffer<kernels::segment_flags, System> flags_;
    buffer<kernels::tile_range, System> ranges_;
};

/// A buffer of n elements in sys's memory, every one equal to value (zero by default).
template <class T, class System>
buffer<T, System> zeros(std::size_t n, const System& sys, T value = T(0)) {
    buffer<T, System> b(n, sys);
    kernels::with_policy_for(
        sys, n, [&](auto policy) { thrust::fill(policy, b.data(), b.data() + n, value); });
    return b;
}

/// Checks the sizes of a step's spans. Throws lockstep::error (shape_mismatch) naming op.
inline void check_step(const char* op, std::size_t n, std::size_t w, std::size_t g) {
    LOCKSTEP_REQUIRE(w == n && g == n, errc::shape_mismatch, -1, op,
                     "the optimizer holds state for ", n, " parameters, but step() got ", w,
                     " weights and ", g, " gradients");
}

/// Restores named buffers from a saved view: same slot count, names and sizes, else
/// lockstep::error (checkpoint) naming op. The saved spans must be in sys's memory.
template <class T, class System>
std::int64_t load_slots(const char* op, const state_view<const T>& saved, const state_view<T>& mine,
                        const System& sys) {
    LOCKSTEP_REQUIRE(saved.slots.size() == mine.slots.size(), errc::checkpoint, -1, op,
                     "the checkpoint has ", saved.slots.size(), " state buffers, this optimizer ",
                     mine.slots.size());
    LOCKSTEP_REQUIRE(saved.step >= 0, errc::checkpoint, -1, op, "negative step count ", saved.step);
    for (std::size_t k = 0; k < mine.slots.size(); ++k) {
        const auto& s = saved.slots[k];
        const auto& d = mine.slots[k];
        LOCKSTEP_REQUIRE(s.name == d.name && s.data.size() == d.data.size(), errc::checkpoint, -1,
                         op, "state buffer ", k, " is '", s.name, "' with ", s.data.size(),
                         " elements, expected '", d.name, "' with ", d.data.size());
    }
    for (std::size_t k = 0; k < mine.slots.size(); ++k) {
        const auto& s = saved.slots[k].data;
        if (s.data() != mine.slots[k].data.data())
            kernels::with_policy_for(sys, s.size(), [&](auto policy) {
                thrust::copy(policy, s.data(), s.data() + s.size(), mine.slots[k].data.data());
            });
    }
    return saved.step;
}

/// Throws lockstep::error (invalid_argument) naming op and the parameter when v is not finite
/// or below lo.
inline void check_param(const char* op, const char* name, double v, double lo) {
    LOCKSTEP_REQUIRE(is_finite(v) && v >= lo, errc::invalid_argument, -1, op, name, " = ", v,
                     " (must be finite and >= ", lo, ")");
}

/// As check_param, and within T's range: the steps compute in T, where a larger value would
/// be infinite.
template <class T>
void check_param(const char* op, const char* name, double v, double lo) {
    check_param(op, name, v, lo);
    const auto top = static_cast<double>(std::numeric_limits<T>::max());
    LOCKSTEP_REQUIRE(v <= top, errc::invalid_argument, -1, op, name, " = ", v,
                     " is infinite in the optimizer's ", sizeof(T) * 8,
                     "-bit floating point, the type its steps compute in (at most ", top, ")");
}

/// An epsilon added to a denominator: finite, and positive in T (a double below T's smallest
/// normal value becomes 0 or a subnormal there, which devices flush to 0: 0 / 0 in the step).
template <class T>
void check_eps(const char* op, double eps) {
    check_param<T>(op, "eps", eps, 0.0);
    const auto least = static_cast<double>(std::numeric_limits<T>::min());
    LOCKSTEP_REQUIRE(eps >= least, errc::invalid_argument, -1, op, "eps = ", eps,
                     " is 0 or subnormal in the optimizer's ", sizeof(T) * 8,
                     "-bit floating point, the type its steps compute in: use at least ", least);
}

} // namespace lockstep::optim::detail

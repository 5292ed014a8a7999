// lockstep/nn/layout.hpp: tensor shapes and the per-channel layouts nchw, nhwc and nc.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/checked_math.hpp"
#include "lockstep/kernels/channel_geometry.hpp"

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <initializer_list>
#include <ostream>
#include <span>

namespace lockstep::nn {

/// The extents of a tensor in memory order, of rank 0 to max_rank, e.g. {N, C, H, W}.
/// A rank above max_rank is remembered (so a layer can name it in its error) but its extents
/// are not.
class tensor_shape {
public:
    static constexpr std::size_t max_rank = 8;

    tensor_shape() = default;
    tensor_shape(std::initializer_list<std::size_t> dims)
        : tensor_shape(std::span<const std::size_t>(dims.begin(), dims.size())) {}
    explicit tensor_shape(std::span<const std::size_t> dims) : rank_(dims.size()) {
        std::copy_n(dims.begin(), std::min(dims.size(), max_rank), dims_.begin());
    }

    /// The number of axes.
    std::size_t rank() const noexcept { return rank_; }
    /// The extent of axis i. requires: i < min(rank(), max_rank).
    std::size_t operator[](std::size_t i) const noexcept { return dims_[i]; }
    /// The product of the extents (1 for rank 0); SIZE_MAX when the product overflows
    /// std::size_t (no span can have that many elements, so a size check against it fails).
    std::size_t elements() const noexcept {
        std::size_t n = 1;
        for (std::size_t i = 0; i < std::min(rank_, max_rank); ++i)
            if (mul_overflows(n, dims_[i], &n))
                return static_cast<std::size_t>(-1);
        return n;
    }
    /// True when the product of the extents overflows std::size_t.
    bool elements_overflow() const noexcept {
        std::size_t n = 1;
        for (std::size_t i = 0; i < std::min(rank_, max_rank); ++i)
            if (mul_overflows(n, dims_[i], &n))
                return true;
        return false;
    }

    friend bool operator==(const tensor_shape& a, const tensor_shape& b) {
        return a.rank_ == b.rank_ && a.dims_ == b.dims_;
    }
    /// Prints "(2, 3, 4, 5)".
    friend std::ostream& operator<<(std::ostream& os, const tensor_shape& s) {
        os << '(';
        for (std::size_t i = 0; i < std::min(s.rank_, max_rank); ++i)
            os << (i ? ", " : "") << s[i];
        if (s.rank_ > max_rank)
            os << ", ...";
        return os << ')';
    }

private:
    std::array<std::size_t, max_rank> dims_{};
    std::size_t rank_ = 0;
};

/// Layout (N, C, H, W): each (sample, channel) plane is contiguous. Shapes are {N, C, H, W}.
struct nchw {
    static constexpr std::size_t rank = 4;
    static constexpr std::size_t channel_axis = 1;
    static constexpr const char* name = "nchw";
    /// requires: s.rank() == rank. An empty plane (H or W 0) is an empty batch: outer 0, inner 1.
    static kernels::channel_geometry geometry(const tensor_shape& s) {
        const std::size_t plane = s[2] * s[3];
        return plane == 0 ? kernels::channel_geometry{0, s[1], 1}
                          : kernels::channel_geometry{s[0], s[1], plane};
    }
};

/// Layout (N, H, W, C): the channel is the fastest axis. Shapes are {N, H, W, C}.
struct nhwc {
    static constexpr std::size_t rank = 4;
    static constexpr std::size_t channel_axis = 3;
    static constexpr const char* name = "nhwc";
    static kernels::channel_geometry geometry(const tensor_shape& s) {
        return {s[0] * s[1] * s[2], s[3], 1};
    }
};

/// Layout (N, C) of fully connected features (BatchNorm1d). Shapes are {N, C}.
struct nc {
    static constexpr std::size_t rank = 2;
    static constexpr std::size_t channel_axis = 1;
    static constexpr const char* name = "nc";
    static kernels::channel_geometry geometry(const tensor_shape& s) { return {s[0], s[1], 1}; }
};

/// A per-channel tensor layout: its rank, which axis holds the channels, and the mapping of a
/// shape to the kernels' (outer, channels, inner) geometry. The batch is always axis 0.
template <class L>
concept tensor_layout = requires(const tensor_shape& s) {
    { L::rank } -> std::convertible_to<std::size_t>;
    { L::channel_axis } -> std::convertible_to<std::size_t>;
    { L::geometry(s) } -> std::same_as<kernels::channel_geometry>;
};

} // namespace lockstep::nn

// The segmented drivers under every optimizer: tiles cover exactly the segments, the per-element
// lane mapping (the CUDA shape) computes what the per-tile loop (the host shape) computes, and
// segmented norms match a naive double loop. SPDX-License-Identifier: Apache-2.0
#include "lockstep/kernels/optimizer_kernels.hpp"
#include "lockstep/kernels/segmented.hpp"
#include "lockstep/optim/detail/flat_layout.hpp"

#include "reference.hpp"

#include <catch2/catch.hpp>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include <cmath>
#include <vector>

using namespace lockstep;
using optim::detail::flat_layout;

namespace {
constexpr std::size_t ts = optim::detail::tile_elements<host_system>;
// Sizes straddling the tile size, a gap, an empty tensor and a one-element tensor.
const std::vector<tensor_segment> segs = {{0, ts - 1},          {ts - 1, ts + 1, false, true},
                                          {2 * ts + 5, 3 * ts}, {5 * ts + 5, 0},
                                          {5 * ts + 5, 1},      {5 * ts + 6, 17, true, false}};
constexpr std::size_t n = 5 * ts + 30; // 7 trailing padding elements
} // namespace

TEST_CASE("tiles cover every segment element exactly once and no gap", "[optim][kernels][host]") {
    const host_system sys(2);
    const flat_layout<host_system> layout(n, segs, sys, "test");
    std::vector<int> hits(n, 0);
    const kernels::tile* t = layout.tiles();
    for (std::size_t k = 0; k < layout.tile_count(); ++k) {
        CHECK(t[k].end - t[k].begin <= ts);
        CHECK(t[k].end > t[k].begin);
        const tensor_segment& s = segs[t[k].segment];
        CHECK(t[k].begin >= s.offset);
        CHECK(t[k].end <= s.offset + s.size);
        for (std::size_t i = t[k].begin; i < t[k].end; ++i)
            ++hits[i];
    }
    const auto id = ref::segment_of(n, segs);
    for (std::size_t i = 0; i < n; ++i)
        REQUIRE(hits[i] == (id[i] >= 0 ? 1 : 0));
}

TEMPLATE_TEST_CASE("the lane mapping computes what the tile loop computes",
                   "[optim][kernels][host]", float, double) {
    using T = TestType;
    const host_system sys(2);
    const flat_layout<host_system> layout(n, segs, sys, "test");
    const auto w0 = ref::normals(n, 3, 0, 0), g0 = ref::normals(n, 3, 1, 0);
    std::vector<T> w_tile(w0.begin(), w0.end()), w_lane(w0.begin(), w0.end());
    const std::vector<T> g(g0.begin(), g0.end());
    std::vector<T> m_tile(n, T(0.1)), v_tile(n, T(0.2)), m_lane = m_tile, v_lane = v_tile;
    const kernels::step_state<kernels::adam_scalars> step{
        .applied = 3, .skip = 0, .scalars = {.step_size = 0.05, .sqrt_bc2 = 0.3}};
    auto adam = [&](std::vector<T>& w, std::vector<T>& m, std::vector<T>& v) {
        return kernels::adam_update<T>{.w = w.data(),
                                       .g = g.data(),
                                       .m = m.data(),
                                       .v = v.data(),
                                       .flags = layout.flags(),
                                       .step = &step,
                                       .beta1 = T(0.9),
                                       .one_minus_beta1 = T(0.1),
                                       .beta2 = T(0.999),
                                       .one_minus_beta2 = T(0.001),
                                       .eps = T(1e-8),
                                       .weight_decay = T(0.01),
                                       .decay_factor = T(1) - T(1e-4),
                                       .decoupled = true};
    };
    layout.apply(sys, adam(w_tile, m_tile, v_tile));
    using F = kernels::adam_update<T>;
    thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                     thrust::counting_iterator<std::size_t>(layout.tile_count() * ts),
                     kernels::tile_lanes<F, ts>{layout.tiles(), adam(w_lane, m_lane, v_lane)});
    CHECK(w_tile == w_lane);
    CHECK(m_tile == m_lane);
    CHECK(v_tile == v_lane);
    // Padding is untouched by both.
    for (std::size_t i = n - 7; i < n; ++i)
        CHECK(w_lane[i] == static_cast<T>(w0[i]));
}

TEMPLATE_TEST_CASE("segmented norms match a naive double loop", "[optim][kernels][host]", float,
                   double) {
    using T = TestType;
    const host_system sys(2);
    const flat_layout<host_system> layout(n, segs, sys, "test");
    const auto w0 = ref::normals(n, 4, 0, 0), g0 = ref::normals(n, 4, 1, 0);
    const std::vector<T> w(w0.begin(), w0.end()), g(g0.begin(), g0.end());
    buffer<kernels::sum_pair> partial, out(segs.size());
    layout.reduce(sys, kernels::norm2_w_g<T>{w.data(), g.data()}, partial, out.data());
    // The reference squares the same T values in double: only the summation order differs, so
    // the sums agree to a few double roundings per term (1e-13 relative for <= 3 * 8192 terms).
    const auto id = ref::segment_of(n, segs);
    std::vector<double> sw(segs.size(), 0.0), sg(segs.size(), 0.0);
    for (std::size_t i = 0; i < n; ++i)
        if (id[i] >= 0) {
            sw[id[i]] += static_cast<double>(w[i]) * static_cast<double>(w[i]);
            sg[id[i]] += static_cast<double>(g[i]) * static_cast<double>(g[i]);
        }
    for (std::size_t k = 0; k < segs.size(); ++k) {
        CHECK(out[k].a == Approx(sw[k]).epsilon(1e-13).margin(0));
        CHECK(out[k].b == Approx(sg[k]).epsilon(1e-13).margin(0));
    }
    CHECK(out[3].a == 0.0); // the empty tensor
}

// bench/resnet_shaped.hpp: a network with ResNet-50's 161 parameter tensors whose backward burns
// a calibrated, memory-bound share of compute per tensor (ResNet-50's backward cost: weights x
// output pixels), for the benchmarks that train a network of its shape (bench_overlap,
// bench_checkpoint). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/parameter_registry.hpp"
#include "resnet50.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::bench_nets {

/// The backward's compute: a memory-bound pass over a per-replica scratch buffer (16 MiB, beyond
/// a core's L2), one float read-add-write per unit.
class burner {
public:
    explicit burner(std::size_t n = std::size_t{1} << 22) : s_(n, 1.0f) {}
    void run(std::size_t units) {
        while (units > 0) {
            const std::size_t k = std::min(units, s_.size() - pos_);
            float* p = s_.data() + pos_;
            for (std::size_t i = 0; i < k; ++i)
                p[i] += 1e-3f;
            pos_ = (pos_ + k) % s_.size();
            units -= k;
        }
    }

private:
    std::vector<float> s_;
    std::size_t pos_ = 0;
};

/// One replica's backward: per tensor the units to burn; shared by this replica's trainers.
struct workload {
    std::vector<tensor_info> tensors = bench_nets::resnet50_tensors();
    std::vector<double> share; ///< of the backward's cost, per tensor (sums to 1)
    std::vector<std::size_t> units;
    burner burn;
    workload() {
        const auto pixels = bench_nets::resnet50_output_pixels();
        double total = 0;
        for (std::size_t t = 0; t < tensors.size(); ++t)
            total += static_cast<double>(tensors[t].size * pixels[t]);
        for (std::size_t t = 0; t < tensors.size(); ++t)
            share.push_back(static_cast<double>(tensors[t].size * pixels[t]) / total);
        units.assign(tensors.size(), 0);
    }
    void set_total(double total_units) {
        for (std::size_t t = 0; t < units.size(); ++t)
            units[t] = static_cast<std::size_t>(total_units * share[t]);
    }
    std::size_t floats() const { return tensors.back().offset + tensors.back().size; }
};

/// Scales w's backward until a step takes target_ms: median_step(n) runs n steps and returns
/// their median in ms; replica 0's measure is broadcast over comm, so every replica burns the
/// same (3 rounds from a step with no backward compute).
template <class Comm, class MedianStep>
void calibrate(workload& w, Comm& comm, double target_ms, MedianStep&& median_step) {
    w.set_total(0);
    double bare = median_step(3); // the update, the checks: what the burner adds to
    double units = 1e8;           // about 30-100 ms on these cores
    for (int round = 0; round < 3; ++round) {
        w.set_total(units);
        double per_unit = std::max(median_step(3) - bare, 1.0) / units;
        comm.broadcast(std::span<double>(&per_unit, 1), 0);
        comm.broadcast(std::span<double>(&bare, 1), 0);
        units = std::max(target_ms - bare, 1.0) / per_unit;
    }
    w.set_total(units);
}

/// The user's network: ResNet-50's tensors from the registry.
template <class Context>
struct resnet_shaped {
    std::vector<typename Context::handle> params;
    workload* work;
    resnet_shaped(Context& ctx, workload& w) : work(&w) {
        for (const tensor_info& t : w.tensors)
            params.push_back(ctx.registry().add(t.name, t.shape));
    }
    /// Backward from the last tensor to the first: compute, gradient, mark_ready.
    void backward(Context& ctx) {
        const float g = 1e-4f * static_cast<float>(ctx.rank() + 1);
        for (std::size_t t = params.size(); t-- > 0;) {
            work->burn.run(work->units[t]);
            const std::span<float> grad = params[t].grad();
            std::fill(grad.begin(), grad.end(), g);
            ctx.mark_ready(params[t]);
        }
    }
};

} // namespace lockstep::bench_nets

// examples/digits/mlp.hpp: the user's network, 64 -> hidden -> batch norm -> ReLU -> dropout -> 10,
// written as a lockstep user writes it (own buffers, own forward/backward).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "digits_data.hpp"

#include <lockstep/nn/batch_norm.hpp>
#include <lockstep/nn/layout.hpp>
#include <lockstep/train/rng.hpp>
#include <lockstep/train/shard.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <tuple>
#include <vector>

namespace digits {

/// Which training sample a run-wide sample index names: epoch e = s / n visits the training set
/// in its own fixed shuffle (Fisher-Yates driven by Philox keyed by (seed, epoch)), so the data
/// order depends on the seed only, never on the replica count or the policies.
class sampler {
public:
    sampler(std::size_t n, std::size_t epochs, std::uint64_t seed) : n_(n) {
        const lockstep::rng_stream rng{seed, 0x5eed};
        order_.resize(n * epochs);
        for (std::size_t e = 0; e < epochs; ++e) {
            std::uint32_t* p = order_.data() + e * n;
            for (std::size_t i = 0; i < n; ++i)
                p[i] = static_cast<std::uint32_t>(i);
            for (std::size_t i = n - 1; i > 0; --i)
                std::swap(p[i], p[rng.bits(e, i) % (i + 1)]);
        }
    }
    /// The training-set index of run-wide sample s. requires: s < n * epochs.
    std::size_t operator()(std::uint64_t s) const { return order_[s]; }
    std::size_t size() const noexcept { return n_; }

private:
    std::size_t n_;
    std::vector<std::uint32_t> order_;
};

/// Sizes and knobs of the network.
struct mlp_options {
    int hidden = 128;
    float dropout = 0.1f;
    double bn_momentum = 0.1;
    std::uint64_t init_seed = 42;
};

/// The network. It owns its weights and gradients (plain std::vector) and its batch-norm layer
/// (nn::batch_norm with the BN policy of the run, which owns gamma/beta and the running
/// statistics); it tells lockstep about them through for_each_parameter / for_each_state.
/// Dropout masks come from the replica's Philox stream keyed by the GLOBAL sample index, so a
/// sample gets the same mask whichever replica processes it.
template <class BNPolicy>
class mlp {
public:
    using bn_policies = std::tuple<BNPolicy>;
    using batch_norm = lockstep::nn::batch_norm<float, BNPolicy, lockstep::nn::nc>;

    mlp(const mlp_options& o, lockstep::host_system sys)
        : o_(o), h_(static_cast<std::size_t>(o.hidden)), w1_(h_ * features), gw1_(w1_.size()),
          w2_(classes * h_), gw2_(w2_.size()), b2_(classes), gb2_(classes),
          bn_(std::make_unique<batch_norm>(
              h_, lockstep::nn::batch_norm_params{.momentum = o.bn_momentum}, sys)) {
        // PyTorch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from Philox.
        const lockstep::rng_stream init{o.init_seed, 1};
        auto uniform = [&](std::vector<float>& w, std::uint64_t layer, float fan_in) {
            const float bound = 1.0f / std::sqrt(fan_in);
            for (std::size_t i = 0; i < w.size(); ++i)
                w[i] = (2.0f * init.uniform(layer, i) - 1.0f) * bound;
        };
        uniform(w1_, 0, float(features));
        uniform(w2_, 1, float(h_));
        uniform(b2_, 2, float(h_));
    }

    /// f(name, values, gradients) for every trainable tensor, always in the same order.
    template <class F>
    void for_each_parameter(F&& f) {
        f("fc1.weight", std::span<float>(w1_), std::span<float>(gw1_));
        f("bn1.gamma", bn_->gamma(), bn_->dgamma());
        f("bn1.beta", bn_->beta(), bn_->dbeta());
        f("fc2.weight", std::span<float>(w2_), std::span<float>(gw2_));
        f("fc2.bias", std::span<float>(b2_), std::span<float>(gb2_));
    }
    /// f(name, values) for the state: BN running statistics.
    template <class F>
    void for_each_state(F&& f) {
        f("bn1.running_mean", bn_->running_mean());
        f("bn1.running_var", bn_->running_var());
    }

    /// Forward and backward over positions [r.begin, r.end) of the current global batch,
    /// ACCUMULATING gradients. Returns the sum of per-sample cross-entropy losses times
    /// r.scale. Runs (with zero samples) on an empty range too: BN policies that communicate
    /// need every replica.
    template <class Ctx>
    double train(Ctx& ctx, const dataset& d, const sampler& order, const lockstep::shard_range& r) {
        const std::size_t n = r.size();
        const std::size_t H = h_;
        x_.resize(n * features);
        for (std::size_t i = 0; i < n; ++i) {
            const std::size_t s = order(r.sample_index(r.begin + i));
            std::copy_n(d.x.begin() + static_cast<std::ptrdiff_t>(s * features), features,
                        x_.begin() + static_cast<std::ptrdiff_t>(i * features));
        }
        // fc1 (no bias: batch norm's beta is the bias)
        h1_.assign(n * H, 0.0f);
        for (std::size_t i = 0; i < n; ++i)
            for (std::size_t j = 0; j < H; ++j) {
                float acc = 0;
                const float* w = &w1_[j * features];
                const float* x = &x_[i * features];
                for (int k = 0; k < features; ++k)
                    acc += w[k] * x[k];
                h1_[i * H + j] = acc;
            }
        z_.resize(n * H);
        bn_->forward_train(ctx, std::span<const float>(h1_), {n, H}, std::span<float>(z_));
        // ReLU, then inverted dropout with masks keyed by the global sample index
        const lockstep::rng_stream drop = ctx.rng(0);
        const float p = o_.dropout, keep_scale = 1.0f / (1.0f - p);
        a_.resize(n * H);
        for (std::size_t i = 0; i < n; ++i) {
            const std::uint64_t g = r.sample_index(r.begin + i);
            for (std::size_t j = 0; j < H; ++j) {
                const float relu = std::max(z_[i * H + j], 0.0f);
                a_[i * H + j] = (p > 0 && !drop.keep(g, j, p)) ? 0.0f : relu * keep_scale;
            }
        }
        // fc2, softmax cross-entropy; dlogits = (softmax - onehot) * scale
        double loss = 0;
        dlogits_.resize(n * classes);
        for (std::size_t i = 0; i < n; ++i) {
            float logits[classes];
            float mx = -1e30f;
            for (int c = 0; c < classes; ++c) {
                float acc = b2_[c];
                const float* w = &w2_[c * H];
                const float* a = &a_[i * H];
                for (std::size_t j = 0; j < H; ++j)
                    acc += w[j] * a[j];
                logits[c] = acc;
                mx = std::max(mx, acc);
            }
            double sum = 0;
            for (int c = 0; c < classes; ++c)
                sum += std::exp(double(logits[c] - mx));
            const int y = d.y[order(r.sample_index(r.begin + i))];
            loss += std::log(sum) - double(logits[y] - mx);
            for (int c = 0; c < classes; ++c) {
                const double prob = std::exp(double(logits[c] - mx)) / sum;
                dlogits_[i * classes + c] = float((prob - (c == y ? 1.0 : 0.0)) * r.scale);
            }
        }
        // backward: fc2
        da_.assign(n * H, 0.0f);
        for (std::size_t i = 0; i < n; ++i)
            for (int c = 0; c < classes; ++c) {
                const float gl = dlogits_[i * classes + c];
                gb2_[c] += gl;
                float* gw = &gw2_[c * H];
                const float* w = &w2_[c * H];
                const float* a = &a_[i * H];
                float* da = &da_[i * H];
                for (std::size_t j = 0; j < H; ++j) {
                    gw[j] += gl * a[j];
                    da[j] += gl * w[j];
                }
            }
        // dropout and ReLU backward: a = relu(z) * mask / (1 - p)
        for (std::size_t i = 0; i < n * H; ++i)
            da_[i] = (z_[i] > 0.0f && a_[i] != 0.0f) ? da_[i] * keep_scale : 0.0f;
        // batch norm backward, then fc1
        dh_.resize(n * H);
        bn_->backward(ctx, std::span<const float>(da_), std::span<float>(dh_));
        for (std::size_t i = 0; i < n; ++i)
            for (std::size_t j = 0; j < H; ++j) {
                const float g = dh_[i * H + j];
                float* gw = &gw1_[j * features];
                const float* x = &x_[i * features];
                for (int k = 0; k < features; ++k)
                    gw[k] += g * x[k];
            }
        return loss * r.scale;
    }

    /// Test accuracy with the running statistics (no dropout).
    double accuracy(const dataset& d) {
        const std::size_t n = d.size(), H = h_;
        std::vector<float> h(n * H), z(n * H);
        for (std::size_t i = 0; i < n; ++i)
            for (std::size_t j = 0; j < H; ++j) {
                float acc = 0;
                for (int k = 0; k < features; ++k)
                    acc += w1_[j * features + k] * d.x[i * features + k];
                h[i * H + j] = acc;
            }
        bn_->forward_eval(std::span<const float>(h), {n, H}, std::span<float>(z));
        std::size_t correct = 0;
        for (std::size_t i = 0; i < n; ++i) {
            int best = 0;
            float best_v = -1e30f;
            for (int c = 0; c < classes; ++c) {
                float acc = b2_[c];
                for (std::size_t j = 0; j < H; ++j)
                    acc += w2_[c * H + j] * std::max(z[i * H + j], 0.0f);
                if (acc > best_v)
                    best_v = acc, best = c;
            }
            correct += best == d.y[i];
        }
        return double(correct) / double(n);
    }

private:
    mlp_options o_;
    std::size_t h_;
    std::vector<float> w1_, gw1_, w2_, gw2_, b2_, gb2_;
    std::unique_ptr<batch_norm> bn_; // the layer keeps internal pointers: keep it in place
    std::vector<float> x_, h1_, z_, a_, dlogits_, da_, dh_;
};

} // namespace digits

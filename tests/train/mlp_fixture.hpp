// tests/train/mlp_fixture.hpp: the test network of the train tests (fc -> batch norm -> ReLU ->
// dropout -> fc -> softmax cross-entropy), storable in the registry or in its own buffers (the
// visitor), and its deterministic data. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

namespace lockstep_test {

using namespace lockstep;

/// Sizes of the test network and its dropout probability.
struct mlp_shape {
    std::size_t in = 5, hidden = 8, out = 3;
    float dropout = 0.25f;
    bool batch_norm = true; ///< false: the BN layer is the identity (gamma/beta unused)
};

/// Feature k of the sample with run-wide index g (a standard normal, the same on every replica).
inline double feature(std::uint64_t g, std::size_t k) {
    return rng_stream{0xDA7A, 7}.normal(g, k);
}
/// The class of sample g.
inline std::size_t label(std::uint64_t g, std::size_t classes) {
    return rng_stream{0xDA7A, 8}.bits(g, 0) % classes;
}

/// Where the network keeps its parameters.
enum class storage { registry, visitor };

/// fc1 (no bias: BN removes it) -> batch_norm<BN> -> ReLU -> dropout (Philox keyed by the global
/// sample index) -> fc2 (+ bias) -> softmax cross-entropy. Initial weights depend on the rank,
/// so only the trainer's broadcast makes replicas agree. `poison` makes a gradient NaN.
template <class T, class Comm, storage S, class BN = bn::global>
class mlp {
public:
    using bn_policies = std::tuple<BN>;
    using ctx_type = replica_context<T, Comm>;
    using bn_type = nn::batch_norm<T, BN, nn::nc, typename Comm::system_type>;

    explicit mlp(ctx_type& ctx, mlp_shape sh = {}) : sh_(sh) {
        const std::size_t H = sh.hidden, I = sh.in, O = sh.out;
        if constexpr (S == storage::registry) {
            auto& reg = ctx.registry();
            w1_ = reg.add("fc1.weight", {H, I});
            gamma_ = reg.add("bn1.weight", {H});
            beta_ = reg.add("bn1.bias", {H});
            w2_ = reg.add("fc2.weight", {O, H});
            b2_ = reg.add("fc2.bias", {O});
            reg.finalize(); // the BN layer binds spans into the flat buffers below
            bn_.emplace(H,
                        typename bn_type::parameter_spans{gamma_.value(), beta_.value(),
                                                          gamma_.grad(), beta_.grad()},
                        typename bn_type::params{}, ctx.system());
        } else {
            for (auto* v : {&w1v_, &w1g_})
                v->assign(H * I, T(0));
            for (auto* v : {&w2v_, &w2g_})
                v->assign(O * H, T(0));
            for (auto* v : {&b2v_, &b2g_})
                v->assign(O, T(0));
            bn_.emplace(H, typename bn_type::params{}, ctx.system());
        }
        const rng_stream init{1000 + static_cast<std::uint64_t>(ctx.rank()), 0};
        for (std::size_t i = 0; i < H * I; ++i)
            w1()[i] = T(init.normal(0, i) / std::sqrt(I));
        for (std::size_t i = 0; i < O * H; ++i)
            w2()[i] = T(init.normal(1, i) / std::sqrt(H));
        for (std::size_t i = 0; i < O; ++i)
            b2()[i] = T(0.1 * init.normal(2, i));
        for (std::size_t i = 0; i < H; ++i) {
            bn_->gamma()[i] = T(1 + 0.1 * init.normal(3, i));
            bn_->beta()[i] = T(0.1 * init.normal(4, i));
        }
    }
    mlp(const mlp&) = delete;
    mlp& operator=(const mlp&) = delete;

    /// Forward and backward over positions [r.begin, r.end) of the step's global batch;
    /// accumulates gradients of (sum of losses) * r.scale and returns that loss.
    double train(const shard_range& r, ctx_type& ctx, bool mark_ready = true) {
        const std::size_t n = r.size(), H = sh_.hidden, I = sh_.in, O = sh_.out;
        const double keep_scale = 1.0 / (1.0 - sh_.dropout);
        const rng_stream drop = ctx.rng(1);
        std::vector<T> x(n * I), h(n * H), z(n * H), d(n * H), o(n * O);
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t k = 0; k < I; ++k)
                x[s * I + k] = T(feature(r.sample_index(r.begin + s), k));
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t j = 0; j < H; ++j) {
                T acc = 0;
                for (std::size_t k = 0; k < I; ++k)
                    acc += w1()[j * I + k] * x[s * I + k];
                h[s * H + j] = acc;
            }
        if (sh_.batch_norm)
            bn_->forward_train(ctx, std::span<const T>(h), nn::tensor_shape{n, H}, std::span<T>(z));
        else
            z = h;
        std::vector<char> keep(n * H);
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t j = 0; j < H; ++j) {
                keep[s * H + j] = drop.keep(r.sample_index(r.begin + s), j, sh_.dropout);
                const T a = z[s * H + j] > 0 ? z[s * H + j] : T(0);
                d[s * H + j] = keep[s * H + j] ? T(a * keep_scale) : T(0);
            }
        double loss = 0;
        std::vector<T> dout(n * O);
        for (std::size_t s = 0; s < n; ++s) {
            double mx = -1e300;
            for (std::size_t c = 0; c < O; ++c) {
                T acc = b2()[c];
                for (std::size_t j = 0; j < H; ++j)
                    acc += w2()[c * H + j] * d[s * H + j];
                o[s * O + c] = acc;
                mx = std::max(mx, double(acc));
            }
            double sum = 0;
            for (std::size_t c = 0; c < O; ++c)
                sum += std::exp(double(o[s * O + c]) - mx);
            const std::size_t y = label(r.sample_index(r.begin + s), O);
            loss += (mx + std::log(sum) - double(o[s * O + y])) * r.scale;
            for (std::size_t c = 0; c < O; ++c)
                dout[s * O + c] =
                    T((std::exp(double(o[s * O + c]) - mx) / sum - (c == y ? 1.0 : 0.0)) * r.scale);
        }
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t c = 0; c < O; ++c) {
                for (std::size_t j = 0; j < H; ++j)
                    w2g()[c * H + j] += dout[s * O + c] * d[s * H + j];
                b2g()[c] += dout[s * O + c];
            }
        if (poison)
            w2g()[0] = std::numeric_limits<T>::quiet_NaN();
        if constexpr (S == storage::registry)
            if (mark_ready) {
                ctx.mark_ready(b2_);
                ctx.mark_ready(w2_);
            }
        std::vector<T> dz(n * H), dh(n * H);
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t j = 0; j < H; ++j) {
                T acc = 0;
                for (std::size_t c = 0; c < O; ++c)
                    acc += w2()[c * H + j] * dout[s * O + c];
                const bool pass = keep[s * H + j] && z[s * H + j] > 0;
                dz[s * H + j] = pass ? T(acc * keep_scale) : T(0);
            }
        if (sh_.batch_norm)
            bn_->backward(ctx, std::span<const T>(dz), std::span<T>(dh));
        else
            dh = dz;
        if constexpr (S == storage::registry)
            if (mark_ready) {
                ctx.mark_ready(beta_);
                ctx.mark_ready(gamma_);
            }
        for (std::size_t s = 0; s < n; ++s)
            for (std::size_t j = 0; j < H; ++j)
                for (std::size_t k = 0; k < I; ++k)
                    w1g()[j * I + k] += dh[s * H + j] * x[s * I + k];
        if constexpr (S == storage::registry)
            if (mark_ready)
                ctx.mark_ready(w1_);
        return loss;
    }

    /// The visitor path (only with storage::visitor): same names and order as the registry.
    template <class F>
    requires(S == storage::visitor) void for_each_parameter(F&& f) {
        f("fc1.weight", std::span<T>(w1v_), std::span<T>(w1g_));
        f("bn1.weight", bn_->gamma(), bn_->dgamma());
        f("bn1.bias", bn_->beta(), bn_->dbeta());
        f("fc2.weight", std::span<T>(w2v_), std::span<T>(w2g_));
        f("fc2.bias", std::span<T>(b2v_), std::span<T>(b2g_));
    }
    /// The BN running statistics the layer owns (both paths).
    template <class F>
    void for_each_state(F&& f) {
        f("bn1.running_mean", bn_->running_mean());
        f("bn1.running_var", bn_->running_var());
    }

    bn_type& batch_norm() { return *bn_; }
    /// fc2.weight's values, as the network reads them (to write them from outside).
    std::span<T> output_weights() { return w2(); }
    bool poison = false;

private:
    std::span<T> w1() { return S == storage::registry ? w1_.value() : std::span<T>(w1v_); }
    std::span<T> w1g() { return S == storage::registry ? w1_.grad() : std::span<T>(w1g_); }
    std::span<T> w2() { return S == storage::registry ? w2_.value() : std::span<T>(w2v_); }
    std::span<T> w2g() { return S == storage::registry ? w2_.grad() : std::span<T>(w2g_); }
    std::span<T> b2() { return S == storage::registry ? b2_.value() : std::span<T>(b2v_); }
    std::span<T> b2g() { return S == storage::registry ? b2_.grad() : std::span<T>(b2g_); }

    mlp_shape sh_;
    typename ctx_type::handle w1_, gamma_, beta_, w2_, b2_;
    std::vector<T> w1v_, w1g_, w2v_, w2g_, b2v_, b2g_;
    std::optional<bn_type> bn_;
};

} // namespace lockstep_test

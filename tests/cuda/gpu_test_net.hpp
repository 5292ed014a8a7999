// The network of the GPU trainer tests: three bias-free linear layers, each followed by an
// nn::batch_norm, written once as __host__ __device__ functors that run on the device (cuda_system)
// and on the host (host_system), plus its double-precision reference. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/layout.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/replica_context.hpp"
#include "lockstep/train/shard.hpp"

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace lockstep_test::net {

inline constexpr std::size_t inputs = 6;  ///< features of a sample
inline constexpr std::size_t hidden = 12; ///< width of the two hidden layers
inline constexpr std::size_t outputs = 4; ///< regression targets per sample
inline constexpr double bn_eps = 1e-5;
inline constexpr double bn_momentum = 0.1;

/// The parameters in registration (and visiting) order.
enum tensor_id { w1, g1, be1, w2, g2, be2, w3, g3, be3, tensor_count };
inline constexpr std::array<const char*, tensor_count> tensor_names = {
    "fc1.weight", "bn1.weight", "bn1.bias",   "fc2.weight", "bn2.weight",
    "bn2.bias",   "fc3.weight", "bn3.weight", "bn3.bias"};
inline constexpr std::array<std::size_t, tensor_count> tensor_sizes = {
    hidden * inputs, hidden,          hidden,  hidden* hidden, hidden,
    hidden,          outputs* hidden, outputs, outputs};

/// Input feature j and target k of run-wide sample s (identical on the host and the device).
LOCKSTEP_HOST_DEVICE inline double input_value(std::uint64_t s, std::size_t j) {
    return std::sin(0.37 * static_cast<double>(s) + 1.3 * static_cast<double>(j)) +
           0.25 * static_cast<double>(j % 3);
}
LOCKSTEP_HOST_DEVICE inline double target_value(std::uint64_t s, std::size_t k) {
    return std::cos(0.21 * static_cast<double>(s) + 0.5 * static_cast<double>(k));
}

/// The initial value of element i of tensor id (BN: gamma = 1, beta = 0).
inline double initial_value(int id, std::size_t i) {
    if (id == g1 || id == g2 || id == g3)
        return 1.0;
    if (id == be1 || id == be2 || id == be3)
        return 0.0;
    const double fan_in = id == w1 ? double(inputs) : double(hidden);
    return std::sin(1.7 * double(i) + 0.3 * double(id) + 0.1) / std::sqrt(fan_in);
}

/// Per sample i of the shard: the inputs and targets of sample key(i) = base + i.
struct data_fn {
    float* x;
    float* t;
    std::uint64_t base;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        for (std::size_t j = 0; j < inputs; ++j)
            x[i * inputs + j] = static_cast<float>(input_value(base + i, j));
        for (std::size_t k = 0; k < outputs; ++k)
            t[i * outputs + k] = static_cast<float>(target_value(base + i, k));
    }
};

/// out[i, o] = sum_j w[o, j] in[i, j] (one task per output element).
struct linear_fn {
    const float* in;
    const float* w;
    float* out;
    std::size_t fan_in, fan_out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t e) const {
        const std::size_t i = e / fan_out, o = e % fan_out;
        float s = 0;
        for (std::size_t j = 0; j < fan_in; ++j)
            s += w[o * fan_in + j] * in[i * fan_in + j];
        out[e] = s;
    }
};

/// din[i, j] = sum_o w[o, j] dout[i, o].
struct linear_input_grad_fn {
    const float* dout;
    const float* w;
    float* din;
    std::size_t fan_in, fan_out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t e) const {
        const std::size_t i = e / fan_in, j = e % fan_in;
        float s = 0;
        for (std::size_t o = 0; o < fan_out; ++o)
            s += w[o * fan_in + j] * dout[i * fan_out + o];
        din[e] = s;
    }
};

/// dw[o, j] += sum_i dout[i, o] in[i, j] (accumulates over micro-batches).
struct linear_weight_grad_fn {
    const float* dout;
    const float* in;
    float* dw;
    std::size_t n, fan_in, fan_out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t e) const {
        const std::size_t o = e / fan_in, j = e % fan_in;
        float s = 0;
        for (std::size_t i = 0; i < n; ++i)
            s += dout[i * fan_out + o] * in[i * fan_in + j];
        dw[e] += s;
    }
};

/// a = max(z, 0).
struct relu_fn {
    const float* z;
    float* a;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t e) const { a[e] = z[e] > 0 ? z[e] : 0.0f; }
};
/// d *= (z > 0).
struct relu_grad_fn {
    const float* z;
    float* d;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t e) const {
        if (!(z[e] > 0))
            d[e] = 0.0f;
    }
};

/// Per sample: dy = (y - t) scale, loss[i] = 0.5 |y - t|^2.
struct squared_error_fn {
    const float* y;
    const float* t;
    float* dy;
    double* loss;
    double scale;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const {
        double l = 0;
        for (std::size_t k = 0; k < outputs; ++k) {
            const double e = double(y[i * outputs + k]) - double(t[i * outputs + k]);
            l += 0.5 * e * e;
            dy[i * outputs + k] = static_cast<float>(e * scale);
        }
        loss[i] = l;
    }
};
/// One task: *slot += scale * sum_i loss[i], summed in sample order (deterministic).
struct add_loss_fn {
    const double* loss;
    std::size_t n;
    double scale;
    double* slot;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t) const {
        double s = 0;
        for (std::size_t i = 0; i < n; ++i)
            s += loss[i];
        *slot += s * scale;
    }
};

template <class System, class F>
void launch(const System& sys, std::size_t n, F f) {
    if (n != 0)
        thrust::for_each(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                         thrust::counting_iterator<std::size_t>(n), f);
}

/// How a test wants the step to behave.
struct knobs {
    bool fixed_data = false; ///< key the data by batch position only (the same batch every step)
    int throw_at_step = -1;  ///< with throw_rank: throw lockstep::error after bn1's forward
    int throw_rank = -1;
    /// Mark no gradient ready (the trainer reduces every bucket after the step function): the
    /// bucket collectives then follow all of BN's backward collectives, another host order than
    /// marking each gradient as it becomes final.
    bool skip_marks = false;
};

/// The network on Comm's system with BN statistics policy BN. Visitor = false: parameters in the
/// replica's registry (path (a)); true: in the network's own buffers of Comm's system, exposed
/// through for_each_parameter (path (b)), in the same order under the same names.
/// The step function (train) enqueues only kernels and the layers' collectives: no host copies,
/// no allocation (every buffer is sized for `capacity` samples per replica at construction).
template <class Comm, class BN, bool Visitor = false>
class test_net {
public:
    using system_type = typename Comm::system_type;
    using context_type = lockstep::replica_context<float, Comm>;
    using bn_policies = std::tuple<BN>;
    using bn_type = lockstep::nn::batch_norm<float, BN, lockstep::nn::nc, system_type>;

    /// requires: capacity >= the largest shard of any step.
    test_net(context_type& ctx, std::size_t capacity, knobs k = {})
        : k_(k), cap_(capacity), sys_(ctx.system()), x_(cap_ * inputs, sys_),
          t_(cap_ * outputs, sys_), h1_(cap_ * hidden, sys_), z1_(h1_.size(), sys_),
          a1_(h1_.size(), sys_), h2_(h1_.size(), sys_), z2_(h1_.size(), sys_),
          a2_(h1_.size(), sys_), h3_(cap_ * outputs, sys_), y_(h3_.size(), sys_),
          dy_(h3_.size(), sys_), da_(h1_.size(), sys_), db_(h1_.size(), sys_),
          loss_(cap_ == 0 ? 1 : cap_, sys_) {
        if constexpr (Visitor) {
            for (int id = 0; id < tensor_count; ++id) {
                std::vector<float> init(tensor_sizes[id]);
                for (std::size_t i = 0; i < init.size(); ++i)
                    init[i] = static_cast<float>(initial_value(id, i));
                own_values_[id] = lockstep::buffer<float, system_type>(init.size(), sys_);
                own_grads_[id] = lockstep::buffer<float, system_type>(init.size(), sys_);
                lockstep::copy(std::span<const float>(init), lockstep::host_system{},
                               own_values_[id].span(), sys_);
                values_[id] = own_values_[id].span();
                grads_[id] = own_grads_[id].span();
            }
        } else {
            auto& reg = ctx.registry();
            std::array<typename context_type::handle, tensor_count> h;
            for (int id = 0; id < tensor_count; ++id) {
                h[id] = reg.add(tensor_names[id], {tensor_sizes[id]});
                for (std::size_t i = 0; i < tensor_sizes[id]; ++i)
                    h[id].value()[i] = static_cast<float>(initial_value(id, i));
            }
            reg.finalize();
            for (int id = 0; id < tensor_count; ++id) {
                values_[id] = h[id].value();
                grads_[id] = h[id].grad();
                handles_[id] = h[id];
            }
        }
        const lockstep::nn::batch_norm_params bp{.eps = bn_eps, .momentum = bn_momentum};
        bn_[0].emplace(ctx.comm(), hidden, spans(g1, be1), bp);
        bn_[1].emplace(ctx.comm(), hidden, spans(g2, be2), bp);
        bn_[2].emplace(ctx.comm(), outputs, spans(g3, be3), bp);
    }
    test_net(const test_net&) = delete;
    test_net& operator=(const test_net&) = delete;

    /// Path (b): the parameters in registration order.
    template <class F>
    requires Visitor void for_each_parameter(F&& f) {
        for (int id = 0; id < tensor_count; ++id)
            f(std::string(tensor_names[id]), values_[id], grads_[id]);
    }

    /// The layers' running statistics (checkpoints carry them; a save refuses to leave them out).
    template <class F>
    void for_each_state(F&& f) {
        for (int layer = 0; layer < 3; ++layer) {
            const std::string bn = "bn" + std::to_string(layer + 1);
            f(bn + ".running_mean", bn_[layer]->running_mean());
            f(bn + ".running_var", bn_[layer]->running_var());
        }
    }

    knobs& options() noexcept { return k_; }
    bn_type& bn(int layer) { return *bn_[layer]; }

    /// Forward and backward of the shard r; adds this replica's loss (sum of per-sample losses
    /// times r.scale) into ctx.loss_slot() on the device. Returns nothing: the loss never comes
    /// back to the host inside the step.
    void train(const lockstep::shard_range& r, context_type& ctx) {
        using lockstep::nn::tensor_shape;
        const std::size_t n = r.size();
        LOCKSTEP_REQUIRE(n <= cap_, lockstep::errc::invalid_argument, ctx.rank(), "test_net",
                         "shard of ", n, " samples, capacity ", cap_);
        const std::uint64_t base = k_.fixed_data ? r.begin : r.sample_index(r.begin);
        launch(sys_, n, data_fn{x_.data(), t_.data(), base});
        const tensor_shape hs{n, hidden}, os{n, outputs};
        const std::size_t nh = n * hidden, no = n * outputs;

        launch(sys_, nh, linear_fn{x_.data(), values_[w1].data(), h1_.data(), inputs, hidden});
        bn_[0]->forward_train(ctx, cspan(h1_, nh), hs, span(z1_, nh));
        if (ctx.step() == k_.throw_at_step && ctx.rank() == k_.throw_rank)
            lockstep::fail(lockstep::errc::internal, ctx.rank(), "test_net.train",
                           "failure injected after bn1's forward in step ", ctx.step());
        launch(sys_, nh, relu_fn{z1_.data(), a1_.data()});
        launch(sys_, nh, linear_fn{a1_.data(), values_[w2].data(), h2_.data(), hidden, hidden});
        bn_[1]->forward_train(ctx, cspan(h2_, nh), hs, span(z2_, nh));
        launch(sys_, nh, relu_fn{z2_.data(), a2_.data()});
        launch(sys_, no, linear_fn{a2_.data(), values_[w3].data(), h3_.data(), hidden, outputs});
        bn_[2]->forward_train(ctx, cspan(h3_, no), os, span(y_, no));

        launch(sys_, n, squared_error_fn{y_.data(), t_.data(), dy_.data(), loss_.data(), r.scale});
        if (ctx.loss_slot() != nullptr)
            launch(sys_, 1, add_loss_fn{loss_.data(), n, r.scale, ctx.loss_slot()});

        // Backward: each layer's gradients are marked ready as soon as they are final, so the
        // bucket reductions interleave with the BN layers' backward collectives.
        bn_[2]->backward(ctx, cspan(dy_, no), span(da_, no)); // da = dh3
        mark(ctx, g3);
        mark(ctx, be3);
        launch(
            sys_, hidden * outputs,
            linear_weight_grad_fn{da_.data(), a2_.data(), grads_[w3].data(), n, hidden, outputs});
        mark(ctx, w3);
        launch(sys_, nh,
               linear_input_grad_fn{da_.data(), values_[w3].data(), db_.data(), hidden, outputs});
        launch(sys_, nh, relu_grad_fn{z2_.data(), db_.data()});
        bn_[1]->backward(ctx, cspan(db_, nh), span(da_, nh)); // da = dh2
        mark(ctx, g2);
        mark(ctx, be2);
        launch(sys_, hidden * hidden,
               linear_weight_grad_fn{da_.data(), a1_.data(), grads_[w2].data(), n, hidden, hidden});
        mark(ctx, w2);
        launch(sys_, nh,
               linear_input_grad_fn{da_.data(), values_[w2].data(), db_.data(), hidden, hidden});
        launch(sys_, nh, relu_grad_fn{z1_.data(), db_.data()});
        bn_[0]->backward(ctx, cspan(db_, nh), span(da_, nh)); // da = dh1
        mark(ctx, g1);
        mark(ctx, be1);
        launch(sys_, hidden * inputs,
               linear_weight_grad_fn{da_.data(), x_.data(), grads_[w1].data(), n, inputs, hidden});
        mark(ctx, w1);
    }

private:
    using buf = lockstep::buffer<float, system_type>;
    static std::span<float> span(buf& b, std::size_t n) { return b.span().first(n); }
    static std::span<const float> cspan(buf& b, std::size_t n) {
        return std::span<const float>(b.span().first(n));
    }
    typename bn_type::parameter_spans spans(int g, int b) {
        // gamma and beta were initialised above (initial_value): the layers train from them.
        return {values_[g], values_[b], grads_[g], grads_[b], lockstep::nn::initial_values::keep};
    }
    void mark(context_type& ctx, int id) {
        if constexpr (!Visitor)
            if (!k_.skip_marks)
                ctx.mark_ready(handles_[id]);
    }

    knobs k_;
    std::size_t cap_;
    system_type sys_;
    buf x_, t_, h1_, z1_, a1_, h2_, z2_, a2_, h3_, y_, dy_, da_, db_;
    lockstep::buffer<double, system_type> loss_;
    std::array<buf, tensor_count> own_values_, own_grads_;
    std::array<std::span<float>, tensor_count> values_{}, grads_{};
    std::array<typename context_type::handle, tensor_count> handles_{};
    std::array<std::optional<bn_type>, 3> bn_;
};

/// The same network in double on the host over the whole global batch, trained with SGD
/// (momentum as torch.optim.SGD): the independent reference.
class reference {
public:
    reference() {
        for (int id = 0; id < tensor_count; ++id) {
            v_[id].resize(tensor_sizes[id]);
            m_[id].assign(tensor_sizes[id], 0.0);
            for (std::size_t i = 0; i < tensor_sizes[id]; ++i)
                v_[id][i] = static_cast<double>(static_cast<float>(initial_value(id, i)));
        }
    }

    /// One SGD step on the samples keys[0..B); returns the mean loss.
    double step(const std::vector<std::uint64_t>& keys, double lr, double momentum) {
        const std::size_t B = keys.size();
        std::vector<double> x(B * inputs), t(B * outputs);
        for (std::size_t i = 0; i < B; ++i) {
            for (std::size_t j = 0; j < inputs; ++j)
                x[i * inputs + j] = static_cast<float>(input_value(keys[i], j));
            for (std::size_t k = 0; k < outputs; ++k)
                t[i * outputs + k] = static_cast<float>(target_value(keys[i], k));
        }
        std::array<std::vector<double>, tensor_count> g;
        for (int id = 0; id < tensor_count; ++id)
            g[id].assign(tensor_sizes[id], 0.0);
        const auto h1 = linear(x, v_[w1], B, inputs, hidden);
        bn_cache c1, c2, c3;
        const auto z1 = bn_forward(h1, B, hidden, v_[g1], v_[be1], c1);
        const auto a1 = relu(z1);
        const auto h2 = linear(a1, v_[w2], B, hidden, hidden);
        const auto z2 = bn_forward(h2, B, hidden, v_[g2], v_[be2], c2);
        const auto a2 = relu(z2);
        const auto h3 = linear(a2, v_[w3], B, hidden, outputs);
        const auto y = bn_forward(h3, B, outputs, v_[g3], v_[be3], c3);
        double loss = 0;
        std::vector<double> dy(y.size());
        for (std::size_t e = 0; e < y.size(); ++e) {
            const double d = y[e] - t[e];
            loss += 0.5 * d * d / double(B);
            dy[e] = d / double(B);
        }
        auto dh3 = bn_backward(dy, B, outputs, v_[g3], c3, g[g3], g[be3]);
        weight_grad(dh3, a2, B, hidden, outputs, g[w3]);
        auto da2 = input_grad(dh3, v_[w3], B, hidden, outputs);
        relu_grad(z2, da2);
        auto dh2 = bn_backward(da2, B, hidden, v_[g2], c2, g[g2], g[be2]);
        weight_grad(dh2, a1, B, hidden, hidden, g[w2]);
        auto da1 = input_grad(dh2, v_[w2], B, hidden, hidden);
        relu_grad(z1, da1);
        auto dh1 = bn_backward(da1, B, hidden, v_[g1], c1, g[g1], g[be1]);
        weight_grad(dh1, x, B, inputs, hidden, g[w1]);
        for (int id = 0; id < tensor_count; ++id)
            for (std::size_t i = 0; i < tensor_sizes[id]; ++i) {
                m_[id][i] = steps_ == 0 ? g[id][i] : momentum * m_[id][i] + g[id][i];
                v_[id][i] -= lr * (momentum != 0 ? m_[id][i] : g[id][i]);
            }
        ++steps_;
        return loss;
    }

    /// The parameters, flat in registration order.
    std::vector<double> parameters() const {
        std::vector<double> out;
        for (const auto& v : v_)
            out.insert(out.end(), v.begin(), v.end());
        return out;
    }

private:
    struct bn_cache {
        std::vector<double> xhat, invstd;
    };
    static std::vector<double> linear(const std::vector<double>& in, const std::vector<double>& w,
                                      std::size_t B, std::size_t fi, std::size_t fo) {
        std::vector<double> out(B * fo, 0.0);
        for (std::size_t i = 0; i < B; ++i)
            for (std::size_t o = 0; o < fo; ++o)
                for (std::size_t j = 0; j < fi; ++j)
                    out[i * fo + o] += w[o * fi + j] * in[i * fi + j];
        return out;
    }
    static std::vector<double> input_grad(const std::vector<double>& dout,
                                          const std::vector<double>& w, std::size_t B,
                                          std::size_t fi, std::size_t fo) {
        std::vector<double> din(B * fi, 0.0);
        for (std::size_t i = 0; i < B; ++i)
            for (std::size_t o = 0; o < fo; ++o)
                for (std::size_t j = 0; j < fi; ++j)
                    din[i * fi + j] += w[o * fi + j] * dout[i * fo + o];
        return din;
    }
    static void weight_grad(const std::vector<double>& dout, const std::vector<double>& in,
                            std::size_t B, std::size_t fi, std::size_t fo,
                            std::vector<double>& dw) {
        for (std::size_t i = 0; i < B; ++i)
            for (std::size_t o = 0; o < fo; ++o)
                for (std::size_t j = 0; j < fi; ++j)
                    dw[o * fi + j] += dout[i * fo + o] * in[i * fi + j];
    }
    static std::vector<double> relu(const std::vector<double>& z) {
        std::vector<double> a(z.size());
        for (std::size_t e = 0; e < z.size(); ++e)
            a[e] = z[e] > 0 ? z[e] : 0.0;
        return a;
    }
    static void relu_grad(const std::vector<double>& z, std::vector<double>& d) {
        for (std::size_t e = 0; e < z.size(); ++e)
            if (!(z[e] > 0))
                d[e] = 0.0;
    }
    static std::vector<double> bn_forward(const std::vector<double>& x, std::size_t B,
                                          std::size_t C, const std::vector<double>& gamma,
                                          const std::vector<double>& beta, bn_cache& c) {
        std::vector<double> y(x.size());
        c.xhat.resize(x.size());
        c.invstd.resize(C);
        for (std::size_t ch = 0; ch < C; ++ch) {
            double mean = 0, var = 0;
            for (std::size_t i = 0; i < B; ++i)
                mean += x[i * C + ch] / double(B);
            for (std::size_t i = 0; i < B; ++i)
                var += (x[i * C + ch] - mean) * (x[i * C + ch] - mean) / double(B);
            c.invstd[ch] = 1.0 / std::sqrt(var + bn_eps);
            for (std::size_t i = 0; i < B; ++i) {
                c.xhat[i * C + ch] = (x[i * C + ch] - mean) * c.invstd[ch];
                y[i * C + ch] = c.xhat[i * C + ch] * gamma[ch] + beta[ch];
            }
        }
        return y;
    }
    static std::vector<double> bn_backward(const std::vector<double>& dy, std::size_t B,
                                           std::size_t C, const std::vector<double>& gamma,
                                           const bn_cache& c, std::vector<double>& dgamma,
                                           std::vector<double>& dbeta) {
        std::vector<double> dx(dy.size());
        for (std::size_t ch = 0; ch < C; ++ch) {
            double sum_dy = 0, sum_dy_xhat = 0;
            for (std::size_t i = 0; i < B; ++i) {
                sum_dy += dy[i * C + ch];
                sum_dy_xhat += dy[i * C + ch] * c.xhat[i * C + ch];
            }
            dgamma[ch] += sum_dy_xhat;
            dbeta[ch] += sum_dy;
            for (std::size_t i = 0; i < B; ++i)
                dx[i * C + ch] = gamma[ch] * c.invstd[ch] *
                                 (dy[i * C + ch] - sum_dy / double(B) -
                                  c.xhat[i * C + ch] * sum_dy_xhat / double(B));
        }
        return dx;
    }

    std::array<std::vector<double>, tensor_count> v_, m_;
    std::int64_t steps_ = 0;
};

} // namespace lockstep_test::net

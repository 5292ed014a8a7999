// Naive double-precision reference optimizers for the tests, from the published equations.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/optim/optimizer.hpp"
#include "lockstep/train/rng.hpp"

#include <cmath>
#include <cstddef>
#include <vector>

namespace ref {

using vec = std::vector<double>;

/// For each element: the index of its segment, or -1 in a gap.
inline std::vector<int> segment_of(std::size_t n, const std::vector<lockstep::tensor_segment>& s) {
    std::vector<int> id(n, -1);
    if (s.empty()) {
        for (auto& x : id)
            x = 0;
        return id;
    }
    for (std::size_t k = 0; k < s.size(); ++k)
        for (std::size_t i = s[k].offset; i < s[k].offset + s[k].size; ++i)
            id[i] = static_cast<int>(k);
    return id;
}
inline bool decays(const std::vector<lockstep::tensor_segment>& s, int k) {
    return s.empty() || s[k].decay;
}
inline bool adapts(const std::vector<lockstep::tensor_segment>& s, int k) {
    return s.empty() || s[k].adapt;
}
inline std::size_t count(const std::vector<lockstep::tensor_segment>& s) {
    return s.empty() ? 1 : s.size();
}

/// torch.optim.SGD.
struct sgd {
    double lr, mu, damp, wd;
    bool nesterov;
    std::vector<lockstep::tensor_segment> segs;
    vec b = {};
    long t = 0;
    void step(vec& w, const vec& g) {
        const auto id = segment_of(w.size(), segs);
        if (b.empty())
            b.assign(w.size(), 0.0);
        for (std::size_t i = 0; i < w.size(); ++i) {
            if (id[i] < 0)
                continue;
            double d = g[i] + (decays(segs, id[i]) ? wd : 0.0) * w[i];
            if (mu != 0) {
                b[i] = t == 0 ? d : mu * b[i] + (1 - damp) * d;
                d = nesterov ? d + mu * b[i] : b[i];
            }
            w[i] -= lr * d;
        }
        ++t;
    }
};

/// torch.optim.Adam (decoupled = false) and torch.optim.AdamW (decoupled = true).
struct adam {
    double lr, b1, b2, eps, wd;
    bool decoupled;
    std::vector<lockstep::tensor_segment> segs;
    vec m = {}, v = {};
    long t = 0;
    void step(vec& w, const vec& g) {
        const auto id = segment_of(w.size(), segs);
        if (m.empty())
            m.assign(w.size(), 0.0), v.assign(w.size(), 0.0);
        ++t;
        for (std::size_t i = 0; i < w.size(); ++i) {
            if (id[i] < 0)
                continue;
            const double lam = decays(segs, id[i]) ? wd : 0.0;
            double gi = g[i];
            if (decoupled)
                w[i] *= 1 - lr * lam;
            else
                gi += lam * w[i];
            m[i] = b1 * m[i] + (1 - b1) * gi;
            v[i] = b2 * v[i] + (1 - b2) * gi * gi;
            const double mhat = m[i] / (1 - std::pow(b1, t));
            const double vhat = v[i] / (1 - std::pow(b2, t));
            w[i] -= lr * mhat / (std::sqrt(vhat) + eps);
        }
    }
};

/// Per-segment Euclidean norm of x.
inline vec norms(const vec& x, const std::vector<int>& id, std::size_t segments) {
    vec s(segments, 0.0);
    for (std::size_t i = 0; i < x.size(); ++i)
        if (id[i] >= 0)
            s[id[i]] += x[i] * x[i];
    for (auto& e : s)
        e = std::sqrt(e);
    return s;
}

/// LARS (You, Gitman, Ginsburg 2017, Algorithm 1, with eps in the denominator).
struct lars {
    double lr, mu, eta, wd, eps;
    std::vector<lockstep::tensor_segment> segs;
    vec v = {}, trust = {};
    void step(vec& w, const vec& g) {
        const auto id = segment_of(w.size(), segs);
        if (v.empty())
            v.assign(w.size(), 0.0);
        const vec wn = norms(w, id, count(segs)), gn = norms(g, id, count(segs));
        trust.assign(count(segs), 1.0);
        for (std::size_t k = 0; k < trust.size(); ++k) {
            const double lam = decays(segs, static_cast<int>(k)) ? wd : 0.0;
            if (adapts(segs, static_cast<int>(k)) && wn[k] > 0 && gn[k] > 0)
                trust[k] = eta * wn[k] / (gn[k] + lam * wn[k] + eps);
        }
        for (std::size_t i = 0; i < w.size(); ++i) {
            if (id[i] < 0)
                continue;
            const double lam = decays(segs, id[i]) ? wd : 0.0;
            v[i] = mu * v[i] + lr * trust[id[i]] * (g[i] + lam * w[i]);
            w[i] -= v[i];
        }
    }
};

/// LAMB (You et al. 2019, Algorithm 2, Adam moments with bias correction, phi = clamp).
struct lamb {
    double lr, b1, b2, eps, wd, phi_min, phi_max;
    std::vector<lockstep::tensor_segment> segs;
    vec m = {}, v = {}, trust = {};
    long t = 0;
    void step(vec& w, const vec& g) {
        const auto id = segment_of(w.size(), segs);
        if (m.empty())
            m.assign(w.size(), 0.0), v.assign(w.size(), 0.0);
        ++t;
        vec r(w.size(), 0.0);
        for (std::size_t i = 0; i < w.size(); ++i) {
            if (id[i] < 0)
                continue;
            m[i] = b1 * m[i] + (1 - b1) * g[i];
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
            const double mhat = m[i] / (1 - std::pow(b1, t));
            const double vhat = v[i] / (1 - std::pow(b2, t));
            r[i] = mhat / (std::sqrt(vhat) + eps) + (decays(segs, id[i]) ? wd : 0.0) * w[i];
        }
        const vec wn = norms(w, id, count(segs)), rn = norms(r, id, count(segs));
        trust.assign(count(segs), 1.0);
        for (std::size_t k = 0; k < trust.size(); ++k)
            if (adapts(segs, static_cast<int>(k)) && wn[k] > 0 && rn[k] > 0)
                trust[k] = std::fmin(std::fmax(wn[k], phi_min), phi_max) / rn[k];
        for (std::size_t i = 0; i < w.size(); ++i)
            if (id[i] >= 0)
                w[i] -= lr * trust[id[i]] * r[i];
    }
};

/// Deterministic test data: x[i] = scale * N(0, 1) from the Philox stream (seed, stream),
/// sample `sample`.
inline vec normals(std::size_t n, std::uint64_t seed, std::uint32_t stream, std::uint64_t sample,
                   double scale = 1.0) {
    const lockstep::rng_stream rng{seed, stream};
    vec x(n);
    for (std::size_t i = 0; i < n; ++i)
        x[i] = scale * rng.normal(sample, i);
    return x;
}

} // namespace ref

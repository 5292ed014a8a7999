// lockstep/kernels/moments.hpp: per-channel moments (count, mean, M2), the Welford step and
// Chan's merge, as host/device functors. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <cmath>
#include <cstddef>
#include <type_traits>

namespace lockstep::kernels {

/// The type statistics are accumulated in: double for double data, float for everything else
/// (float, and half/bfloat16 storage on the CUDA system).
template <class T>
using accumulation_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// The first two moments of a set of values, in the form that merges stably: the count, the
/// mean and M2 = sum of squared deviations from the mean (variance = M2 / count).
/// The count is kept in the floating-point type Acc so that moments travel through one
/// collective of one type; it is exact up to 2^24 (float) or 2^53 (double) values per replica.
template <class Acc>
struct moments {
    Acc count = 0;
    Acc mean = 0;
    Acc m2 = 0;
};

/// One Welford step shared by every path: adds x to a running (mean, m2) whose count, after
/// adding x, is 1 / inv_count. Lanes that advance in lockstep share one reciprocal, which is
/// what lets the host fast path vectorize it.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline void welford_accumulate(Acc& mean, Acc& m2, Acc x, Acc inv_count) {
    const Acc delta = x - mean;
    mean += delta * inv_count;
    m2 += delta * (x - mean);
}

/// Adds one value to m with a Welford step. ensures: m describes the old values and x.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline void welford_update(moments<Acc>& m, Acc x) {
    m.count += Acc(1);
    welford_accumulate(m.mean, m.m2, x, Acc(1) / m.count);
}

/// Chan, Golub and LeVeque's pairwise merge: the moments of the union of two disjoint sets.
/// Exact when either side is empty (the other side is returned bit for bit), so empty replicas
/// and empty partitions change nothing. Not commutative in rounding: merge in a fixed order.
struct chan_merge {
    template <class Acc>
    LOCKSTEP_HOST_DEVICE moments<Acc> operator()(const moments<Acc>& a,
                                                 const moments<Acc>& b) const {
        if (b.count == Acc(0))
            return a;
        if (a.count == Acc(0))
            return b;
        const Acc n = a.count + b.count;
        const Acc delta = b.mean - a.mean;
        const Acc wb = b.count / n;
        moments<Acc> r;
        r.count = n;
        r.mean = a.mean + delta * wb;
        r.m2 = a.m2 + b.m2 + delta * delta * (a.count * wb);
        return r;
    }
};

/// The moments of one channel from the (count, mean, M2) of its parts, without a division per
/// part (the GPU rows kernels' fold of a channel's partitions): sums about a shift K that every
/// fold of the channel shares (there: its first partition's mean), S1 = sum n (mean - K) and
/// S2 = sum M2 + n (mean - K)^2, in double; then mean = K + S1 / N and M2 = S2 - S1^2 / N. The
/// subtraction costs log2(1 + (mean - K)^2 / variance) of double's 53 bits, so a float result
/// stays within its rounding unless K lies beyond 2^14 standard deviations from the mean. Folds
/// of disjoint parts with the same shift combine by operator+ (exactly, in any fixed order).
struct shifted_moments {
    double shift = 0;
    double count = 0;
    double s1 = 0;
    double s2 = 0;

    /// Adds a part of n values with the given mean and M2.
    LOCKSTEP_HOST_DEVICE void add(double n, double mean, double m2) {
        const double d = mean - shift;
        count += n;
        s1 += n * d;
        s2 += m2 + n * d * d;
    }
    /// The sums of two folds about the same shift.
    LOCKSTEP_HOST_DEVICE shifted_moments operator+(const shifted_moments& o) const {
        return {shift, count + o.count, s1 + o.s1, s2 + o.s2};
    }
    /// (count, mean, M2) of everything added; all zero when nothing was.
    LOCKSTEP_HOST_DEVICE moments<double> result() const {
        if (count == 0)
            return {};
        const double d = s1 / count;
        const double m2 = s2 - s1 * d;
        return {count, shift + d, m2 > 0 ? m2 : 0.0};
    }
};

/// Moments of `lanes` Welford lanes that all saw `per_lane` values (the lane layout of the host
/// fast path), merged in lane order into acc.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline moments<Acc>
merge_lanes(moments<Acc> acc, const Acc* mean, const Acc* m2, std::size_t lanes, Acc per_lane) {
    const chan_merge merge;
    for (std::size_t j = 0; j < lanes; ++j)
        acc = merge(acc, moments<Acc>{per_lane, mean[j], m2[j]});
    return acc;
}

/// V lanes of moments that take a batch of up to B values each at a time (the CUDA planes
/// moments: a batch is a thread's loads in flight). Each lane sums the batch's deviations from
/// its running mean (for the first batch, from the batch's first value) and their squares, and
/// merges the batch in with Chan's formula: the batch's mean less the running one is the mean
/// deviation (a multiply by 1 / B for a full batch, B a power of two), its M2 the squares less
/// the deviation sum times that. One division a batch where a Welford step took a reciprocal a
/// value, and deviations from a nearby value, so large means do not cancel.
template <class Acc, int V>
struct batched_lanes {
    Acc mean[V] = {};
    Acc m2[V] = {};
    Acc count = 0; ///< values each lane has seen

    /// Adds values 0, ..., n - 1 of the batch to every lane (0 < n <= B); value(u, v) writes
    /// value u of each lane into v[0], ..., v[V - 1].
    template <int B, class Value>
    LOCKSTEP_HOST_DEVICE void add(int n, Value value) {
        static_assert(B > 0 && (B & (B - 1)) == 0, "a full batch's mean is a multiply by 1 / B");
        if (count == Acc(0))
            value(0, mean); // the first batch's shift, merged below with weight 1
        Acc s1[V] = {};
        Acc s2[V] = {};
        for (int u = 0; u < B; ++u) {
            if (u < n) {
                Acc v[V];
                value(u, v);
                for (int j = 0; j < V; ++j) {
                    const Acc d = v[j] - mean[j];
                    s1[j] += d;
                    s2[j] += d * d;
                }
            }
        }
        const Acc k = Acc(n);
        const Acc inv_k = n == B ? Acc(1) / Acc(B) : Acc(1) / k;
        const Acc total = count + k;
        const Acc w = k / total; // the batch's weight: 1 for the first batch
        for (int j = 0; j < V; ++j) {
            const Acc d = s1[j] * inv_k; // the batch's mean less the running one
            mean[j] += d * w;
            m2[j] += (s2[j] - s1[j] * d) + d * d * (count * w);
        }
        count = total;
    }
    /// The lanes merged in lane order (empty when nothing was added).
    LOCKSTEP_HOST_DEVICE moments<Acc> result() const {
        return merge_lanes(moments<Acc>{}, mean, m2, count > Acc(0) ? V : 0, count);
    }
};

/// 1 / sqrt(v) in the precision of Acc, usable in device code.
template <class Acc>
LOCKSTEP_HOST_DEVICE inline Acc inverse_sqrt(Acc v) {
    if constexpr (std::is_same_v<Acc, float>) {
        return 1.0f / ::sqrtf(v);
    } else {
        return Acc(1) / static_cast<Acc>(::sqrt(static_cast<double>(v)));
    }
}

} // namespace lockstep::kernels

// The shared __host__ __device__ kernels on cuda_system: batch norm (local and, over NCCL,
// global statistics; float, double, half and bfloat16 storage) and every optimizer, compared
// with the same code on host_system, and skipping a step on a device flag. Compiled by nvcc in
// CI; GPU cases skip without a device.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/step_checks.hpp"
#include "lockstep/train/step_state.hpp"

#include "cuda_test_support.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

namespace {

using namespace lockstep;

// Tolerances: the host (OpenMP loops) and the GPU (Thrust/CUB) reduce in different orders and
// the GPU contracts a*b+c into FMAs, so float results agree to a few float ulps of the values
// involved (|x| <= ~10 here, sums over <= 10^4 terms): 1e-4 relative to (1 + |value|) covers it
// with margin; double agrees to 1e-10. half/bfloat16 storage is compared with the float layer
// on the same (exactly representable) input, to the storage type's rounding: 2^-10 / 2^-7
// relative plus the float tolerance.
template <class T>
constexpr double tolerance() {
    if constexpr (std::is_same_v<T, double>)
        return 1e-10;
    else if constexpr (std::is_same_v<T, lockstep::half>)
        return 2e-3;
    else if constexpr (std::is_same_v<T, lockstep::bfloat16>)
        return 1.6e-2;
    else
        return 1e-4;
}

template <class T>
double as_double(T v) {
    return static_cast<double>(static_cast<float>(v));
}
double as_double(double v) {
    return v;
}

template <class T>
T from_double(double v) {
    if constexpr (std::is_same_v<T, double>)
        return v;
    else
        return T(static_cast<float>(v));
}

/// A value per element, different per seed, of order 1 around `offset`.
double wave(std::size_t i, unsigned seed, double offset = 0.0) {
    return offset + std::sin(0.37 * static_cast<double>(i) + 1.3 * seed) +
           0.25 * std::cos(0.011 * static_cast<double>(i * (seed + 2)));
}

template <class T>
std::vector<T> wave_vector(std::size_t n, unsigned seed, double offset = 0.0) {
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i)
        v[i] = from_double<T>(wave(i, seed, offset));
    return v;
}

template <class T>
buffer<T, cuda_system> to_device(const std::vector<T>& h, const cuda_system& sys) {
    buffer<T, cuda_system> d(h.size(), sys);
    copy(std::span<const T>(h), host_system{}, d.span(), sys);
    return d;
}

template <class T>
std::vector<double> device_values(std::span<const T> d, const cuda_system& sys) {
    std::vector<T> h(d.size());
    copy(d, sys, std::span<T>(h), host_system{});
    std::vector<double> out(h.size());
    for (std::size_t i = 0; i < h.size(); ++i)
        out[i] = as_double(h[i]);
    return out;
}

template <class T>
std::vector<double> host_values(std::span<const T> h) {
    std::vector<double> out(h.size());
    for (std::size_t i = 0; i < h.size(); ++i)
        out[i] = as_double(h[i]);
    return out;
}

/// max over i of |a - b| / (1 + |b|).
double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
        worst = std::max(worst, std::abs(a[i] - b[i]) / (1.0 + std::abs(b[i])));
    return worst;
}

using lockstep_test::all_devices;
using lockstep_test::run_replicas;

/// The outputs of one batch-norm training step (forward_train then backward) and one
/// forward_eval, as doubles.
struct bn_results {
    std::vector<double> y, dx, dgamma, dbeta, running_mean, running_var, y_eval;
};

const nn::batch_norm_params bn_options{.eps = 1e-3, .momentum = 0.25};

/// The host reference: float or double data, the same layer on host_system.
template <class T, class Policy, class Layout, class Comm>
bn_results host_bn(Comm& comm, const std::vector<T>& x, const std::vector<T>& dy,
                   const nn::tensor_shape& shape, std::size_t channels) {
    nn::batch_norm<T, Policy, Layout> layer(channels, bn_options);
    for (std::size_t c = 0; c < channels; ++c) {
        layer.gamma()[c] = static_cast<T>(0.5 + 0.25 * c);
        layer.beta()[c] = static_cast<T>(0.1 * c - 0.2);
    }
    std::vector<T> y(x.size()), dx(x.size()), y_eval(x.size());
    layer.forward_train(comm, std::span<const T>(x), shape, std::span<T>(y));
    layer.backward(comm, std::span<const T>(dy), std::span<T>(dx));
    layer.forward_eval(std::span<const T>(x), shape, std::span<T>(y_eval));
    return {host_values<T>(y),
            host_values<T>(dx),
            host_values<T>(layer.dgamma()),
            host_values<T>(layer.dbeta()),
            host_values<T>(layer.running_mean()),
            host_values<T>(layer.running_var()),
            host_values<T>(y_eval)};
}

/// The same step on cuda_system (comm.system()), with T storage and param_type parameters.
template <class T, class Policy, class Layout>
bn_results device_bn(nccl_communicator& comm, const std::vector<T>& x, const std::vector<T>& dy,
                     const nn::tensor_shape& shape, std::size_t channels) {
    using layer_t = nn::batch_norm<T, Policy, Layout, cuda_system>;
    using P = typename layer_t::param_type;
    const cuda_system sys = comm.system();
    layer_t layer(channels, bn_options, sys);
    std::vector<P> gamma(channels), beta(channels);
    for (std::size_t c = 0; c < channels; ++c) {
        gamma[c] = static_cast<P>(0.5 + 0.25 * c);
        beta[c] = static_cast<P>(0.1 * c - 0.2);
    }
    copy(std::span<const P>(gamma), host_system{}, layer.gamma(), sys);
    copy(std::span<const P>(beta), host_system{}, layer.beta(), sys);
    auto x_dev = to_device(x, sys), dy_dev = to_device(dy, sys);
    buffer<T, cuda_system> y(x.size(), sys), dx(x.size(), sys), y_eval(x.size(), sys);
    layer.forward_train(comm, std::span<const T>(x_dev.span()), shape, y.span());
    layer.backward(comm, std::span<const T>(dy_dev.span()), dx.span());
    layer.forward_eval(std::span<const T>(x_dev.span()), shape, y_eval.span());
    comm.synchronize();
    return {device_values<T>(y.span(), sys),
            device_values<T>(dx.span(), sys),
            device_values<P>(layer.dgamma(), sys),
            device_values<P>(layer.dbeta(), sys),
            device_values<P>(layer.running_mean(), sys),
            device_values<P>(layer.running_var(), sys),
            device_values<T>(y_eval.span(), sys)};
}

/// host_bn<T, bn::local, Layout> on a single host replica (a thread group of one).
template <class T, class Layout>
bn_results host_reference(const std::vector<T>& x, const std::vector<T>& dy,
                          const nn::tensor_shape& shape, std::size_t channels) {
    bn_results out;
    thread_group group(1);
    group.run([&](thread_communicator& comm) {
        out = host_bn<T, bn::local, Layout>(comm, x, dy, shape, channels);
    });
    return out;
}

void check_close(const bn_results& got, const bn_results& want, double tol) {
    CHECK(max_rel_diff(got.y, want.y) <= tol);
    CHECK(max_rel_diff(got.dx, want.dx) <= tol);
    CHECK(max_rel_diff(got.dgamma, want.dgamma) <= tol);
    CHECK(max_rel_diff(got.dbeta, want.dbeta) <= tol);
    CHECK(max_rel_diff(got.running_mean, want.running_mean) <= tol);
    CHECK(max_rel_diff(got.running_var, want.running_var) <= tol);
    CHECK(max_rel_diff(got.y_eval, want.y_eval) <= tol);
}

template <class T, class L>
struct bn_case {
    using value_type = T;
    using layout = L;
};

template <class L>
nn::tensor_shape make_shape(std::size_t n, std::size_t c, std::size_t h, std::size_t w) {
    if constexpr (std::is_same_v<L, nn::nchw>)
        return {n, c, h, w};
    else if constexpr (std::is_same_v<L, nn::nhwc>)
        return {n, h, w, c};
    else
        return {n * h * w, c};
}

} // namespace

TEMPLATE_TEST_CASE("batch_norm<bn::local> on cuda_system matches host_system",
                   "[nn][bn][cuda][gpu]", (bn_case<float, nn::nchw>), (bn_case<float, nn::nhwc>),
                   (bn_case<float, nn::nc>), (bn_case<double, nn::nchw>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    if (lockstep_test::skip_without_gpu())
        return;
    const int zero = 0;
    auto comms = nccl_communicator::init_all(std::span<const int>(&zero, 1));
    const std::size_t channels = 5;
    const auto shape = make_shape<L>(6, channels, 7, 9);
    const auto x = wave_vector<T>(shape.elements(), 1, 3.0);
    const auto dy = wave_vector<T>(shape.elements(), 2);
    const auto want = host_reference<T, L>(x, dy, shape, channels);
    const auto got = device_bn<T, bn::local, L>(comms[0], x, dy, shape, channels);
    check_close(got, want, tolerance<T>());
}

TEMPLATE_TEST_CASE("batch_norm with 16-bit storage on cuda_system follows the float layer",
                   "[nn][bn][cuda][gpu]", lockstep::half, lockstep::bfloat16) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    const int zero = 0;
    auto comms = nccl_communicator::init_all(std::span<const int>(&zero, 1));
    const std::size_t channels = 3;
    const nn::tensor_shape shape{4, channels, 5, 6};
    // Inputs rounded to T first, so both layers see the same values.
    const auto x16 = wave_vector<T>(shape.elements(), 3, 1.0);
    const auto dy16 = wave_vector<T>(shape.elements(), 4);
    std::vector<float> x(x16.size()), dy(dy16.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = static_cast<float>(x16[i]);
        dy[i] = static_cast<float>(dy16[i]);
    }
    const auto want = device_bn<float, bn::local, nn::nchw>(comms[0], x, dy, shape, channels);
    const auto got = device_bn<T, bn::local, nn::nchw>(comms[0], x16, dy16, shape, channels);
    check_close(got, want, tolerance<T>());
}

// Needs two replicas or more: with one, its shard is the whole batch and no empty shard exists
// (one replica's bn::global over NCCL against a double reference: test_bn_nccl.cu).
TEST_CASE("batch_norm<bn::global> over NCCL equals one replica with the whole batch",
          "[nn][bn][nccl][gpu][multi_gpu]") {
    if (lockstep_test::skip_without_multi_gpu())
        return;
    auto comms = all_devices();
    const std::size_t replicas = comms.size(), channels = 4, h = 3, w = 5;
    REQUIRE(replicas >= 2);
    // Uneven shards with an empty one: sizes cycle through {5, 0, 3, 8}.
    const std::size_t pattern[] = {5, 0, 3, 8};
    std::vector<std::size_t> first(replicas + 1, 0);
    for (std::size_t r = 0; r < replicas; ++r)
        first[r + 1] = first[r] + pattern[r % 4];
    const std::size_t total = first[replicas];
    const std::size_t plane = channels * h * w; // one NCHW sample
    const auto x = wave_vector<float>(total * plane, 5, -2.0);
    const auto dy = wave_vector<float>(total * plane, 6);

    std::vector<bn_results> per_replica(replicas);
    run_replicas(comms, [&](nccl_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::size_t n = first[r + 1] - first[r];
        const std::vector<float> xs(x.begin() + first[r] * plane, x.begin() + first[r + 1] * plane);
        const std::vector<float> dys(dy.begin() + first[r] * plane,
                                     dy.begin() + first[r + 1] * plane);
        per_replica[r] =
            device_bn<float, bn::global, nn::nchw>(comm, xs, dys, {n, channels, h, w}, channels);
    });
    // The reference: one host replica with the whole (concatenated) batch.
    const bn_results want =
        host_reference<float, nn::nchw>(x, dy, {total, channels, h, w}, channels);
    std::vector<double> dgamma(channels, 0.0), dbeta(channels, 0.0);
    for (std::size_t r = 0; r < replicas; ++r) {
        const auto& got = per_replica[r];
        const auto slice = [&](const std::vector<double>& v) {
            return std::vector<double>(v.begin() + first[r] * plane,
                                       v.begin() + first[r + 1] * plane);
        };
        CHECK(max_rel_diff(got.y, slice(want.y)) <= tolerance<float>());
        CHECK(max_rel_diff(got.dx, slice(want.dx)) <= tolerance<float>());
        CHECK(max_rel_diff(got.y_eval, slice(want.y_eval)) <= tolerance<float>());
        CHECK(max_rel_diff(got.running_mean, want.running_mean) <= tolerance<float>());
        CHECK(max_rel_diff(got.running_var, want.running_var) <= tolerance<float>());
        // Identical on every replica, bit for bit (they are computed from the same merge).
        CHECK(got.running_mean == per_replica[0].running_mean);
        CHECK(got.running_var == per_replica[0].running_var);
        for (std::size_t c = 0; c < channels; ++c) {
            dgamma[c] += got.dgamma[c];
            dbeta[c] += got.dbeta[c];
        }
    }
    CHECK(max_rel_diff(dgamma, want.dgamma) <= tolerance<float>());
    CHECK(max_rel_diff(dbeta, want.dbeta) <= tolerance<float>());
}

namespace {

const tensor_segment segments[] = {{.offset = 0, .size = 6000, .decay = true, .adapt = true},
                                   {.offset = 6000, .size = 4007, .decay = false, .adapt = false}};
constexpr std::size_t n_params = 10007;

/// Five steps of optimizer O<T, System> from the same weights and gradients on both systems.
template <template <class, class> class O, class T, class Params>
void check_optimizer(const Params& p) {
    const cuda_system sys(0);
    const auto w0 = wave_vector<T>(n_params, 7, 0.5);
    std::vector<T> w_host = w0;
    auto w_dev = to_device(w0, sys);
    O<T, host_system> on_host(n_params, p, host_system{}, segments);
    O<T, cuda_system> on_device(n_params, p, sys, segments);
    for (unsigned step = 0; step < 5; ++step) {
        const auto g = wave_vector<T>(n_params, 11 + step);
        auto g_dev = to_device(g, sys);
        on_host.step(std::span<T>(w_host), std::span<const T>(g));
        on_device.step(w_dev.span(), std::span<const T>(g_dev.span()));
    }
    sys.synchronize();
    CHECK(on_device.step_count() == 5);
    CHECK(max_rel_diff(device_values<T>(w_dev.span(), sys), host_values<T>(w_host)) <=
          tolerance<T>());
    CHECK(all_finite(std::span<const T>(w_dev.span()), sys));
}

/// Host copies of everything an optimizer step on cuda_system may change: the weights, the step
/// count, every state slot and (LARS, LAMB) the trust ratios; compared bytewise.
template <class T>
struct device_snapshot {
    std::vector<T> w;
    std::int64_t step = 0;
    std::vector<std::vector<T>> slots;
    std::vector<double> trust;
};

template <class V>
bool same_bits(const std::vector<V>& a, const std::vector<V>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0);
}

template <class T>
bool same_bits(const device_snapshot<T>& a, const device_snapshot<T>& b) {
    if (a.step != b.step || a.slots.size() != b.slots.size() || !same_bits(a.w, b.w) ||
        !same_bits(a.trust, b.trust))
        return false;
    for (std::size_t k = 0; k < a.slots.size(); ++k)
        if (!same_bits(a.slots[k], b.slots[k]))
            return false;
    return true;
}

template <class T>
std::vector<T> to_host(std::span<const T> d, const cuda_system& sys) {
    std::vector<T> h(d.size());
    copy(d, sys, std::span<T>(h), host_system{});
    return h;
}

template <class O, class T = typename O::value_type>
device_snapshot<T> take_snapshot(const O& opt, const buffer<T, cuda_system>& w,
                                 const cuda_system& sys) {
    device_snapshot<T> s{to_host(w.span(), sys), opt.step_count(), {}, {}};
    for (const auto& slot : opt.state().slots)
        s.slots.push_back(to_host(std::span<const T>(slot.data), sys));
    if constexpr (requires { opt.trust_ratios(); })
        s.trust = to_host(opt.trust_ratios(), sys);
    return s;
}

/// Sets the one-int skip flag in device memory (ordered after the work enqueued on sys).
void set_flag(buffer<int, cuda_system>& flag, int value, const cuda_system& sys) {
    copy(std::span<const int>(&value, 1), host_system{}, flag.span(), sys);
}

/// Skipped steps on cuda_system, the flag in device memory: (a) a step with the flag set changes
/// nothing, even with a NaN gradient; (b) five steps with the third skipped equal four plain
/// steps over the other gradients, bitwise (bias corrections count applied steps only).
template <template <class, class> class O, class T, class Params>
void check_skip(const Params& p) {
    const cuda_system sys(0);
    const auto w0 = wave_vector<T>(n_params, 7, 0.5);
    buffer<int, cuda_system> flag(1, sys);

    // (a)
    O<T, cuda_system> opt(n_params, p, sys, segments);
    auto w = to_device(w0, sys);
    for (unsigned step = 0; step < 2; ++step) {
        set_flag(flag, 0, sys);
        const auto g = to_device(wave_vector<T>(n_params, 11 + step), sys);
        opt.step(w.span(), std::span<const T>(g.span()), flag.data());
    }
    const device_snapshot<T> before = take_snapshot(opt, w, sys);
    CHECK(before.step == 2);
    auto bad_host = wave_vector<T>(n_params, 13);
    bad_host[5] = std::numeric_limits<T>::quiet_NaN();
    bad_host[6001] = std::numeric_limits<T>::infinity();
    const auto bad = to_device(bad_host, sys);
    set_flag(flag, 1, sys);
    opt.step(w.span(), std::span<const T>(bad.span()), flag.data());
    sys.synchronize();
    CHECK(same_bits(take_snapshot(opt, w, sys), before));

    // (b)
    O<T, cuda_system> skipping(n_params, p, sys, segments), plain(n_params, p, sys, segments);
    auto w_skipping = to_device(w0, sys), w_plain = to_device(w0, sys);
    for (unsigned step = 0; step < 5; ++step) {
        const auto g = to_device(wave_vector<T>(n_params, 11 + step), sys);
        set_flag(flag, step == 2 ? 1 : 0, sys);
        skipping.step(w_skipping.span(), std::span<const T>(g.span()), flag.data());
        if (step != 2)
            plain.step(w_plain.span(), std::span<const T>(g.span()));
    }
    sys.synchronize();
    const device_snapshot<T> a = take_snapshot(skipping, w_skipping, sys);
    CHECK(a.step == 4);
    CHECK(same_bits(a, take_snapshot(plain, w_plain, sys)));
}

} // namespace

namespace {

/// What gradient_checks wrote on System (the totals, the outcome and the replica row, as their
/// doubles in field order): three pieces cut unevenly and checked last first, finish_local, then
/// check_reduced over [begin, end).
template <class System, class T>
std::vector<double> gradient_check_slots(const std::vector<T>& x, std::size_t begin,
                                         std::size_t end, const System& sys) {
    const std::size_t n = x.size();
    std::vector<detail::bucket> pieces(3);
    pieces[0] = {.offset = 0, .size = n / 5};
    pieces[1] = {.offset = n / 5, .size = n / 2 - n / 5};
    pieces[2] = {.offset = n / 2, .size = n - n / 2};
    buffer<T, System> data(n, sys);
    copy(std::span<const T>(x), host_system{}, data.span(), sys);
    struct written {
        lockstep::step_totals totals;
        lockstep::step_outcome outcome;
        lockstep::replica_row row;
    };
    const written zero{};
    buffer<written, System> out_dev(1, sys);
    copy(std::span<const written>(&zero, 1), host_system{}, out_dev.span(), sys);
    written* w = out_dev.data();
    detail::gradient_checks<System> checks(pieces, n, sys);
    const std::span<const T> d(data.data(), n);
    for (std::size_t k = pieces.size(); k-- > 0;)
        checks.check_piece(sys, d, k, pieces[k]);
    checks.finish_local(sys, 0.5, 8.0, 0.1, &w->totals, &w->row);
    checks.check_reduced(sys, d, begin, end, true, &w->outcome);
    sys.synchronize();
    written got{};
    copy(std::span<const written>(out_dev.data(), 1), sys, std::span<written>(&got, 1),
         host_system{});
    std::vector<double> out(sizeof(written) / sizeof(double));
    std::memcpy(out.data(), &got, sizeof(written));
    return out;
}

/// Equal bits, or both NaN (NaN payloads are not specified across devices).
bool same_value(double a, double b) {
    return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) ||
           (std::isnan(a) && std::isnan(b));
}

} // namespace

TEMPLATE_TEST_CASE("gradient checks on cuda_system equal the host's bit for bit",
                   "[train][checks][cuda][gpu]", float, double) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    const cuda_stream stream(0);
    const cuda_system sys = stream.system();
    const host_system host(2);
    const double inf = std::numeric_limits<double>::infinity();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (const std::size_t n : {std::size_t(1), std::size_t(255), std::size_t(257),
                                std::size_t(16384), std::size_t(16385), std::size_t(3 * 16384 + 77),
                                std::size_t(256 * 16384 + 5), std::size_t(700 * 16384 + 1000)}) {
        // mixed magnitudes, so that another summation order rounds differently
        std::vector<T> x(n);
        for (std::size_t i = 0; i < n; ++i)
            x[i] = static_cast<T>(std::ldexp(1.0, static_cast<int>((i * 7) % 23) - 11) *
                                  std::sin(0.37 * static_cast<double>(i)));
        for (int bad = 0; bad < 3; ++bad) {
            CAPTURE(n, bad);
            std::vector<T> y = x;
            if (bad == 1) { // inf at tile and lane edges
                for (std::size_t i : {n - 1, n / 2, std::size_t(16383), std::size_t(256)})
                    if (i < n)
                        y[i] = static_cast<T>(i % 2 ? -inf : inf);
            } else if (bad == 2) { // NaN and inf
                y[n / 3] = static_cast<T>(nan);
                y[n - 1] = static_cast<T>(inf);
            }
            const std::size_t b = n / 3 + 1 < n ? n / 3 + 1 : 0;
            for (const std::size_t begin : {std::size_t(0), b}) {
                const std::vector<double> want = gradient_check_slots(y, begin, n, host);
                const std::vector<double> got = gradient_check_slots(y, begin, n, sys);
                REQUIRE(got.size() == want.size());
                for (std::size_t k = 0; k < got.size(); ++k) {
                    CAPTURE(begin, k, got[k], want[k]);
                    CHECK(same_value(got[k], want[k]));
                }
            }
        }
    }
}

TEMPLATE_TEST_CASE("optimizers on cuda_system match host_system", "[optim][cuda][gpu]", float,
                   double) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    SECTION("sgd, Nesterov momentum and weight decay") {
        check_optimizer<optim::sgd, T>(
            optim::sgd_params{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
    }
    SECTION("adam") {
        check_optimizer<optim::adam, T>(optim::adam_params{.lr = 1e-2, .weight_decay = 1e-4});
    }
    SECTION("adamw") {
        check_optimizer<optim::adamw, T>(optim::adamw_params{.lr = 1e-2});
    }
    SECTION("lars") {
        check_optimizer<optim::lars, T>(optim::lars_params{.lr = 0.5, .weight_decay = 1e-4});
    }
    SECTION("lamb") {
        check_optimizer<optim::lamb, T>(optim::lamb_params{.lr = 1e-2});
    }
}

TEMPLATE_TEST_CASE("optimizers on cuda_system skip a step on a device flag", "[optim][cuda][gpu]",
                   float, double) {
    using T = TestType;
    if (lockstep_test::skip_without_gpu())
        return;
    SECTION("sgd, Nesterov momentum and weight decay") {
        check_skip<optim::sgd, T>(
            optim::sgd_params{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
    }
    SECTION("adam") {
        check_skip<optim::adam, T>(optim::adam_params{.lr = 1e-2, .weight_decay = 1e-4});
    }
    SECTION("adamw") {
        check_skip<optim::adamw, T>(optim::adamw_params{.lr = 1e-2});
    }
    SECTION("lars") {
        check_skip<optim::lars, T>(optim::lars_params{.lr = 0.5, .weight_decay = 1e-4});
    }
    SECTION("lamb") {
        check_skip<optim::lamb, T>(optim::lamb_params{.lr = 1e-2});
    }
}

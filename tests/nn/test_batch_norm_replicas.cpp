// Tests of nn::batch_norm across replicas on the thread group: every BNStatPolicy against the
// single-device reference of the batch it defines, collective counts, errors on every replica.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/nn/batch_norm.hpp"

#include "bn_reference.hpp"
#include "support/contains.hpp"
#include "support/counting_communicator.hpp"

#include <catch2/catch.hpp>

#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

using namespace lockstep;
using bn_test::dims;

namespace {

template <class T, class L>
struct cfg {
    using value_type = T;
    using layout = L;
};

constexpr int steps = 2;
const std::vector<double> gamma0{0.5, 1.5, -2.0}, beta0{0.1, -0.2, 0.3};
const nn::batch_norm_params opts{.eps = 1e-3, .momentum = 0.3};

/// What one replica saw, collected on its thread and checked on the main thread (Catch2
/// assertions are not thread-safe).
template <class T>
struct replica_result {
    std::vector<std::vector<T>> y, dx; // per step
    std::vector<double> dgamma, dbeta, running_mean, running_var;
    testing::collective_counts forward, backward; // of the last step
};

/// The global batch of every step: samples of C x H x W, different per step.
template <class T, class L>
struct global_batches {
    dims sample;
    std::vector<std::size_t> shards;
    std::vector<std::vector<T>> x, dy;

    global_batches(dims per_sample, std::vector<std::size_t> s)
        : sample(per_sample), shards(std::move(s)) {
        for (int k = 0; k < steps; ++k) {
            x.push_back(bn_test::random_values<T>(elements(total()), 40 + k, 1.0 + k, 2.0));
            dy.push_back(bn_test::random_values<T>(elements(total()), 50 + k));
        }
    }
    std::size_t total() const {
        return std::accumulate(shards.begin(), shards.end(), std::size_t{0});
    }
    std::size_t elements(std::size_t n) const { return n * sample.c * sample.s(); }
    std::size_t first(std::size_t r) const {
        return std::accumulate(shards.begin(), shards.begin() + static_cast<std::ptrdiff_t>(r),
                               std::size_t{0});
    }
    dims of(std::size_t n) const { return {n, sample.c, sample.h, sample.w}; }
    /// Samples [begin, begin + n) of step k: a contiguous slice in all three layouts.
    std::vector<T> slice(const std::vector<std::vector<T>>& v, int k, std::size_t begin,
                         std::size_t n) const {
        const auto b =
            v[static_cast<std::size_t>(k)].begin() + static_cast<std::ptrdiff_t>(elements(begin));
        return {b, b + static_cast<std::ptrdiff_t>(elements(n))};
    }
};

/// Runs `steps` training steps of a Policy layer on shards.size() replicas.
template <class T, class L, class Policy>
std::vector<replica_result<T>> run(const global_batches<T, L>& data) {
    const int replicas = static_cast<int>(data.shards.size());
    std::vector<replica_result<T>> out(static_cast<std::size_t>(replicas));
    thread_group group(replicas, {.timeout = std::chrono::seconds(20)});
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        testing::counting_communicator counted(comm);
        nn::batch_norm<T, Policy, L> layer(data.sample.c, opts);
        for (std::size_t c = 0; c < data.sample.c; ++c) {
            layer.gamma()[c] = static_cast<T>(gamma0[c]);
            layer.beta()[c] = static_cast<T>(beta0[c]);
        }
        const dims mine = data.of(data.shards[r]);
        auto& res = out[r];
        for (int k = 0; k < steps; ++k) {
            const auto x = data.slice(data.x, k, data.first(r), data.shards[r]);
            const auto dy = data.slice(data.dy, k, data.first(r), data.shards[r]);
            std::vector<T> y(x.size()), dx(x.size());
            counted.reset();
            layer.forward_train(counted, std::span<const T>(x), bn_test::shape_of<L>(mine),
                                std::span<T>(y));
            res.forward = counted.counts();
            counted.reset();
            layer.backward(counted, std::span<const T>(dy), std::span<T>(dx));
            res.backward = counted.counts();
            res.y.push_back(std::move(y));
            res.dx.push_back(std::move(dx));
        }
        res.dgamma.assign(layer.dgamma().begin(), layer.dgamma().end());
        res.dbeta.assign(layer.dbeta().begin(), layer.dbeta().end());
        res.running_mean.assign(layer.running_mean().begin(), layer.running_mean().end());
        res.running_var.assign(layer.running_var().begin(), layer.running_var().end());
    });
    return out;
}

/// The reference over samples [begin, begin + n) of every step: outputs per step, gradients
/// summed over the steps, running statistics after the last step.
struct reference_run {
    std::vector<bn_test::result> step;
    std::vector<double> dgamma, dbeta;
};
template <class L, class T>
reference_run reference(const global_batches<T, L>& data, std::size_t begin, std::size_t n) {
    reference_run rr;
    std::vector<double> rm(data.sample.c, 0.0), rv(data.sample.c, 1.0);
    rr.dgamma.assign(data.sample.c, 0.0);
    rr.dbeta.assign(data.sample.c, 0.0);
    for (int k = 0; k < steps; ++k) {
        auto res = bn_test::reference<L>(data.of(n), data.slice(data.x, k, begin, n),
                                         data.slice(data.dy, k, begin, n), gamma0, beta0, opts.eps,
                                         opts.momentum, rm, rv);
        rm = res.running_mean;
        rv = res.running_var;
        for (std::size_t c = 0; c < data.sample.c; ++c) {
            rr.dgamma[c] += res.dgamma[c];
            rr.dbeta[c] += res.dbeta[c];
        }
        rr.step.push_back(std::move(res));
    }
    return rr;
}

/// The replicas [first, last) as one device: outputs and dx concatenated, gradients summed.
template <class T>
replica_result<double> combine(const std::vector<replica_result<T>>& rs, std::size_t first,
                               std::size_t last) {
    replica_result<double> c;
    c.y.resize(steps);
    c.dx.resize(steps);
    c.dgamma.assign(rs[first].dgamma.size(), 0.0);
    c.dbeta.assign(rs[first].dbeta.size(), 0.0);
    for (std::size_t r = first; r < last; ++r) {
        for (int k = 0; k < steps; ++k) {
            c.y[k].insert(c.y[k].end(), rs[r].y[k].begin(), rs[r].y[k].end());
            c.dx[k].insert(c.dx[k].end(), rs[r].dx[k].begin(), rs[r].dx[k].end());
        }
        for (std::size_t i = 0; i < c.dgamma.size(); ++i) {
            c.dgamma[i] += rs[r].dgamma[i];
            c.dbeta[i] += rs[r].dbeta[i];
        }
    }
    return c;
}

template <class T>
void check_outputs(const replica_result<double>& got, const reference_run& want) {
    const double tol = bn_test::tolerance<T>();
    for (int k = 0; k < steps; ++k) {
        CHECK(bn_test::rel_error(got.y[k], want.step[k].y) <= tol);
        CHECK(bn_test::rel_error(got.dx[k], want.step[k].dx) <= tol);
    }
    CHECK(bn_test::rel_error(got.dgamma, want.dgamma) <= tol);
    CHECK(bn_test::rel_error(got.dbeta, want.dbeta) <= tol);
}

template <class T>
void check_running(const replica_result<T>& got, const reference_run& want) {
    const double tol = bn_test::tolerance<T>();
    CHECK(bn_test::rel_error(got.running_mean, want.step.back().running_mean) <= tol);
    CHECK(bn_test::rel_error(got.running_var, want.step.back().running_var) <= tol);
}

} // namespace

TEMPLATE_TEST_CASE("bn::global on 2, 3, 4 replicas equals BN of the concatenated batch",
                   "[nn][bn][thread]", (cfg<float, nn::nchw>), (cfg<float, nn::nhwc>),
                   (cfg<float, nn::nc>), (cfg<double, nn::nchw>), (cfg<double, nn::nhwc>),
                   (cfg<double, nn::nc>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    for (const auto& shards :
         std::vector<std::vector<std::size_t>>{{3, 6}, {5, 0, 3}, {5, 0, 3, 8}}) {
        CAPTURE(shards);
        const global_batches<T, L> data(bn_test::make_dims<L>(1, 3, 9, 9), shards);
        const auto rs = run<T, L, bn::global>(data);
        const auto want = reference(data, 0, data.total());
        check_outputs<T>(combine(rs, 0, rs.size()), want);
        for (const auto& r : rs) {
            check_running(r, want);
            CHECK(r.running_mean == rs[0].running_mean); // bitwise: merged in rank order everywhere
            CHECK(r.running_var == rs[0].running_var);
            CHECK(r.forward.all_gather == 1);
            CHECK(r.forward.collectives() == 1);
            CHECK(r.backward.all_reduce == 1);
            CHECK(r.backward.collectives() == 1);
        }
    }
}

TEMPLATE_TEST_CASE("bn::local equals per-replica BN and never communicates", "[nn][bn][thread]",
                   (cfg<float, nn::nchw>), (cfg<double, nn::nhwc>), (cfg<float, nn::nc>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    const global_batches<T, L> data(bn_test::make_dims<L>(1, 3, 9, 9), {4, 0, 6});
    const auto rs = run<T, L, bn::local>(data);
    for (std::size_t r = 0; r < rs.size(); ++r) {
        CAPTURE(r);
        CHECK(rs[r].forward.collectives() + rs[r].backward.collectives() == 0);
        if (data.shards[r] == 0) {
            // nothing to normalize: running statistics keep their initial values
            CHECK(rs[r].running_mean == std::vector<double>(3, 0.0));
            CHECK(rs[r].running_var == std::vector<double>(3, 1.0));
            continue;
        }
        const auto want = reference(data, data.first(r), data.shards[r]);
        check_outputs<T>(combine(rs, r, r + 1), want);
        check_running(rs[r], want);
    }
}

TEMPLATE_TEST_CASE("bn::group<2> on 4 replicas equals global BN within each pair",
                   "[nn][bn][thread]", (cfg<float, nn::nchw>), (cfg<double, nn::nhwc>),
                   (cfg<double, nn::nc>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    const global_batches<T, L> data(bn_test::make_dims<L>(1, 3, 9, 9), {3, 5, 0, 4});
    const auto rs = run<T, L, bn::group<2>>(data);
    for (std::size_t pair = 0; pair < 2; ++pair) {
        CAPTURE(pair);
        const std::size_t a = 2 * pair;
        const auto want = reference(data, data.first(a), data.shards[a] + data.shards[a + 1]);
        check_outputs<T>(combine(rs, a, a + 2), want);
        check_running(rs[a], want);
        check_running(rs[a + 1], want);
        CHECK(rs[a].running_var == rs[a + 1].running_var);
    }
    CHECK(rs[0].running_mean != rs[2].running_mean); // the pairs saw different data
    for (const auto& r : rs) { // the last step: the sub-communicator is cached, no new split
        CHECK(r.forward.collectives() == 1);
        CHECK(r.forward.split == 0);
        CHECK(r.backward.collectives() == 1);
    }
}

TEMPLATE_TEST_CASE("bn::group<2> on 3 replicas: a pair, then a group of one", "[nn][bn][thread]",
                   (cfg<float, nn::nchw>), (cfg<double, nn::nc>)) {
    // policy/bn.hpp: the last group is smaller when the group size does not divide the count.
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    const global_batches<T, L> data(bn_test::make_dims<L>(1, 3, 9, 9), {3, 5, 4});
    const auto rs = run<T, L, bn::group<2>>(data);
    const auto pair = reference(data, 0, data.shards[0] + data.shards[1]);
    check_outputs<T>(combine(rs, 0, 2), pair);
    check_running(rs[0], pair);
    check_running(rs[1], pair);
    const auto alone = reference(data, data.first(2), data.shards[2]);
    check_outputs<T>(combine(rs, 2, 3), alone);
    check_running(rs[2], alone);
}

TEST_CASE("bn::group splits again for a communicator built where a destroyed one stood",
          "[nn][bn][thread]") {
    // The layer keeps the sub-communicator it split for the communicator it was given. A is
    // destroyed and B constructed in the same storage (same address), grouping the replicas
    // differently: world {0, 1}, {2, 3} under A; world {0, 2}, {1, 3} under B (B's ranks
    // follow the keys). A layer that kept A's group for B's address would normalize with A's
    // pairs.
    constexpr std::size_t C = 3;
    const std::size_t samples[4] = {3, 4, 2, 5};
    const int key_b[4] = {0, 2, 1, 3}; // B's rank of world replica r
    std::vector<std::vector<double>> xs(4);
    for (std::size_t r = 0; r < 4; ++r) // replica r's values lie around 3 r: the pairs differ
        xs[r] = bn_test::random_values<double>(samples[r] * C, 70 + static_cast<unsigned>(r),
                                               3.0 * static_cast<double>(r));
    std::vector<std::vector<double>> mean_a(4), mean_b(4);
    std::vector<int> same_storage(4, 0);
    thread_group group(4, {.timeout = std::chrono::seconds(20)});
    group.run([&](thread_communicator& comm) {
        const int r = comm.rank();
        const auto ru = static_cast<std::size_t>(r);
        nn::batch_norm<double, bn::group<2>, nn::nc> layer(C, opts);
        const std::span<const double> x(xs[ru]);
        std::vector<double> y(x.size());
        const nn::tensor_shape shape{samples[ru], C};
        std::optional<thread_communicator> slot;
        slot.emplace(comm.split(0, r));
        layer.forward_train(*slot, x, shape, std::span<double>(y));
        mean_a[ru].assign(layer.batch_mean().begin(), layer.batch_mean().end());
        const thread_communicator* const a = &*slot;
        comm.barrier(); // every replica is done with A before any leaves it
        slot.reset();
        slot.emplace(comm.split(0, key_b[ru]));
        same_storage[ru] = &*slot == a;
        layer.forward_train(*slot, x, shape, std::span<double>(y));
        mean_b[ru].assign(layer.batch_mean().begin(), layer.batch_mean().end());
    });
    // The mean of each channel over the samples of world replicas p and q, in double.
    const auto pair_mean = [&](std::size_t p, std::size_t q) {
        std::vector<double> m(C, 0.0);
        for (std::size_t r : {p, q})
            for (std::size_t i = 0; i < xs[r].size(); ++i)
                m[i % C] += xs[r][i];
        for (double& v : m)
            v /= static_cast<double>(samples[p] + samples[q]);
        return m;
    };
    const std::size_t pair_a[4] = {1, 0, 3, 2}, pair_b[4] = {2, 3, 0, 1};
    for (std::size_t r = 0; r < 4; ++r) {
        CAPTURE(r);
        CHECK(same_storage[r] == 1);
        const auto want_a = pair_mean(r, pair_a[r]), want_b = pair_mean(r, pair_b[r]);
        for (std::size_t c = 0; c < C; ++c) {
            CHECK(mean_a[r][c] == Approx(want_a[c]).epsilon(1e-12));
            CHECK(mean_b[r][c] == Approx(want_b[c]).epsilon(1e-12));
        }
    }
}

TEST_CASE("bn::group layers on one communicator share one split per group size",
          "[nn][bn][thread]") {
    // 48 layers, bn::group<2> and bn::group<4> alternating, trained on one communicator: two
    // splits per replica (one per group size: at rank 0 both give color 0, at rank 2 they do
    // not, so the color alone must not pick the split), and every output bitwise what the same
    // layers give when each has a communicator (so a split) of its own.
    constexpr int layers = 48;
    constexpr std::size_t C = 3;
    const std::size_t samples[4] = {3, 4, 2, 5};
    using pair_bn = nn::batch_norm<double, bn::group<2>, nn::nc>;
    using quad_bn = nn::batch_norm<double, bn::group<4>, nn::nc>;
    struct outputs {
        std::vector<std::vector<double>> y, dx, running_mean, running_var;
        int splits = 0;
    };
    const auto train = [&](bool shared) {
        std::vector<outputs> out(4);
        thread_group group(4, {.timeout = std::chrono::seconds(20)});
        group.run([&](thread_communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            // shared: one communicator for every layer; else one each (each splits its own)
            std::vector<std::unique_ptr<testing::counting_communicator<thread_communicator>>> cs;
            cs.reserve(shared ? 1 : static_cast<std::size_t>(layers));
            for (int l = 0; l < (shared ? 1 : layers); ++l)
                cs.push_back(
                    std::make_unique<testing::counting_communicator<thread_communicator>>(comm));
            const auto comm_of = [&](int l) -> auto& {
                return *cs[shared ? 0 : l];
            };
            std::vector<std::unique_ptr<pair_bn>> pairs;
            std::vector<std::unique_ptr<quad_bn>> quads;
            for (int l = 0; l < layers; l += 2) {
                pairs.push_back(std::make_unique<pair_bn>(C, opts));
                quads.push_back(std::make_unique<quad_bn>(C, opts));
            }
            const nn::tensor_shape shape{samples[r], C};
            auto& res = out[r];
            res.y.resize(layers);
            res.dx.resize(layers);
            const auto seed = [&](int l, unsigned salt) {
                return static_cast<unsigned>(1000 * l + 10 * static_cast<int>(r)) + salt;
            };
            const auto each = [&](int l, auto&& f) {
                const auto i = static_cast<std::size_t>(l / 2);
                if (l % 2 == 0)
                    f(*pairs[i]);
                else
                    f(*quads[i]);
            };
            std::vector<std::vector<double>> xs; // backward reads them
            for (int l = 0; l < layers; ++l) {   // forward in layer order ...
                const auto& x = xs.emplace_back(bn_test::random_values<double>(
                    samples[r] * C, seed(l, 1), static_cast<double>(r + l)));
                auto& y = res.y[static_cast<std::size_t>(l)];
                y.resize(x.size());
                each(l, [&](auto& layer) {
                    layer.forward_train(comm_of(l), std::span<const double>(x), shape,
                                        std::span<double>(y));
                });
            }
            for (int l = layers - 1; l >= 0; --l) { // ... backward in reverse
                const auto dy = bn_test::random_values<double>(samples[r] * C, seed(l, 2));
                auto& dx = res.dx[static_cast<std::size_t>(l)];
                dx.resize(dy.size());
                each(l, [&](auto& layer) {
                    layer.backward(comm_of(l), std::span<const double>(dy), std::span<double>(dx));
                });
            }
            for (int l = 0; l < layers; ++l)
                each(l, [&](auto& layer) {
                    res.running_mean.emplace_back(layer.running_mean().begin(),
                                                  layer.running_mean().end());
                    res.running_var.emplace_back(layer.running_var().begin(),
                                                 layer.running_var().end());
                });
            for (const auto& c : cs)
                res.splits += c->counts().split;
        });
        return out;
    };
    const auto shared = train(true), apart = train(false);
    for (std::size_t r = 0; r < 4; ++r) {
        CAPTURE(r);
        CHECK(shared[r].splits == 2);
        CHECK(apart[r].splits == layers);
        CHECK(shared[r].y == apart[r].y);
        CHECK(shared[r].dx == apart[r].dx);
        CHECK(shared[r].running_mean == apart[r].running_mean);
        CHECK(shared[r].running_var == apart[r].running_var);
    }
    // the groups differ: a pair layer's statistics are not its quad neighbour's
    CHECK(shared[0].running_mean[0] != shared[2].running_mean[0]);
    CHECK(shared[0].running_mean[1] == shared[2].running_mean[1]);
}

TEMPLATE_TEST_CASE("bn::running_only normalizes locally and shares exact global running stats",
                   "[nn][bn][thread]", (cfg<float, nn::nchw>), (cfg<double, nn::nhwc>),
                   (cfg<double, nn::nc>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    const global_batches<T, L> data(bn_test::make_dims<L>(1, 3, 9, 9), {4, 2, 0, 6});
    const auto rs = run<T, L, bn::running_only>(data);
    const auto global = reference(data, 0, data.total());
    for (std::size_t r = 0; r < rs.size(); ++r) {
        CAPTURE(r);
        if (data.shards[r] > 0)
            check_outputs<T>(combine(rs, r, r + 1), reference(data, data.first(r), data.shards[r]));
        check_running(rs[r], global);
        CHECK(rs[r].running_mean == rs[0].running_mean);
        CHECK(rs[r].running_var == rs[0].running_var);
        CHECK(rs[r].forward.collectives() == 1);
        CHECK(rs[r].backward.collectives() == 0);
    }
}

TEMPLATE_TEST_CASE("bn::tower<1> normalizes locally; replica 1's statistics drive everyone's",
                   "[nn][bn][thread]", (cfg<float, nn::nchw>), (cfg<double, nn::nhwc>),
                   (cfg<double, nn::nc>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    const global_batches<T, L> data(bn_test::make_dims<L>(1, 3, 9, 9), {4, 3, 5});
    const auto rs = run<T, L, bn::tower<1>>(data);
    const auto tower = reference(data, data.first(1), data.shards[1]);
    for (std::size_t r = 0; r < rs.size(); ++r) {
        CAPTURE(r);
        check_outputs<T>(combine(rs, r, r + 1), reference(data, data.first(r), data.shards[r]));
        check_running(rs[r], tower);
        CHECK(rs[r].running_mean == rs[1].running_mean);
        CHECK(rs[r].running_var == rs[1].running_var);
        CHECK(rs[r].forward.collectives() == 1);
        CHECK(rs[r].backward.collectives() == 0);
    }
}

namespace {

/// Runs one forward (and backward) of a Policy layer with 3 channels on `replicas` replicas;
/// `input(rank)` gives each replica's shape and element count. Returns each replica's error
/// code's name, or "none" when it finished without one (and its message in `texts`, if given).
template <class Policy>
std::vector<std::string> errors(int replicas, auto input, bool bad_dy_on_last = false,
                                std::vector<std::string>* texts = nullptr) {
    std::vector<std::string> codes(static_cast<std::size_t>(replicas), "none");
    std::vector<std::string> messages(codes.size());
    thread_group group(replicas, {.timeout = std::chrono::seconds(20)});
    group.run([&](thread_communicator& comm) {
        const auto [shape, n] = input(comm.rank());
        nn::batch_norm<float, Policy, nn::nchw> layer(3);
        std::vector<float> x(n, 1.0f), y(n);
        for (std::size_t i = 0; i < n; ++i)
            x[i] = static_cast<float>(i % 7);
        try {
            layer.forward_train(comm, std::span<const float>(x), shape, std::span<float>(y));
            const bool bad = bad_dy_on_last && comm.rank() == comm.size() - 1;
            std::vector<float> dy(bad ? n + 1 : n, 1.0f);
            layer.backward(comm, std::span<const float>(dy), std::span<float>(y));
        } catch (const error& e) {
            codes[static_cast<std::size_t>(comm.rank())] = std::string(to_string(e.code()));
            messages[static_cast<std::size_t>(comm.rank())] = e.what();
        }
    });
    for (const auto& m : messages)
        UNSCOPED_INFO(m);
    if (texts != nullptr)
        *texts = messages;
    return codes;
}

struct input {
    nn::tensor_shape shape;
    std::size_t n;
};

} // namespace

TEST_CASE("bad input on one replica is an error on every replica, never a hang",
          "[nn][bn][thread]") {
    const auto good = [](std::size_t n) { return input{{n, 3, 2, 2}, n * 12}; };
    SECTION("channel mismatch on replica 2 under bn::global") {
        const auto codes = errors<bn::global>(3, [&](int r) {
            return r == 2 ? input{{2, 4, 2, 2}, 32} : good(2);
        });
        CHECK(codes == std::vector<std::string>{"peer_failure", "peer_failure", "shape_mismatch"});
    }
    SECTION("channel mismatch on replica 3 under bn::group<2>: named by its rank, not its "
            "place in the group") {
        std::vector<std::string> texts;
        const auto codes = errors<bn::group<2>>(
            4,
            [&](int r) {
                return r == 3 ? input{{2, 4, 2, 2}, 32} : good(2);
            },
            false, &texts);
        CHECK(codes == std::vector<std::string>{"none", "none", "peer_failure", "shape_mismatch"});
        CHECK(lockstep_test::contains(texts[2], "replica 3 passed invalid input to this layer"));
    }
    SECTION("wrong rank on replica 0 under bn::running_only") {
        const auto codes = errors<bn::running_only>(2, [&](int r) {
            return r == 0 ? input{{2, 3, 4}, 24} : good(2);
        });
        CHECK(codes == std::vector<std::string>{"shape_mismatch", "peer_failure"});
    }
    SECTION("a global batch of one value per channel in training") {
        const auto codes = errors<bn::global>(3, [&](int r) {
            return r == 1 ? input{{1, 3, 1, 1}, 3} : input{{0, 3, 1, 1}, 0};
        });
        CHECK(codes == std::vector<std::string>(3, "invalid_argument"));
    }
    SECTION("one sample on one replica under bn::tower (local normalization)") {
        const auto codes = errors<bn::tower<0>>(2, [&](int r) {
            return r == 1 ? input{{1, 3, 1, 1}, 3} : good(2);
        });
        CHECK(codes == std::vector<std::string>(2, "invalid_argument"));
    }
    SECTION("bn::tower<K> with K beyond the replicas") {
        const auto codes = errors<bn::tower<3>>(2, [&](int) { return good(2); });
        CHECK(codes == std::vector<std::string>(2, "invalid_argument"));
    }
    SECTION("a gradient of the wrong size on the last replica under bn::global") {
        const auto codes = errors<bn::global>(
            3, [&](int) { return good(2); }, true);
        CHECK(codes == std::vector<std::string>{"peer_failure", "peer_failure", "shape_mismatch"});
    }
    SECTION("a global batch of two samples split one and one is fine under bn::global") {
        const auto codes = errors<bn::global>(2, [&](int) { return input{{1, 3, 1, 1}, 3}; });
        CHECK(codes == std::vector<std::string>(2, "none"));
    }
}

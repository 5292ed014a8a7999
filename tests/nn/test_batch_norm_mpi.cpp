// Tests of nn::batch_norm<bn::global> over MPI (one replica per process): every rank's slice of
// y and dx, the summed dgamma/dbeta and the running statistics match single-device BN of the
// concatenated batch. SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/nn/batch_norm.hpp"

#include "bn_reference.hpp"
#include "support/counting_communicator.hpp"

#include <cstdio>
#include <memory>
#include <numeric>
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

/// Uneven shards with an empty one from 3 ranks on: {5, 3}, {5, 0, 3}, {5, 0, 3, 8}, ...
std::vector<std::size_t> shards_for(int ranks) {
    const std::vector<std::size_t> base{5, 0, 3, 8};
    if (ranks == 2)
        return {5, 3};
    std::vector<std::size_t> s(static_cast<std::size_t>(ranks));
    for (std::size_t r = 0; r < s.size(); ++r)
        s[r] = base[r % base.size()];
    return s;
}

} // namespace

TEMPLATE_TEST_CASE("bn::global over MPI equals BN of the concatenated batch", "[nn][bn][mpi]",
                   (cfg<float, nn::nchw>), (cfg<float, nn::nhwc>), (cfg<double, nn::nc>),
                   (cfg<double, nn::nchw>)) {
    using T = typename TestType::value_type;
    using L = typename TestType::layout;
    mpi_communicator world(MPI_COMM_WORLD);
    testing::counting_communicator comm(world);
    const auto shards = shards_for(comm.size());
    const auto r = static_cast<std::size_t>(comm.rank());
    const std::size_t total = std::accumulate(shards.begin(), shards.end(), std::size_t{0});
    const std::size_t first = std::accumulate(
        shards.begin(), shards.begin() + static_cast<std::ptrdiff_t>(r), std::size_t{0});
    const dims all = bn_test::make_dims<L>(total, 3, 7, 9);
    const dims mine = bn_test::make_dims<L>(shards[r], 3, 7, 9);
    const std::size_t per = all.c * all.s();
    const nn::batch_norm_params p{.eps = 1e-3, .momentum = 0.3};
    const std::vector<double> gamma{0.5, 1.5, -2.0}, beta{0.1, -0.2, 0.3};

    nn::batch_norm<T, bn::global, L> layer(3, p);
    for (std::size_t c = 0; c < 3; ++c) {
        layer.gamma()[c] = static_cast<T>(gamma[c]);
        layer.beta()[c] = static_cast<T>(beta[c]);
    }
    std::vector<double> rm(3, 0.0), rv(3, 1.0), dgamma(3, 0.0), dbeta(3, 0.0);
    for (unsigned step = 0; step < 2; ++step) {
        // every rank builds the same global batch and takes its slice
        const auto x = bn_test::random_values<T>(all.size(), 60 + step, 2.0, 3.0);
        const auto dy = bn_test::random_values<T>(all.size(), 70 + step);
        const std::vector<T> xs(x.begin() + first * per, x.begin() + (first + shards[r]) * per);
        const std::vector<T> dys(dy.begin() + first * per, dy.begin() + (first + shards[r]) * per);
        std::vector<T> y(xs.size()), dx(xs.size());
        comm.reset();
        layer.forward_train(comm, std::span<const T>(xs), bn_test::shape_of<L>(mine),
                            std::span<T>(y));
        layer.backward(comm, std::span<const T>(dys), std::span<T>(dx));
        // The first call also compares the layer's settings across the ranks (one all_reduce).
        CHECK(comm.counts().all_gather == 1);
        CHECK(comm.counts().all_reduce == (step == 0 ? 2 : 1));
        CHECK(comm.counts().collectives() == (step == 0 ? 3 : 2));

        const auto ref = bn_test::reference<L>(all, x, dy, gamma, beta, p.eps, p.momentum, rm, rv);
        rm = ref.running_mean;
        rv = ref.running_var;
        const std::vector<double> ref_y(ref.y.begin() + first * per,
                                        ref.y.begin() + (first + shards[r]) * per);
        const std::vector<double> ref_dx(ref.dx.begin() + first * per,
                                         ref.dx.begin() + (first + shards[r]) * per);
        const double tol = bn_test::tolerance<T>();
        // rel_error of a slice is scaled by the slice; scale by the whole batch instead
        double scale_y = 0, scale_dx = 0, err_y = 0, err_dx = 0;
        for (double v : ref.y)
            scale_y = std::max(scale_y, std::abs(v));
        for (double v : ref.dx)
            scale_dx = std::max(scale_dx, std::abs(v));
        for (std::size_t i = 0; i < y.size(); ++i) {
            err_y = std::max(err_y, std::abs(y[i] - ref_y[i]));
            err_dx = std::max(err_dx, std::abs(dx[i] - ref_dx[i]));
        }
        CHECK(err_y <= tol * scale_y);
        CHECK(err_dx <= tol * scale_dx);
        for (std::size_t c = 0; c < 3; ++c) {
            dgamma[c] += ref.dgamma[c];
            dbeta[c] += ref.dbeta[c];
        }
    }
    // the trainer's gradient reduction: sum the per-replica partial gradients
    std::vector<T> grads(6), summed(6);
    for (std::size_t c = 0; c < 3; ++c) {
        grads[c] = layer.dgamma()[c];
        grads[3 + c] = layer.dbeta()[c];
    }
    world.all_reduce(std::span<const T>(grads), std::span<T>(summed), reduce_op::sum);
    const double tol = bn_test::tolerance<T>();
    CHECK(bn_test::rel_error(std::vector<T>(summed.begin(), summed.begin() + 3), dgamma) <= tol);
    CHECK(bn_test::rel_error(std::vector<T>(summed.begin() + 3, summed.end()), dbeta) <= tol);
    CHECK(bn_test::rel_error(layer.running_mean(), rm) <= tol);
    CHECK(bn_test::rel_error(layer.running_var(), rv) <= tol);
}

TEST_CASE("bad input on the last rank is an error on every rank over MPI", "[nn][bn][mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    const bool bad = comm.rank() == comm.size() - 1;
    nn::batch_norm<float, bn::global, nn::nc> layer(3);
    std::vector<float> x(bad ? 8 : 6, 1.0f), y(x.size());
    x[0] = 2.0f;
    std::string code = "none";
    try {
        layer.forward_train(comm, std::span<const float>(x),
                            bad ? nn::tensor_shape{2, 4} : nn::tensor_shape{2, 3},
                            std::span<float>(y));
    } catch (const error& e) {
        code = std::string(to_string(e.code()));
    }
    CHECK(code == (bad ? "shape_mismatch" : "peer_failure"));
}

TEST_CASE("1200 bn::group layers on one MPI communicator split it once", "[nn][bn][mpi]") {
    // One split per layer would take two of MPICH's 2048 context ids per process each and fail
    // near layer 1022 ("Too many communicators"). The layers share one split; each normalizes
    // with its group's statistics: bitwise what bn::global gives on the group's communicator.
    constexpr int layers = 1200;
    mpi_communicator world(MPI_COMM_WORLD);
    testing::counting_communicator comm(world);
    mpi_communicator pair = world.split(world.rank() / 2, world.rank());
    const auto x =
        bn_test::random_values<float>(std::size_t{4} * 3, 80 + static_cast<unsigned>(world.rank()),
                                      static_cast<double>(world.rank()));
    const auto dy = bn_test::random_values<float>(x.size(), 90);
    const nn::tensor_shape shape{4, 3};
    nn::batch_norm<float, bn::global, nn::nc> reference(3);
    std::vector<float> want_y(x.size()), want_dx(x.size());
    reference.forward_train(pair, std::span<const float>(x), shape, std::span<float>(want_y));
    reference.backward(pair, std::span<const float>(dy), std::span<float>(want_dx));

    std::vector<std::unique_ptr<nn::batch_norm<float, bn::group<2>, nn::nc>>> net;
    int same = 0;
    for (int l = 0; l < layers; ++l) {
        net.push_back(std::make_unique<nn::batch_norm<float, bn::group<2>, nn::nc>>(3));
        std::vector<float> y(x.size()), dx(x.size());
        net.back()->forward_train(comm, std::span<const float>(x), shape, std::span<float>(y));
        net.back()->backward(comm, std::span<const float>(dy), std::span<float>(dx));
        same += y == want_y && dx == want_dx;
    }
    CHECK(comm.counts().split == 1);
    CHECK(same == layers);
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}

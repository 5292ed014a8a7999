// tests/nn/test_bn_contracts.cpp: a batch-norm layer's contracts that used to fail silently are
// kept or refused on every replica: empty planes write nothing, in-place use and a backward on
// another communicator are refused, a failed forward leaves the running statistics and
// num_batches_tracked as they were on every replica, eps is checked in the layer's precision
// (a subnormal eps refused), a layer shared by several replicas is refused, and a backward
// without a forward is reported as such by its replica.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

using namespace lockstep;
using lockstep_test::contains;

namespace {

constexpr float sentinel = -12345.0f;
constexpr std::size_t C = 3;

/// What each replica's call ended with: its error code's name and message, or "none".
struct outcome {
    std::string code = "none", message;
};

/// Runs body(comm, layer) on `replicas` replicas with one bn::global layer of C channels each;
/// returns what every replica's body threw.
template <class Body>
std::vector<outcome> on_replicas(int replicas, Body body) {
    std::vector<outcome> out(static_cast<std::size_t>(replicas));
    thread_group group(replicas, {.timeout = std::chrono::seconds(20)});
    group.run([&](thread_communicator& comm) {
        nn::batch_norm<float, bn::global, nn::nchw> layer(C);
        try {
            body(comm, layer);
        } catch (const error& e) {
            out[static_cast<std::size_t>(comm.rank())] = {std::string(to_string(e.code())),
                                                          e.what()};
        }
    });
    return out;
}

/// Replica r's input: n samples of C x 2 x 2, different on every replica.
std::vector<float> input(int r, std::size_t n) {
    std::vector<float> x(n * C * 4);
    for (std::size_t i = 0; i < x.size(); ++i)
        x[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(r) * 3) % 11) * 0.25f;
    return x;
}

} // namespace

TEST_CASE("an NCHW input with an empty plane is an empty batch: nothing is written",
          "[nn][bn][thread]") {
    // {4, 3, 0, 5} holds no values: the kernels must not take it as 4 x 3 rows. The spans point
    // into a sentinel-filled buffer, so a write past them shows.
    std::vector<float> buffer(64, sentinel);
    const std::span<float> none(buffer.data() + 32, 0);
    const nn::tensor_shape empty{4, C, 0, 5};
    std::vector<int> errors(2, 0);
    std::vector<double> batches(2, -1);
    thread_group(2, {.timeout = std::chrono::seconds(20)}).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        nn::batch_norm<float, bn::global, nn::nchw> layer(C);
        const std::vector<float> x = input(comm.rank(), 2);
        std::vector<float> y(x.size()), dx(x.size());
        try {
            // Replica 0 passes the empty shape, replica 1 two real samples: bn::global.
            if (r == 0) {
                layer.forward_train(comm, std::span<const float>(none), empty, none);
                layer.backward(comm, std::span<const float>(none), none);
                layer.forward_eval(std::span<const float>(none), empty, none);
            } else {
                layer.forward_train(comm, std::span<const float>(x), {2, C, 2, 2},
                                    std::span<float>(y));
                layer.backward(comm, std::span<const float>(x), std::span<float>(dx));
            }
            batches[r] = static_cast<double>(layer.num_batches_tracked());
        } catch (const error&) {
            errors[r] = 1;
        }
    });
    CHECK(errors == std::vector<int>{0, 0});
    CHECK(batches == std::vector<double>{1, 1});
    for (float v : buffer)
        REQUIRE(v == sentinel);
    // The kernels themselves refuse a geometry with inner 0 (their loops take inner <= 1 as
    // rows).
    const kernels::channel_geometry g{4, C, 0};
    const std::vector<float> mean(C, 0.0f), scale(C, 1.0f), beta(C, 0.0f);
    try {
        kernels::normalize(host_system(1), std::span<const float>(none), none, g,
                           std::span<const float>(mean), std::span<const float>(scale),
                           std::span<const float>(beta));
        FAIL("kernels::normalize accepted inner 0");
    } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        CHECK(contains(e.what(), "inner 0"));
    }
    for (float v : buffer)
        REQUIRE(v == sentinel);
}

TEST_CASE("in-place use is refused on every replica before anything is written",
          "[nn][bn][thread]") {
    SECTION("forward_train with y over x on replica 1") {
        const auto out = on_replicas(3, [](thread_communicator& comm, auto& layer) {
            std::vector<float> x = input(comm.rank(), 2);
            std::vector<float> y(x.size());
            const std::span<float> out = comm.rank() == 1 ? std::span<float>(x) : std::span(y);
            layer.forward_train(comm, std::span<const float>(x), {2, C, 2, 2}, out);
        });
        CHECK(out[0].code == "peer_failure");
        CHECK(out[1].code == "invalid_argument");
        CHECK(out[2].code == "peer_failure");
        CHECK(contains(out[1].message, "replica 1"));
        CHECK(contains(out[1].message, "batch_norm.forward_train"));
        CHECK(contains(out[1].message, "x and y overlap"));
    }
    SECTION("backward with dx over dy on every replica, and over x") {
        const auto out = on_replicas(2, [](thread_communicator& comm, auto& layer) {
            std::vector<float> x = input(comm.rank(), 2);
            std::vector<float> y(x.size()), dy(x.size(), 1.0f);
            layer.forward_train(comm, std::span<const float>(x), {2, C, 2, 2}, std::span(y));
            const std::span<float> dx = comm.rank() == 0 ? std::span<float>(dy) : std::span(x);
            layer.backward(comm, std::span<const float>(dy), dx);
        });
        CHECK(out[0].code == "invalid_argument");
        CHECK(contains(out[0].message, "dy and dx overlap"));
        CHECK(contains(out[0].message, "give dx its own buffer"));
        CHECK(out[1].code == "invalid_argument");
        CHECK(contains(out[1].message, "x and dx overlap"));
        CHECK(contains(out[1].message, "give dx its own buffer"));
    }
    SECTION("forward_eval in place") {
        nn::batch_norm<float, bn::local, nn::nc> layer(C);
        std::vector<float> x(4 * C, 1.0f);
        try {
            layer.forward_eval(std::span<const float>(x), {4, C}, std::span<float>(x));
            FAIL("in-place forward_eval accepted");
        } catch (const error& e) {
            CHECK(e.code() == errc::invalid_argument);
            CHECK(contains(e.what(), "x and y overlap"));
        }
    }
}

TEST_CASE("backward on another communicator than its forward is refused on every replica",
          "[nn][bn][thread]") {
    // Forward over 4 replicas, backward over pairs of them: the sums would be combined over 2
    // replicas and divided by the 4 replicas' count.
    const auto out = on_replicas(4, [](thread_communicator& comm, auto& layer) {
        std::vector<float> x = input(comm.rank(), 2);
        std::vector<float> y(x.size()), dx(x.size());
        layer.forward_train(comm, std::span<const float>(x), {2, C, 2, 2}, std::span(y));
        thread_communicator pair = comm.split(comm.rank() / 2, comm.rank());
        layer.backward(pair, std::span<const float>(x), std::span(dx));
    });
    for (const auto& o : out) {
        CHECK(o.code == "invalid_argument");
        CHECK(contains(o.message, "backward on another communicator (2 replicas"));
        CHECK(contains(o.message, "than its forward_train (4 replicas"));
    }
}

TEST_CASE("a forward that fails on one replica leaves every replica's running statistics",
          "[nn][bn][thread]") {
    // Replica 1 passes 4 channels to a 3-channel layer: it throws shape_mismatch, its peers
    // peer_failure. The peers had the valid blocks; they must not apply them (bn::global
    // promises the same running statistics on every replica).
    std::vector<std::vector<float>> mean(3), var(3);
    std::vector<std::int64_t> batches(3, -1);
    std::vector<std::string> codes(3, "none");
    thread_group(3, {.timeout = std::chrono::seconds(20)}).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        nn::batch_norm<float, bn::global, nn::nc> layer(C, {.momentum = 0.5});
        // One good step first, so the statistics kept are not the initial ones.
        std::vector<float> x = input(comm.rank(), 4), y(x.size());
        layer.forward_train(comm, std::span<const float>(x), {16, C}, std::span(y));
        const std::vector<float> mean0(layer.running_mean().begin(), layer.running_mean().end());
        const std::vector<float> var0(layer.running_var().begin(), layer.running_var().end());
        const nn::tensor_shape shape = r == 1 ? nn::tensor_shape{12, 4} : nn::tensor_shape{16, C};
        try {
            layer.forward_train(comm, std::span<const float>(x), shape, std::span(y));
        } catch (const error& e) {
            codes[r] = std::string(to_string(e.code()));
        }
        // Kept as differences from before the failed call: all zero when restored.
        for (std::size_t c = 0; c < C; ++c) {
            mean[r].push_back(layer.running_mean()[c] - mean0[c]);
            var[r].push_back(layer.running_var()[c] - var0[c]);
        }
        batches[r] = layer.num_batches_tracked();
    });
    CHECK(codes == std::vector<std::string>{"peer_failure", "shape_mismatch", "peer_failure"});
    for (std::size_t r = 0; r < 3; ++r) {
        CAPTURE(r);
        CHECK(mean[r] == std::vector<float>(C, 0.0f));
        CHECK(var[r] == std::vector<float>(C, 0.0f));
        CHECK(batches[r] == 1);
    }
}

TEMPLATE_TEST_CASE("one layer shared by every replica is refused at another replica's first call",
                   "[nn][bn][thread]", bn::global, bn::local) {
    // Built once outside the replicas' function: the first replica to call it owns it, every
    // other replica is refused before its call touches the layer (it would race on the saved
    // input, the statistics buffers and num_batches_tracked). Under bn::global the owner waits
    // in the all_gather for a peer that never comes: it must learn of the failure, not hang.
    constexpr int replicas = 3;
    nn::batch_norm<float, TestType, nn::nc> shared(C);
    std::vector<outcome> out(replicas);
    std::string thrown = "none";
    try {
        thread_group(replicas, {.timeout = std::chrono::seconds(20)})
            .run([&](thread_communicator& comm) {
                const auto r = static_cast<std::size_t>(comm.rank());
                try {
                    for (int step = 0; step < 20; ++step) {
                        std::vector<float> x = input(comm.rank(), 4), y(x.size()), dx(x.size());
                        shared.forward_train(comm, std::span<const float>(x), {16, C},
                                             std::span(y));
                        shared.backward(comm, std::span<const float>(x), std::span(dx));
                    }
                } catch (const error& e) {
                    out[r] = {std::string(to_string(e.code())), e.what()};
                    throw;
                }
            });
    } catch (const error& e) {
        thrown = e.what();
    }
    int refused = 0;
    for (std::size_t r = 0; r < out.size(); ++r) {
        CAPTURE(r, out[r].message);
        if (out[r].code != "invalid_argument") {
            // The owner: done (bn::local) or told of its peers' failure (bn::global).
            CHECK((out[r].code == "none" || out[r].code == "peer_failure"));
            continue;
        }
        ++refused;
        CHECK(contains(out[r].message, "replica " + std::to_string(r) + ": batch_norm."));
        CHECK(contains(out[r].message, "batch_norm is used by replica " + std::to_string(r) +
                                           " but was first trained on replica "));
        CHECK(contains(out[r].message, "make one layer per replica (construct it inside the "
                                       "replica's function)"));
    }
    CHECK(refused == replicas - 1);
    CHECK(contains(thrown, "make one layer per replica"));
}

TEST_CASE("a layer built from one replica's communicator is refused on another replica",
          "[nn][bn][thread]") {
    std::unique_ptr<nn::batch_norm<float, bn::local, nn::nc>> layer;
    std::vector<outcome> out(2);
    thread_group(2, {.timeout = std::chrono::seconds(20)}).run([&](thread_communicator& comm) {
        if (comm.rank() == 0)
            layer = std::make_unique<nn::batch_norm<float, bn::local, nn::nc>>(comm, C);
        comm.barrier(); // replica 1 sees the layer replica 0 built
        if (comm.rank() != 1)
            return;
        std::vector<float> x = input(1, 4), y(x.size());
        try {
            layer->forward_train(comm, std::span<const float>(x), {16, C}, std::span(y));
        } catch (const error& e) {
            out[1] = {std::string(to_string(e.code())), e.what()};
        }
    });
    CHECK(out[0].code == "none");
    CHECK(out[1].code == "invalid_argument");
    CHECK(contains(out[1].message, "replica 1: batch_norm.forward_train: batch_norm is used by "
                                   "replica 1 but was built for replica 0 (bn::local, 3 "
                                   "channels)"));
    CHECK(layer->num_batches_tracked() == 0);
}

TEST_CASE("a layer of an ended run's replica is refused on another replica of the next run",
          "[nn][bn][thread]") {
    // Run 1's replica 1 builds and trains the layer; in run 2 only replica 0 calls it. A
    // thread created after another was joined often gets its std::thread::id (glibc reuses
    // the stack), so each trial is a chance for the check to take run 2's replica 0 for the
    // ended thread: every one of 10 trials must refuse it.
    int refused = 0;
    for (int trial = 0; trial < 10; ++trial) {
        std::unique_ptr<nn::batch_norm<float, bn::local, nn::nc>> layer;
        std::vector<float> x = input(1, 4), y(x.size());
        thread_group(2, {.timeout = std::chrono::seconds(20)}).run([&](thread_communicator& comm) {
            if (comm.rank() != 1)
                return;
            layer = std::make_unique<nn::batch_norm<float, bn::local, nn::nc>>(comm, C);
            layer->forward_train(comm, std::span<const float>(x), {16, C}, std::span(y));
        });
        outcome out;
        thread_group(2, {.timeout = std::chrono::seconds(20)}).run([&](thread_communicator& comm) {
            if (comm.rank() != 0)
                return;
            try {
                layer->forward_train(comm, std::span<const float>(x), {16, C}, std::span(y));
            } catch (const error& e) {
                out = {std::string(to_string(e.code())), e.what()};
            }
        });
        CAPTURE(trial, out.message);
        CHECK(out.code == "invalid_argument");
        CHECK(contains(out.message, "replica 0: batch_norm.forward_train: batch_norm is used by "
                                    "replica 0 but was built for replica 1 (bn::local, 3 "
                                    "channels)"));
        refused += out.code == "invalid_argument" ? 1 : 0;
        CHECK(layer->num_batches_tracked() == 1);
    }
    CHECK(refused == 10);
}

TEST_CASE("a backward without a forward is reported by its replica, not as a mismatch",
          "[nn][bn][thread]") {
    // Replica 1 skips the forward: its backward all_reduce meets replica 0's forward all_gather.
    // The communicator's mismatch is what replica 0 sees; replica 1 knows the cause.
    const auto out = on_replicas(2, [](thread_communicator& comm, auto& layer) {
        std::vector<float> x = input(comm.rank(), 2);
        std::vector<float> y(x.size()), dx(x.size());
        if (comm.rank() == 0)
            layer.forward_train(comm, std::span<const float>(x), {2, C, 2, 2}, std::span(y));
        layer.backward(comm, std::span<const float>(x), std::span(dx));
    });
    CHECK(out[1].code == "shape_mismatch");
    CHECK(contains(out[1].message, "replica 1: batch_norm.backward: backward needs a preceding "
                                   "forward_train on this replica"));
    CHECK(out[0].code != "none");
    CHECK(contains(out[0].message, "batch_norm"));
}

TEST_CASE("eps below the smallest normal value of the layer's precision is refused", "[nn][bn]") {
    // A subnormal eps passed as > 0, but backward's invstd^2 = 1 / eps overflows to inf and a
    // constant channel's dx became NaN (inf * 0).
    auto message_of = [](auto make) -> std::string {
        try {
            make();
        } catch (const error& e) {
            return e.what();
        }
        return "no error";
    };
    const std::string f =
        message_of([] { nn::batch_norm<float, bn::local, nn::nc>(C, {.eps = 1e-40}); });
    CHECK(contains(f, "eps = 1e-40"));
    CHECK(contains(f, "no smaller than its smallest normal value 1.17549e-38"));
    const std::string d =
        message_of([] { nn::batch_norm<double, bn::local, nn::nc>(C, {.eps = 1e-310}); });
    CHECK(contains(d, "no smaller than its smallest normal value 2.22507e-308"));
    // The bound itself trains: a constant channel's dx = invstd * (dy - mean(dy)) is huge (invstd
    // = 1 / sqrt(eps)) but finite.
    std::vector<float> dx(4 * C, sentinel);
    thread_group(1).run([&](thread_communicator& comm) {
        nn::batch_norm<float, bn::local, nn::nc> layer(
            comm, C, {.eps = static_cast<double>(std::numeric_limits<float>::min())});
        std::vector<float> x(4 * C, 3.0f), y(x.size()), dy(x.size());
        for (std::size_t i = 0; i < dy.size(); ++i)
            dy[i] = static_cast<float>(i % 5);
        layer.forward_train(comm, std::span<const float>(x), {4, C}, std::span(y));
        layer.backward(comm, std::span<const float>(dy), std::span(dx));
    });
    for (float v : dx)
        CHECK(std::isfinite(v));
}

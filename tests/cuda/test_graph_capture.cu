// A synchronous step captured into a CUDA graph on one GPU (one nccl_communicator rank) and
// launched 10 times, each launch counted by count_replay(), against 10 plain steps on the same
// batches: the same weights, losses, optimizer step count and host counters, bit for bit; the
// host's waits refused during the capture, the communicator usable afterwards; with three
// batch-norm layers the same running statistics and num_batches_tracked; a capture without a
// plain step before it refused before any work; a staged_read enqueued under capture read after
// every launch. Every case needs a GPU (tagged [gpu]). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/gpu_group.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/train/data_parallel.hpp"

#include "cuda_test_support.hpp"
#include "gpu_linear_net.hpp"
#include "gpu_test_net.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace {

using namespace lockstep;
namespace lin = lockstep_test::linear;
using linear_net = lin::net<nccl_communicator>;
using context_type = linear_net::context_type;
// 8-byte buckets: the 5 parameters take several collectives per step.
using trainer_type = data_parallel<linear_net, optim::sgd<float, cuda_system>, sync::synchronous,
                                   reduce::bucketed<8, 8>, nccl_communicator>;

constexpr std::size_t global_batch = 8;
constexpr int launches = 10;

/// lin::grad_fn with the batch's first sample index read from device memory when the kernel
/// runs: a launch of a graph reads the batch the host staged for it.
struct staged_batch_grad_fn {
    lin::grad_fn f;
    const std::uint64_t* offset;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t task) const {
        lin::grad_fn g = f;
        g.offset = *offset + f.offset;
        g(task);
    }
};

/// Where the next step's batch starts, in device memory. The host writes it before each step
/// or launch, as a user copies the next batch into the buffer a graph reads.
struct batch_source {
    buffer<std::uint64_t, cuda_system> first;
    explicit batch_source(const cuda_system& sys) : first(1, sys) {}
    /// Blocking copy: written before the step's or launch's work is enqueued.
    void set(std::uint64_t sample, const cuda_system& sys) {
        copy(std::span<const std::uint64_t>(&sample, 1), host_system{}, first.span(), sys);
    }
    /// The step function: the model's gradient kernel over the staged batch (the range's
    /// sample_offset is the host's count, which a graph would freeze: not used).
    auto step_fn() const {
        const std::uint64_t* p = first.data();
        return [p](linear_net& n, shard_range r, context_type& ctx) {
            thrust::for_each(
                ctx.system().policy(), thrust::counting_iterator<std::size_t>(0),
                thrust::counting_iterator<std::size_t>(lin::inputs + 2),
                staged_batch_grad_fn{lin::grad_fn{n.w.value().data(), n.b.value().data(),
                                                  n.w.grad().data(), n.b.grad().data(),
                                                  ctx.loss_slot(), r.begin, r.end, 0, r.scale},
                                     p});
        };
    }
};

/// What a run saw (recorded on the replica's thread, checked on the main thread).
struct run_log {
    std::vector<double> losses; ///< per step after the warm-up, as read by the host
    std::vector<std::int64_t> result_steps;
    std::vector<float> params;
    std::int64_t steps = 0;
    std::uint64_t samples = 0;
    std::int64_t optimizer_steps = 0;
    // The capture only:
    bool ready_under_capture = true;
    std::int64_t steps_after_capture = -1;
    std::string refusal;
    errc refusal_code = errc::internal;
};

std::vector<float> to_host(std::span<const float> device, const cuda_system& sys) {
    std::vector<float> h(device.size());
    copy(device, sys, std::span<float>(h), host_system{});
    return h;
}

void finish_log(run_log& log, trainer_type& t, nccl_communicator& comm) {
    log.params = to_host(t.parameters(), comm.system());
    log.steps = t.steps();
    log.samples = t.samples();
    log.optimizer_steps = t.optimizer().step_count();
}

/// One warm-up step (NCCL connects, the momentum buffer starts), then `launches` plain steps,
/// step k on samples [k global_batch, (k + 1) global_batch).
run_log plain_run(nccl_communicator& comm, overlap_mode overlap) {
    trainer_type t(comm, [](context_type& ctx) { return linear_net(ctx); },
                   {.lr = lin::lr, .momentum = 0.9}, {.overlap = overlap});
    batch_source batch(comm.system());
    const auto fn = batch.step_fn();
    run_log log;
    for (int k = 0; k <= launches; ++k) {
        batch.set(static_cast<std::uint64_t>(k) * global_batch, comm.system());
        const step_result r = t.step(global_batch, fn);
        if (k > 0) {
            log.losses.push_back(r.loss);
            log.result_steps.push_back(r.step);
        }
    }
    finish_log(log, t, comm);
    return log;
}

/// The same warm-up, then one step captured on the communicator's stream and the graph
/// launched `launches` times on the same batches, each launch counted by count_replay().
run_log graph_run(nccl_communicator& comm, overlap_mode overlap) {
    trainer_type t(comm, [](context_type& ctx) { return linear_net(ctx); },
                   {.lr = lin::lr, .momentum = 0.9}, {.overlap = overlap});
    batch_source batch(comm.system());
    const auto fn = batch.step_fn();
    run_log log;
    batch.set(0, comm.system());
    (void)t.step(global_batch, fn);

    const cudaStream_t stream = comm.system().stream();
    LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t graph = nullptr;
    try {
        const step_result captured = t.step(global_batch, fn);
        log.ready_under_capture = captured.ready;
        log.steps_after_capture = t.steps();
        try {
            (void)t.read_result();
        } catch (const error& e) {
            log.refusal = e.what();
            log.refusal_code = e.code();
        }
    } catch (...) {
        (void)cudaStreamEndCapture(stream, &graph);
        if (graph != nullptr)
            (void)cudaGraphDestroy(graph);
        throw;
    }
    LOCKSTEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int k = 1; k <= launches; ++k) {
        batch.set(static_cast<std::uint64_t>(k) * global_batch, comm.system());
        LOCKSTEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        const step_result r = t.count_replay();
        log.losses.push_back(r.loss);
        log.result_steps.push_back(r.step);
    }
    finish_log(log, t, comm);
    LOCKSTEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
    LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
    return log;
}

template <class F>
auto on_one_gpu(F f) {
    decltype(f(std::declval<nccl_communicator&>())) log;
    gpu_group(std::vector<int>{0}).run([&](nccl_communicator& comm) { log = f(comm); });
    return log;
}

namespace tn = lockstep_test::net;
using bn_net = tn::test_net<nccl_communicator, bn::global>;
using bn_trainer = data_parallel<bn_net, optim::sgd<float, cuda_system>, sync::synchronous,
                                 reduce::bucketed<32, 16>, nccl_communicator>;

/// What a run with the batch-norm network ends with, and what a refused capture saw.
struct bn_log {
    std::vector<float> params;
    std::vector<std::vector<float>> running; ///< per layer: running mean, then running var
    std::vector<std::int64_t> tracked;       ///< per layer: num_batches_tracked
    std::int64_t steps = 0;
    std::int64_t optimizer_steps = 0;
    std::string refusal;
    errc refusal_code = errc::internal;
};

void finish_bn_log(bn_log& log, bn_trainer& t, const cuda_system& sys) {
    log.params = to_host(std::span<const float>(t.parameters()), sys);
    for (int l = 0; l < 3; ++l) {
        auto& layer = t.network().bn(l);
        std::vector<float> r = to_host(std::span<const float>(layer.running_mean()), sys);
        const std::vector<float> v = to_host(std::span<const float>(layer.running_var()), sys);
        r.insert(r.end(), v.begin(), v.end());
        log.running.push_back(r);
        log.tracked.push_back(layer.num_batches_tracked());
    }
    log.steps = t.steps();
    log.optimizer_steps = t.optimizer().step_count();
}

/// The batch-norm network (the same batch every step, fixed_data: a launch repeats the host's
/// arguments) with 2 micro-batches per step (each layer counts 2 forwards a step): a warm-up
/// step, then `launches` plain steps, or one step captured and launched `launches` times, each
/// launch counted. Without `warm_up` the capture comes first: it must be refused before any
/// work, and the trainer trains on afterwards.
bn_log bn_run(nccl_communicator& comm, bool capture, bool warm_up) {
    constexpr std::size_t batch = 12;
    bn_trainer t(
        comm, [&](bn_net::context_type& ctx) { return bn_net(ctx, batch, {.fixed_data = true}); },
        {.lr = 0.05, .momentum = 0.9}, {.micro_batches = 2, .overlap = overlap_mode::never});
    const auto fn = [](bn_net& n, shard_range r, bn_net::context_type& ctx) { n.train(r, ctx); };
    bn_log log;
    if (warm_up)
        (void)t.step(batch, fn);
    if (!capture) {
        for (int k = 0; k < launches; ++k)
            (void)t.step(batch, fn);
        finish_bn_log(log, t, comm.system());
        return log;
    }
    // Relaxed, as test_trainer_gpu's batch-norm graph: the mode does not decide the refusal.
    const cudaStream_t stream = comm.system().stream();
    LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    cudaGraph_t graph = nullptr;
    try {
        (void)t.step(batch, fn);
    } catch (const error& e) {
        log.refusal = e.what();
        log.refusal_code = e.code();
    } catch (...) {
        (void)cudaStreamEndCapture(stream, &graph);
        if (graph != nullptr)
            (void)cudaGraphDestroy(graph);
        throw;
    }
    LOCKSTEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    if (warm_up && !log.refusal.empty()) { // unexpected: the test reports it, nothing is launched
        LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
        return log;
    }
    if (!warm_up) {
        // Refused before any work: an empty capture; the replica trains on.
        std::size_t nodes = 1;
        LOCKSTEP_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
        LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
        LOCKSTEP_REQUIRE(nodes == 0, errc::internal, comm.rank(), "bn_run", "the refused capture ",
                         "holds ", nodes, " nodes");
        (void)t.step(batch, fn);
        finish_bn_log(log, t, comm.system());
        return log;
    }
    cudaGraphExec_t exec = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int k = 0; k < launches; ++k) {
        LOCKSTEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        (void)t.count_replay();
    }
    comm.synchronize();
    LOCKSTEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
    LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
    finish_bn_log(log, t, comm.system());
    return log;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

} // namespace

TEST_CASE("a step captured in a CUDA graph and launched 10 times equals 10 plain steps, bit for "
          "bit",
          "[train][nccl][graph][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const overlap_mode overlap = GENERATE(overlap_mode::never, overlap_mode::always);
    INFO("overlap " << (overlap == overlap_mode::never ? "never" : "always"));
    const run_log plain = on_one_gpu([&](nccl_communicator& c) { return plain_run(c, overlap); });
    const run_log graph = on_one_gpu([&](nccl_communicator& c) { return graph_run(c, overlap); });

    // The capture recorded the step without running or counting it, and refused the wait.
    CHECK(!graph.ready_under_capture);
    CHECK(graph.steps_after_capture == 1);
    CHECK(graph.refusal_code == errc::invalid_argument);
    CHECK_THAT(graph.refusal, Catch::Contains("data_parallel.read_result") &&
                                  Catch::Contains("being captured into a CUDA graph"));

    // Each launch read its own result; the weights, the device step count and the host's
    // counters are those of the plain steps.
    REQUIRE(graph.losses.size() == static_cast<std::size_t>(launches));
    REQUIRE(plain.losses.size() == static_cast<std::size_t>(launches));
    for (std::size_t k = 0; k < graph.losses.size(); ++k) {
        INFO("step " << k + 1);
        CHECK(graph.losses[k] == plain.losses[k]);
        CHECK(graph.result_steps[k] == static_cast<std::int64_t>(k + 1));
        CHECK(plain.result_steps[k] == static_cast<std::int64_t>(k + 1));
    }
    // The batches differ per step, so the losses do: a launch that read a stale batch or an
    // old result would repeat one.
    CHECK(plain.losses[0] != plain.losses[1]);
    REQUIRE(graph.params.size() == lin::inputs + 1);
    for (std::size_t i = 0; i < graph.params.size(); ++i)
        CHECK(graph.params[i] == plain.params[i]);
    CHECK(graph.steps == launches + 1);
    CHECK(plain.steps == launches + 1);
    CHECK(graph.samples == plain.samples);
    CHECK(graph.optimizer_steps == launches + 1);
    CHECK(plain.optimizer_steps == launches + 1);
}

TEST_CASE("a staged_read enqueued under capture is refused during it and read after each launch",
          "[system][nccl][graph][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    std::vector<double> seen;
    std::string refusal;
    gpu_group(std::vector<int>{0}).run([&](nccl_communicator& comm) {
        const cuda_system sys = comm.system();
        buffer<double, cuda_system> value(1, sys);
        staged_read<double, cuda_system> read(1, sys);
        const cudaStream_t stream = sys.stream();
        LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        cudaGraph_t graph = nullptr;
        read.enqueue(std::span<const double>(value.span()));
        try {
            (void)wait_for(comm, read, "test read");
        } catch (const error& e) {
            refusal = e.what();
        }
        LOCKSTEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int k = 1; k <= 3; ++k) {
            const double v = 1.5 * k;
            copy(std::span<const double>(&v, 1), host_system{}, value.span(), sys);
            LOCKSTEP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
            seen.push_back(wait_for(comm, read, "test read")[0]);
        }
        LOCKSTEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
        LOCKSTEP_CUDA_CHECK(cudaGraphDestroy(graph));
    });
    CHECK_THAT(refusal,
               Catch::Contains("test read") && Catch::Contains("being captured into a CUDA graph"));
    CHECK(seen == std::vector<double>{1.5, 3.0, 4.5});
}

TEST_CASE("a step with batch norm captured in a CUDA graph and launched 10 times equals 10 plain "
          "steps, bit for bit, num_batches_tracked included",
          "[train][nccl][graph][bn][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const bn_log plain = on_one_gpu([](nccl_communicator& c) { return bn_run(c, false, true); });
    const bn_log graph = on_one_gpu([](nccl_communicator& c) { return bn_run(c, true, true); });
    CHECK(graph.refusal.empty());
    CHECK(same_bits(graph.params, plain.params));
    REQUIRE(graph.running.size() == 3);
    REQUIRE(plain.running.size() == 3);
    for (std::size_t l = 0; l < 3; ++l) {
        INFO("layer " << l);
        CHECK(same_bits(graph.running[l], plain.running[l]));
        // 2 micro-batches a step, 1 + launches steps: each counted launch counts as a step.
        CHECK(plain.tracked[l] == 2 * (launches + 1));
        CHECK(graph.tracked[l] == plain.tracked[l]);
    }
    CHECK(graph.steps == launches + 1);
    CHECK(plain.steps == launches + 1);
    CHECK(graph.optimizer_steps == plain.optimizer_steps);
}

TEST_CASE("a step captured before any plain step is refused before any work; the trainer trains "
          "on",
          "[train][nccl][graph][bn][gpu]") {
    if (lockstep_test::skip_without_gpu())
        return;
    const bn_log log = on_one_gpu([](nccl_communicator& c) { return bn_run(c, true, false); });
    CHECK(log.refusal_code == errc::invalid_argument);
    CHECK_THAT(log.refusal,
               Catch::Contains("replica 0: data_parallel.step") &&
                   Catch::Contains("being captured into a CUDA graph") &&
                   Catch::Contains("no plain step ran on this trainer before the capture") &&
                   Catch::Contains("run one plain step of global batch 12 before capturing"));
    // Only the plain step after the refusal ran and counted.
    CHECK(log.steps == 1);
    CHECK(log.optimizer_steps == 1);
    for (std::size_t l = 0; l < 3; ++l)
        CHECK(log.tracked[l] == 2);
}

// examples/gpu_digits/gpu_digits.cu: a user-written network trained data-parallel on GPUs with
// lockstep: fc1 (cuBLAS) -> synchronized batch norm -> ReLU -> dropout -> fc2 (cuBLAS) -> softmax
// cross-entropy, every kernel on the replica's communicator stream; one replica per visible GPU
// (gpu_group), or one MPI process per GPU (--mpi). SPDX-License-Identifier: Apache-2.0
#include "../digits/digits_data.hpp"
#include <lockstep/comm/gpu_group.hpp>

#include <lockstep/comm/nccl_communicator.hpp>
#include <lockstep/nn/batch_norm.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/policy/bn.hpp>
#include <lockstep/policy/reduce.hpp>
#include <lockstep/policy/sync.hpp>
#include <lockstep/train/data_parallel.hpp>
#include <lockstep/train/rng.hpp>
#if LOCKSTEP_HAS_MPI
#include <lockstep/comm/mpi_environment.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#ifndef LOCKSTEP_DIGITS_CSV
#define LOCKSTEP_DIGITS_CSV "data/digits.csv.gz"
#endif

namespace {

using lockstep::cuda_system;
using lockstep::nccl_communicator;
using context_type = lockstep::replica_context<float, nccl_communicator>;

constexpr int features = digits::features; // 64
constexpr int hidden = 128;
constexpr int classes = digits::classes; // 10
constexpr float dropout_p = 0.1f;
constexpr std::uint32_t dropout_stream = 1;

struct options {
    int epochs = 20;
    std::size_t batch = 64;
    double lr = 0.05;
    std::uint64_t seed = 1;
    double check = -1; ///< >= 0: exit 1 when the final test accuracy is below it
    bool mpi = false;
    bool progress = true;
    std::string data = LOCKSTEP_DIGITS_CSV;
};

void check_cuda_launch(int rank, const char* kernel) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        lockstep::fail(lockstep::errc::cuda, rank, kernel, cudaGetErrorString(e));
}
void check_cublas(cublasStatus_t s, int rank, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS)
        lockstep::fail(lockstep::errc::cuda, rank, what, "cuBLAS status ", static_cast<int>(s));
}
unsigned blocks(std::size_t n, unsigned threads = 256) {
    return static_cast<unsigned>((n + threads - 1) / threads);
}

// ---- the user's kernels ----------------------------------------------------------------------

/// Row i of the shard: the features and label of training sample order[sample_offset + begin + i].
__global__ void gather_kernel(const float* train_x, const int* train_y, const std::uint32_t* order,
                              std::uint64_t first, std::size_t n, float* x, int* y) {
    const std::size_t e = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
    if (e >= n * features)
        return;
    const std::size_t i = e / features;
    const std::uint32_t src = order[first + i];
    x[e] = train_x[std::size_t(src) * features + e % features];
    if (e % features == 0)
        y[i] = train_y[src];
}

/// out[i, j] += bias[j] over an n x width row-major matrix.
__global__ void add_bias_kernel(float* out, const float* bias, std::size_t n, int width) {
    const std::size_t e = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
    if (e < n * width)
        out[e] += bias[e % width];
}

/// Inverted dropout after ReLU, keyed by the GLOBAL sample index (first + i) and the unit j, so
/// a sample gets the same mask on whichever replica, for any replica count.
__global__ void relu_dropout_kernel(const float* z, float* a, std::size_t n, std::uint64_t first,
                                    lockstep::rng_stream rng, float p) {
    const std::size_t e = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
    if (e >= n * hidden)
        return;
    const float v = z[e] > 0.0f ? z[e] : 0.0f;
    const bool keep = p == 0.0f || rng.keep(first + e / hidden, e % hidden, p);
    a[e] = keep ? v / (1.0f - p) : 0.0f;
}
/// dz = da * relu'(z) * dropout's mask (recomputed from the counter, never stored).
__global__ void relu_dropout_grad_kernel(const float* z, const float* da, float* dz, std::size_t n,
                                         std::uint64_t first, lockstep::rng_stream rng, float p) {
    const std::size_t e = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
    if (e >= n * hidden)
        return;
    const bool keep = p == 0.0f || rng.keep(first + e / hidden, e % hidden, p);
    dz[e] = z[e] > 0.0f && keep ? da[e] / (1.0f - p) : 0.0f;
}

/// Per sample: dlogits = (softmax - onehot) * scale; the loss -log softmax[y] * scale is added
/// atomically into the trainer's loss slot (device memory), so no value comes back to the host.
__global__ void softmax_xent_kernel(const float* logits, const int* y, float* dlogits,
                                    std::size_t n, double scale, double* loss_slot) {
    const std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
    if (i >= n)
        return;
    const float* l = logits + i * classes;
    float m = l[0];
    for (int k = 1; k < classes; ++k)
        m = fmaxf(m, l[k]);
    float sum = 0.0f;
    for (int k = 0; k < classes; ++k)
        sum += expf(l[k] - m);
    for (int k = 0; k < classes; ++k) {
        const float p = expf(l[k] - m) / sum;
        dlogits[i * classes + k] = static_cast<float>((p - (k == y[i] ? 1.0f : 0.0f)) * scale);
    }
    if (loss_slot != nullptr)
        atomicAdd(loss_slot, (static_cast<double>(logf(sum) + m - l[y[i]])) * scale);
}

/// db[j] += sum_i d[i, j] over an n x width row-major matrix.
__global__ void bias_grad_kernel(const float* d, float* db, std::size_t n, int width) {
    const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= width)
        return;
    float s = 0.0f;
    for (std::size_t i = 0; i < n; ++i)
        s += d[i * width + j];
    db[j] += s;
}

/// correct += (argmax logits[i] == y[i]).
__global__ void count_correct_kernel(const float* logits, const int* y, std::size_t n,
                                     unsigned long long* correct) {
    const std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
    if (i >= n)
        return;
    int best = 0;
    for (int k = 1; k < classes; ++k)
        if (logits[i * classes + k] > logits[i * classes + best])
            best = k;
    if (best == y[i])
        atomicAdd(correct, 1ull);
}

// ---- the user's network ----------------------------------------------------------------------

template <class T>
lockstep::buffer<T, cuda_system> upload(const std::vector<T>& h, const cuda_system& sys) {
    lockstep::buffer<T, cuda_system> d(h.size(), sys);
    lockstep::copy(std::span<const T>(h), lockstep::host_system{}, d.span(), sys);
    return d;
}

/// The epoch shuffles: training-set index of run-wide sample s (Fisher-Yates per epoch, driven
/// by Philox under the seed), so the data order does not depend on the replica count.
std::vector<std::uint32_t> sample_order(std::size_t n, std::size_t epochs, std::uint64_t seed) {
    const lockstep::rng_stream rng{seed, 0x5eed};
    std::vector<std::uint32_t> order(n * epochs);
    for (std::size_t e = 0; e < epochs; ++e) {
        std::uint32_t* p = order.data() + e * n;
        for (std::size_t i = 0; i < n; ++i)
            p[i] = static_cast<std::uint32_t>(i);
        for (std::size_t i = n - 1; i > 0; --i)
            std::swap(p[i], p[rng.bits(e, i) % (i + 1)]);
    }
    return order;
}

/// 64 -> fc1 -> batch norm (bn::global) -> ReLU -> dropout -> fc2 -> 10. Parameters live in the
/// replica's registry (device memory); the data, the epoch order and every activation live on
/// this replica's GPU; every kernel and cuBLAS call runs on the communicator's stream.
class gpu_mlp {
public:
    using bn_policies = std::tuple<lockstep::bn::global>;
    using batch_norm =
        lockstep::nn::batch_norm<float, lockstep::bn::global, lockstep::nn::nc, cuda_system>;

    gpu_mlp(context_type& ctx, const digits::split_data& data,
            const std::vector<std::uint32_t>& order, std::size_t capacity)
        : sys_(ctx.system()), rank_(ctx.rank()), cap_(capacity),
          train_x_(upload(data.train.x, sys_)), train_y_(upload(data.train.y, sys_)),
          test_x_(upload(data.test.x, sys_)), test_y_(upload(data.test.y, sys_)),
          order_(upload(order, sys_)), test_n_(data.test.size()) {
        auto& reg = ctx.registry();
        w1_ = reg.add("fc1.weight", {hidden, features});
        b1_ = reg.add("fc1.bias", {hidden});
        gamma_ = reg.add("bn.weight", {hidden});
        beta_ = reg.add("bn.bias", {hidden});
        w2_ = reg.add("fc2.weight", {classes, hidden});
        b2_ = reg.add("fc2.bias", {classes});
        // PyTorch's Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from Philox (staged on the
        // host before finalize; replica 0's values are broadcast to every replica).
        const lockstep::rng_stream init{42, 1};
        auto uniform = [&](std::span<float> w, std::uint64_t layer, float fan_in) {
            for (std::size_t i = 0; i < w.size(); ++i)
                w[i] = (2.0f * init.uniform(layer, i) - 1.0f) / std::sqrt(fan_in);
        };
        uniform(w1_.value(), 0, features);
        uniform(b1_.value(), 1, features);
        uniform(w2_.value(), 2, hidden);
        uniform(b2_.value(), 3, hidden);
        reg.finalize();
        bn_.emplace(ctx.comm(), hidden,
                    batch_norm::parameter_spans{gamma_.value(), beta_.value(), gamma_.grad(),
                                                beta_.grad()});
        const std::size_t rows = std::max(cap_, test_n_);
        x_ = lockstep::buffer<float, cuda_system>(rows * features, sys_);
        y_ = lockstep::buffer<int, cuda_system>(rows, sys_);
        h_ = lockstep::buffer<float, cuda_system>(rows * hidden, sys_);
        z_ = lockstep::buffer<float, cuda_system>(rows * hidden, sys_);
        a_ = lockstep::buffer<float, cuda_system>(rows * hidden, sys_);
        logits_ = lockstep::buffer<float, cuda_system>(rows * classes, sys_);
        dlogits_ = lockstep::buffer<float, cuda_system>(cap_ * classes, sys_);
        correct_ = lockstep::buffer<unsigned long long, cuda_system>(1, sys_);
        lockstep::cuda_device_guard guard(sys_.device());
        check_cublas(cublasCreate(&blas_), rank_, "cublasCreate");
        // Every cuBLAS call of this replica is ordered with lockstep's kernels and collectives.
        check_cublas(cublasSetStream(blas_, sys_.stream()), rank_, "cublasSetStream");
    }
    gpu_mlp(const gpu_mlp&) = delete;
    gpu_mlp& operator=(const gpu_mlp&) = delete;
    ~gpu_mlp() {
        if (blas_ != nullptr)
            (void)cublasDestroy(blas_);
    }

    /// Forward and backward of the shard r (no host synchronisation, no host copy): gradients
    /// into the registry, the loss into ctx.loss_slot().
    void train(const lockstep::shard_range& r, context_type& ctx) {
        const std::size_t n = r.size();
        const std::uint64_t first = r.sample_index(r.begin);
        const cudaStream_t s = sys_.stream();
        const auto rng = ctx.rng(dropout_stream);
        if (n > 0) {
            gather_kernel<<<blocks(n * features), 256, 0, s>>>(
                train_x_.data(), train_y_.data(), order_.data(), first, n, x_.data(), y_.data());
            check_cuda_launch(rank_, "gather_kernel");
            linear(x_.data(), w1_.value().data(), b1_.value().data(), h_.data(), n, features,
                   hidden);
        }
        bn_->forward_train(ctx, std::span<const float>(h_.data(), n * hidden), {n, hidden},
                           std::span<float>(z_.data(), n * hidden));
        if (n > 0) {
            relu_dropout_kernel<<<blocks(n * hidden), 256, 0, s>>>(z_.data(), a_.data(), n, first,
                                                                   rng, dropout_p);
            check_cuda_launch(rank_, "relu_dropout_kernel");
            linear(a_.data(), w2_.value().data(), b2_.value().data(), logits_.data(), n, hidden,
                   classes);
            softmax_xent_kernel<<<blocks(n), 256, 0, s>>>(
                logits_.data(), y_.data(), dlogits_.data(), n, r.scale, ctx.loss_slot());
            check_cuda_launch(rank_, "softmax_xent_kernel");
            // fc2's gradients read a; then da overwrites a (h is BN's saved input: kept).
            linear_weight_grad(dlogits_.data(), a_.data(), w2_.grad().data(), b2_.grad().data(), n,
                               hidden, classes);
        }
        ctx.mark_ready(w2_);
        ctx.mark_ready(b2_);
        if (n > 0) {
            const float one = 1.0f, zero = 0.0f;
            // da^T (hidden x n) = W2^T (hidden x classes) dlogits^T (classes x n), into a_.
            check_cublas(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, hidden, int(n), classes, &one,
                                     w2_.value().data(), hidden, dlogits_.data(), classes, &zero,
                                     a_.data(), hidden),
                         rank_, "cublasSgemm(da)");
            relu_dropout_grad_kernel<<<blocks(n * hidden), 256, 0, s>>>(
                z_.data(), a_.data(), a_.data(), n, first, rng, dropout_p);
            check_cuda_launch(rank_, "relu_dropout_grad_kernel");
        }
        // dh into z_ (z is not needed any more).
        bn_->backward(ctx, std::span<const float>(a_.data(), n * hidden),
                      std::span<float>(z_.data(), n * hidden));
        ctx.mark_ready(gamma_);
        ctx.mark_ready(beta_);
        if (n > 0)
            linear_weight_grad(z_.data(), x_.data(), w1_.grad().data(), b1_.grad().data(), n,
                               features, hidden);
        ctx.mark_ready(w1_);
        ctx.mark_ready(b1_);
    }

    /// Test accuracy with the running statistics (batch_norm::forward_eval), no dropout.
    double accuracy() {
        const std::size_t n = test_n_;
        const cudaStream_t s = sys_.stream();
        linear(test_x_.data(), w1_.value().data(), b1_.value().data(), h_.data(), n, features,
               hidden);
        bn_->forward_eval(std::span<const float>(h_.data(), n * hidden), {n, hidden},
                          std::span<float>(z_.data(), n * hidden));
        relu_dropout_kernel<<<blocks(n * hidden), 256, 0, s>>>(z_.data(), a_.data(), n, 0,
                                                               lockstep::rng_stream{}, 0.0f);
        check_cuda_launch(rank_, "relu_dropout_kernel");
        linear(a_.data(), w2_.value().data(), b2_.value().data(), logits_.data(), n, hidden,
               classes);
        lockstep::cuda_device_guard guard(sys_.device());
        LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(correct_.data(), 0, sizeof(unsigned long long), s));
        count_correct_kernel<<<blocks(n), 256, 0, s>>>(logits_.data(), test_y_.data(), n,
                                                       correct_.data());
        check_cuda_launch(rank_, "count_correct_kernel");
        unsigned long long correct = 0;
        lockstep::copy(std::span<const unsigned long long>(correct_.span()), sys_,
                       std::span<unsigned long long>(&correct, 1), lockstep::host_system{});
        return static_cast<double>(correct) / static_cast<double>(n);
    }

private:
    /// out (n x fan_out, row-major) = in (n x fan_in) W^T + b, W (fan_out x fan_in) row-major:
    /// in cuBLAS's column-major terms out^T = W in^T.
    void linear(const float* in, const float* w, const float* b, float* out, std::size_t n,
                int fan_in, int fan_out) {
        const float one = 1.0f, zero = 0.0f;
        check_cublas(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, fan_out, int(n), fan_in, &one, w,
                                 fan_in, in, fan_in, &zero, out, fan_out),
                     rank_, "cublasSgemm(forward)");
        add_bias_kernel<<<blocks(n * fan_out), 256, 0, sys_.stream()>>>(out, b, n, fan_out);
        check_cuda_launch(rank_, "add_bias_kernel");
    }
    /// dW (fan_out x fan_in) += dout^T in; db += column sums of dout (accumulating).
    void linear_weight_grad(const float* dout, const float* in, float* dw, float* db, std::size_t n,
                            int fan_in, int fan_out) {
        const float one = 1.0f;
        // dW^T (fan_in x fan_out) = in^T (fan_in x n) dout (n x fan_out).
        check_cublas(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, fan_in, fan_out, int(n), &one, in,
                                 fan_in, dout, fan_out, &one, dw, fan_in),
                     rank_, "cublasSgemm(weight gradient)");
        bias_grad_kernel<<<blocks(std::size_t(fan_out), 128), 128, 0, sys_.stream()>>>(dout, db, n,
                                                                                       fan_out);
        check_cuda_launch(rank_, "bias_grad_kernel");
    }

    cuda_system sys_;
    int rank_;
    std::size_t cap_;
    lockstep::buffer<float, cuda_system> train_x_;
    lockstep::buffer<int, cuda_system> train_y_;
    lockstep::buffer<float, cuda_system> test_x_;
    lockstep::buffer<int, cuda_system> test_y_;
    lockstep::buffer<std::uint32_t, cuda_system> order_;
    std::size_t test_n_;
    context_type::handle w1_, b1_, gamma_, beta_, w2_, b2_;
    std::optional<batch_norm> bn_;
    lockstep::buffer<float, cuda_system> x_, h_, z_, a_, logits_, dlogits_;
    lockstep::buffer<int, cuda_system> y_;
    lockstep::buffer<unsigned long long, cuda_system> correct_;
    cublasHandle_t blas_ = nullptr;
};

using trainer_type = lockstep::data_parallel<gpu_mlp, lockstep::optim::sgd<float, cuda_system>,
                                             lockstep::sync::synchronous,
                                             lockstep::reduce::bucketed<>, nccl_communicator>;

/// A progress bar on stderr: [#####.....] epoch e/E loss L N samples/s.
void progress(std::size_t done, std::size_t total, double loss, double rate, int epoch,
              int epochs) {
    const int width = 30;
    std::string bar(std::size_t(width * double(done) / double(total)), '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r[%s] epoch %d/%d  loss %.4f  %9.0f samples/s", bar.c_str(), epoch,
                 epochs, loss, rate);
    if (done >= total)
        std::fprintf(stderr, "\n");
    std::fflush(stderr);
}

/// Trains on this replica (collective over comm) and returns the test accuracy (rank 0's).
double train_replica(nccl_communicator& comm, const options& o, const digits::split_data& data,
                     const std::vector<std::uint32_t>& order) {
    const bool root = comm.rank() == 0;
    const std::size_t n = data.train.size();
    const std::size_t total = n * static_cast<std::size_t>(o.epochs);
    const std::size_t steps = total / o.batch;
    const std::size_t capacity = o.batch / static_cast<std::size_t>(comm.size()) + 1;
    trainer_type trainer(
        comm, [&](context_type& ctx) { return gpu_mlp(ctx, data, order, capacity); },
        {.lr = o.lr, .momentum = 0.9},
        {.read_result = false, .seed = o.seed}); // the host reads the loss only to print it
    const auto fn = [](gpu_mlp& net, lockstep::shard_range r, context_type& ctx) {
        net.train(r, ctx);
    };
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    double loss = 0;
    for (std::size_t s = 0; s < steps; ++s) {
        (void)trainer.step(o.batch, fn);
        const auto now = std::chrono::steady_clock::now();
        const bool last = s + 1 == steps;
        // One host wait every 25 steps (and after the last): the steps in between never wait.
        if (last || (s + 1) % 25 == 0) {
            loss = trainer.read_result().loss;
            if (root && o.progress) {
                const double secs = std::chrono::duration<double>(now - start).count();
                const std::size_t done = last ? total : (s + 1) * o.batch;
                progress(done, total, loss, secs > 0 ? double((s + 1) * o.batch) / secs : 0.0,
                         std::min(o.epochs, int(double((s + 1) * o.batch) / double(n)) + 1),
                         o.epochs);
            }
        }
    }
    comm.synchronize();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double accuracy = 0;
    if (root) {
        accuracy = trainer.network().accuracy();
        std::printf("gpu_digits: %d replica(s), %zu steps of %zu samples in %.2f s (%.0f "
                    "samples/s), final loss %.4f, test accuracy %.4f\n",
                    comm.size(), steps, o.batch, secs, double(steps * o.batch) / secs, loss,
                    accuracy);
    }
    return accuracy;
}

void usage(const char* argv0) {
    std::printf("usage: %s [--epochs E] [--batch B] [--lr X] [--seed S] [--check A] [--mpi] "
                "[--data FILE] [--quiet]\n"
                "  --epochs E   passes over the training set (default 20)\n"
                "  --batch B    global batch size (default 64)\n"
                "  --lr X       SGD learning rate (momentum 0.9; default 0.05)\n"
                "  --check A    exit 1 when the final test accuracy is below A\n"
                "  --mpi        one process per GPU under mpiexec (builds with MPI)\n"
                "  --data FILE  digits CSV, gzipped or plain (default: the bundled copy)\n",
                argv0);
}

} // namespace

int main(int argc, char** argv) {
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "gpu_digits: %s needs a value\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "--epochs")
            o.epochs = std::stoi(value());
        else if (a == "--batch")
            o.batch = std::stoul(value());
        else if (a == "--lr")
            o.lr = std::stod(value());
        else if (a == "--seed")
            o.seed = std::stoull(value());
        else if (a == "--check")
            o.check = std::stod(value());
        else if (a == "--data")
            o.data = value();
        else if (a == "--mpi")
            o.mpi = true;
        else if (a == "--quiet")
            o.progress = false;
        else if (a == "--help" || a == "-h") {
            usage(argv[0]);
            return 0;
        } else {
            std::fprintf(stderr, "gpu_digits: unknown option %s (see --help)\n", a.c_str());
            return 2;
        }
    }
    if (o.epochs < 1 || o.batch < 1) {
        std::fprintf(stderr, "gpu_digits: --epochs and --batch must be >= 1\n");
        return 2;
    }
    if (lockstep::cuda_device_count() == 0) {
        std::printf("no CUDA device\n");
        return 77;
    }
    try {
        const digits::split_data data = digits::load(o.data);
        const auto order =
            sample_order(data.train.size(), static_cast<std::size_t>(o.epochs) + 1, o.seed);
        double accuracy = 0;
        if (o.mpi) {
#if LOCKSTEP_HAS_MPI
            lockstep::mpi_environment env(argc, argv);
            nccl_communicator comm(MPI_COMM_WORLD, nccl_communicator::local_device(MPI_COMM_WORLD));
            accuracy = train_replica(comm, o, data, order);
            if (comm.rank() != 0)
                return 0;
#else
            std::fprintf(stderr, "gpu_digits: --mpi needs a build with MPI\n");
            return 2;
#endif
        } else {
            lockstep::gpu_group group;
            group.run([&](nccl_communicator& comm) {
                const double a = train_replica(comm, o, data, order);
                if (comm.rank() == 0)
                    accuracy = a;
            });
        }
        if (o.check >= 0 && accuracy < o.check) {
            std::fprintf(stderr, "gpu_digits: test accuracy %.4f is below --check %.4f\n", accuracy,
                         o.check);
            return 1;
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "gpu_digits: %s\n", e.what());
        return 1;
    }
    return 0;
}

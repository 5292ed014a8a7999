// A consumer of lockstep's cuda and nccl components: its own kernel, a synchronized batch norm
// on the CUDA system and an nccl_communicator all_reduce, one replica per GPU through
// gpu_group, their results checked against the host. Where no GPU exists it is compiled and
// linked only, and exits with 77 (not_run), which tests/package reports as skipped.
// SPDX-License-Identifier: Apache-2.0
#include <lockstep/comm/gpu_group.hpp>
#include <lockstep/comm/nccl_communicator.hpp>
#include <lockstep/nn/batch_norm.hpp>
#include <lockstep/system/buffer.hpp>
#include <lockstep/train/data_parallel.hpp>

#include <cmath>
#include <cstdio>
#include <span>
#include <tuple>
#include <vector>

#if !LOCKSTEP_HAS_CUDA || !LOCKSTEP_HAS_NCCL
#error "lockstep::cuda and lockstep::nccl must enable the CUDA system and the NCCL communicator"
#endif

namespace {

using bn_layer = lockstep::nn::batch_norm<float, lockstep::bn::global, lockstep::nn::nchw,
                                          lockstep::cuda_system>;

static_assert(
    lockstep::check_compatible<lockstep::sync::synchronous, lockstep::reduce::bucketed<>,
                               lockstep::nccl_communicator, std::tuple<lockstep::bn::global>>());

/// The exit code of a run that could not run (no CUDA device): tests/package's SKIP_RETURN_CODE.
constexpr int not_run = 77;

/// This project's own kernel: x[i] = (rank + 1) * (i % 7).
__global__ void fill(float* x, unsigned n, int rank) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 7u));
}

/// Element i of replica r's x, as fill writes it.
double x_value(int r, unsigned i) {
    return static_cast<double>((r + 1) * static_cast<int>(i % 7u));
}

/// One replica's step: its kernel, batch norm with the global batch statistics, an all_reduce
/// of x. Returns the number of wrong values: the all_reduce's (exact: sums of small integers)
/// and y's, against y = (x - mean) / sqrt(var + 1e-5) (gamma 1, beta 0) with the mean and
/// biased variance of each channel over every replica's x, in double. Tolerance 1e-4 (1 + |y|):
/// the layer's float statistics of at most a few hundred small integers and its float
/// normalize are good to about 1e-6 relative; a wrong merge (this replica's statistics alone,
/// another channel's, the unbiased variance) is off by 1e-2 or more.
int replica_step(lockstep::nccl_communicator& comm) {
    const auto sys = comm.system();
    constexpr unsigned batch = 2, channels = 3, plane = 4 * 4;
    const lockstep::nn::tensor_shape shape{batch, channels, 4, 4};
    const unsigned n = batch * channels * plane;
    lockstep::buffer<float, lockstep::cuda_system> x(n, sys), y(n, sys), sum(n, sys);
    fill<<<1, 128, 0, sys.stream()>>>(x.span().data(), n, comm.rank());
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    bn_layer bn(3, {}, sys);
    const auto& cx = x;
    bn.forward_train(comm, cx.span(), shape, y.span());
    comm.all_reduce(cx.span(), sum.span(), lockstep::reduce_op::sum);
    comm.synchronize();
    lockstep::buffer<float> host(n), y_host(n);
    lockstep::copy(sum, host);
    lockstep::copy(y, y_host);
    const int size = comm.size();
    int wrong = 0;
    for (unsigned i = 0; i < n; ++i)
        if (host[i] != static_cast<float>(size * (size + 1) / 2 * static_cast<int>(i % 7u)))
            ++wrong;
    for (unsigned c = 0; c < channels; ++c) {
        double count = 0, s = 0, s2 = 0;
        for (int r = 0; r < size; ++r)
            for (unsigned b = 0; b < batch; ++b)
                for (unsigned k = 0; k < plane; ++k) {
                    const double v = x_value(r, (b * channels + c) * plane + k);
                    count += 1;
                    s += v;
                    s2 += v * v;
                }
        const double mean = s / count, var = s2 / count - mean * mean;
        for (unsigned b = 0; b < batch; ++b)
            for (unsigned k = 0; k < plane; ++k) {
                const unsigned i = (b * channels + c) * plane + k;
                const double want = (x_value(comm.rank(), i) - mean) / std::sqrt(var + 1e-5);
                if (!(std::abs(static_cast<double>(y_host[i]) - want) <=
                      1e-4 * (1 + std::abs(want))))
                    ++wrong;
            }
    }
    return wrong;
}

} // namespace

int main() {
    const int devices = lockstep::cuda_device_count();
    if (devices == 0) {
        std::printf("lockstep %d.%d.%d CUDA consumer: built and linked; no CUDA device, not run "
                    "(exit %d: skipped)\n",
                    lockstep::version.major, lockstep::version.minor, lockstep::version.patch,
                    not_run);
        return not_run;
    }
    std::vector<int> wrong(static_cast<std::size_t>(devices), 0);
    lockstep::gpu_group group;
    group.run([&](lockstep::nccl_communicator& comm) {
        wrong[static_cast<std::size_t>(comm.rank())] = replica_step(comm);
    });
    int bad = 0;
    for (int w : wrong)
        bad += w;
    std::printf("lockstep CUDA consumer: %d GPUs, %d wrong values\n", devices, bad);
    return bad == 0 ? 0 : 1;
}

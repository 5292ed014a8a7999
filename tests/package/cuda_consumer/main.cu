// A consumer of lockstep's cuda and nccl components: its own kernel, a synchronized batch norm
// on the CUDA system and an nccl_communicator all_reduce, one replica per GPU through
// gpu_group. Where no GPU exists it is compiled and linked only. SPDX-License-Identifier:
// Apache-2.0
#include <lockstep/comm/gpu_group.hpp>
#include <lockstep/comm/nccl_communicator.hpp>
#include <lockstep/nn/batch_norm.hpp>
#include <lockstep/system/buffer.hpp>
#include <lockstep/train/data_parallel.hpp>

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

/// This project's own kernel: x[i] = (rank + 1) * (i % 7).
__global__ void fill(float* x, unsigned n, int rank) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 7u));
}

/// One replica's step: its kernel, batch norm with the global batch statistics, an all_reduce
/// of the result. Returns the number of wrong values of the all_reduce.
int replica_step(lockstep::nccl_communicator& comm) {
    const auto sys = comm.system();
    const lockstep::nn::tensor_shape shape{2, 3, 4, 4};
    const unsigned n = 2 * 3 * 4 * 4;
    lockstep::buffer<float, lockstep::cuda_system> x(n, sys), y(n, sys), sum(n, sys);
    fill<<<1, 128, 0, sys.stream()>>>(x.span().data(), n, comm.rank());
    LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    bn_layer bn(3, {}, sys);
    const auto& cx = x;
    bn.forward_train(comm, cx.span(), shape, y.span());
    comm.all_reduce(cx.span(), sum.span(), lockstep::reduce_op::sum);
    comm.synchronize();
    lockstep::buffer<float> host(n);
    lockstep::copy(sum, host);
    const int size = comm.size();
    int wrong = 0;
    for (unsigned i = 0; i < n; ++i)
        if (host[i] != static_cast<float>(size * (size + 1) / 2 * static_cast<int>(i % 7u)))
            ++wrong;
    return wrong;
}

} // namespace

int main() {
    const int devices = lockstep::cuda_device_count();
    if (devices == 0) {
        std::printf("lockstep %d.%d.%d CUDA consumer: built and linked; no CUDA device, not run\n",
                    lockstep::version.major, lockstep::version.minor, lockstep::version.patch);
        return 0;
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

// gpu_bench's cuDNN batch norm: the legacy training forward/backward in SPATIAL and
// SPATIAL_PERSISTENT mode and the ...Ex calls (with their workspace and reserve space) in both
// modes, on one shape. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime_api.h>
#include <cudnn.h>

namespace gpu_bench {

#define GPU_BENCH_CUDNN(expr)                                                                      \
    do {                                                                                           \
        const cudnnStatus_t gpu_bench_status_ = (expr);                                            \
        if (gpu_bench_status_ != CUDNN_STATUS_SUCCESS) {                                           \
            std::fprintf(stderr, "%s failed: %s\n", #expr,                                         \
                         cudnnGetErrorString(gpu_bench_status_));                                  \
            std::exit(1);                                                                          \
        }                                                                                          \
    } while (0)

/// The cuDNN entry points a user of cuDNN would pick between.
enum class cudnn_api { spatial, persistent, ex_spatial, ex_persistent };
inline constexpr cudnn_api cudnn_apis[] = {cudnn_api::spatial, cudnn_api::persistent,
                                           cudnn_api::ex_spatial, cudnn_api::ex_persistent};

inline const char* name(cudnn_api a) {
    switch (a) {
    case cudnn_api::spatial:
        return "spatial";
    case cudnn_api::persistent:
        return "persistent";
    case cudnn_api::ex_spatial:
        return "ex_spatial";
    default:
        return "ex_persistent";
    }
}

inline cudnnBatchNormMode_t mode_of(cudnn_api a) {
    return a == cudnn_api::spatial || a == cudnn_api::ex_spatial
               ? CUDNN_BATCHNORM_SPATIAL
               : CUDNN_BATCHNORM_SPATIAL_PERSISTENT;
}

inline bool is_ex(cudnn_api a) {
    return a == cudnn_api::ex_spatial || a == cudnn_api::ex_persistent;
}

/// cuDNN's batch norm on one (N, C, H, W) tensor in NCHW or NHWC: float parameters (as
/// cudnnDeriveBNTensorDescriptor gives for float, half and bfloat16 data), its own saved
/// statistics, parameter gradients, workspace and reserve space, on the handle's stream.
class cudnn_bn {
public:
    cudnn_bn(cudnnHandle_t handle, int n, int c, int h, int w, bool nhwc, cudnnDataType_t type)
        : handle_(handle), channels_(static_cast<std::size_t>(c)) {
        GPU_BENCH_CUDNN(cudnnCreateTensorDescriptor(&xd_));
        GPU_BENCH_CUDNN(cudnnCreateTensorDescriptor(&pd_));
        // a type or layout cuDNN refuses is a result (prepare returns it), not the end of the run
        init_ = cudnnSetTensor4dDescriptor(xd_, nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, type,
                                           n, c, h, w);
        if (init_ == CUDNN_STATUS_SUCCESS)
            init_ = cudnnDeriveBNTensorDescriptor(pd_, xd_, CUDNN_BATCHNORM_SPATIAL);
        for (float** p : {&gamma_, &beta_, &running_mean_, &running_var_, &save_mean_,
                          &save_invvar_, &dgamma_, &dbeta_})
            LOCKSTEP_CUDA_CHECK(cudaMalloc(p, channels_ * sizeof(float)));
        const std::vector<float> ones(channels_, 1.0f), zeros(channels_, 0.0f);
        for (float* p : {gamma_, running_var_})
            LOCKSTEP_CUDA_CHECK(
                cudaMemcpy(p, ones.data(), channels_ * sizeof(float), cudaMemcpyHostToDevice));
        for (float* p : {beta_, running_mean_, save_mean_, save_invvar_, dgamma_, dbeta_})
            LOCKSTEP_CUDA_CHECK(
                cudaMemcpy(p, zeros.data(), channels_ * sizeof(float), cudaMemcpyHostToDevice));
    }
    cudnn_bn(const cudnn_bn&) = delete;
    cudnn_bn& operator=(const cudnn_bn&) = delete;
    ~cudnn_bn() {
        for (void* p :
             {static_cast<void*>(gamma_), static_cast<void*>(beta_),
              static_cast<void*>(running_mean_), static_cast<void*>(running_var_),
              static_cast<void*>(save_mean_), static_cast<void*>(save_invvar_),
              static_cast<void*>(dgamma_), static_cast<void*>(dbeta_), fwd_ws_, bwd_ws_, reserve_})
            (void)cudaFree(p);
        (void)cudnnDestroyTensorDescriptor(xd_);
        (void)cudnnDestroyTensorDescriptor(pd_);
    }

    /// Sizes and allocates what api a needs (the Ex calls' workspace and reserve space).
    /// Returns cuDNN's status: anything but success means a cannot run on this shape.
    cudnnStatus_t prepare(cudnn_api a) {
        if (init_ != CUDNN_STATUS_SUCCESS)
            return init_;
        if (!is_ex(a))
            return CUDNN_STATUS_SUCCESS;
        const cudnnBatchNormMode_t mode = mode_of(a);
        std::size_t fwd = 0, bwd = 0, reserve = 0;
        cudnnStatus_t s = cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
            handle_, mode, CUDNN_BATCHNORM_OPS_BN, xd_, xd_, xd_, pd_, nullptr, &fwd);
        if (s == CUDNN_STATUS_SUCCESS)
            s = cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                handle_, mode, CUDNN_BATCHNORM_OPS_BN, xd_, xd_, xd_, nullptr, xd_, pd_, nullptr,
                &bwd);
        if (s == CUDNN_STATUS_SUCCESS)
            s = cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
                handle_, mode, CUDNN_BATCHNORM_OPS_BN, nullptr, xd_, &reserve);
        if (s != CUDNN_STATUS_SUCCESS)
            return s;
        grow(fwd_ws_, fwd_ws_bytes_, fwd);
        grow(bwd_ws_, bwd_ws_bytes_, bwd);
        grow(reserve_, reserve_bytes_, reserve);
        return CUDNN_STATUS_SUCCESS;
    }

    /// Training forward: y, running statistics, saved mean and inverse standard deviation.
    cudnnStatus_t forward(cudnn_api a, const void* x, void* y) {
        const float one = 1, zero = 0;
        if (!is_ex(a))
            return cudnnBatchNormalizationForwardTraining(
                handle_, mode_of(a), &one, &zero, xd_, x, xd_, y, pd_, gamma_, beta_, 0.1,
                running_mean_, running_var_, 1e-5, save_mean_, save_invvar_);
        return cudnnBatchNormalizationForwardTrainingEx(
            handle_, mode_of(a), CUDNN_BATCHNORM_OPS_BN, &one, &zero, xd_, x, nullptr, nullptr, xd_,
            y, pd_, gamma_, beta_, 0.1, running_mean_, running_var_, 1e-5, save_mean_, save_invvar_,
            nullptr, fwd_ws_, fwd_ws_bytes_, reserve_, reserve_bytes_);
    }

    /// Backward with the statistics the last forward of the same api saved: dx, dgamma, dbeta.
    cudnnStatus_t backward(cudnn_api a, const void* x, const void* dy, void* dx) {
        const float one = 1, zero = 0;
        if (!is_ex(a))
            return cudnnBatchNormalizationBackward(handle_, mode_of(a), &one, &zero, &one, &zero,
                                                   xd_, x, xd_, dy, xd_, dx, pd_, gamma_, dgamma_,
                                                   dbeta_, 1e-5, save_mean_, save_invvar_);
        return cudnnBatchNormalizationBackwardEx(
            handle_, mode_of(a), CUDNN_BATCHNORM_OPS_BN, &one, &zero, &one, &zero, xd_, x, nullptr,
            nullptr, xd_, dy, nullptr, nullptr, xd_, dx, pd_, gamma_, nullptr, dgamma_, dbeta_,
            1e-5, save_mean_, save_invvar_, nullptr, bwd_ws_, bwd_ws_bytes_, reserve_,
            reserve_bytes_);
    }

private:
    static void grow(void*& p, std::size_t& have, std::size_t want) {
        if (want <= have)
            return;
        LOCKSTEP_CUDA_CHECK(cudaFree(p));
        p = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaMalloc(&p, want));
        have = want;
    }

    cudnnHandle_t handle_;
    std::size_t channels_;
    cudnnStatus_t init_ = CUDNN_STATUS_SUCCESS;
    cudnnTensorDescriptor_t xd_ = nullptr, pd_ = nullptr;
    float *gamma_ = nullptr, *beta_ = nullptr, *running_mean_ = nullptr, *running_var_ = nullptr;
    float *save_mean_ = nullptr, *save_invvar_ = nullptr, *dgamma_ = nullptr, *dbeta_ = nullptr;
    void* fwd_ws_ = nullptr;
    void* bwd_ws_ = nullptr;
    void* reserve_ = nullptr;
    std::size_t fwd_ws_bytes_ = 0, bwd_ws_bytes_ = 0, reserve_bytes_ = 0;
};

} // namespace gpu_bench

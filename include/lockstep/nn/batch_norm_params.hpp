// lockstep/nn/batch_norm_params.hpp: what a batch-norm layer is built from: its runtime options
// and the caller's parameter spans. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <span>

namespace lockstep::nn {

/// What a batch_norm built over caller spans (batch_norm::parameter_spans) does with the values
/// gamma and beta already hold.
enum class initial_values {
    /// The spans are fresh (a registry tensor holds zeros until set): the layer writes gamma = 1,
    /// beta = 0. Spans that already hold a non-zero value are refused with lockstep::error.
    fresh,
    /// The caller initialised gamma and beta: the layer trains from them as they are.
    keep,
    /// The layer overwrites gamma = 1, beta = 0 whatever the spans hold.
    reset
};

/// Runtime options of a batch-norm layer.
struct batch_norm_params {
    /// Added to the variance before the square root: finite and, in the layer's param_type, at
    /// least its smallest normal value (1.2e-38 in float: backward's 1 / eps must not overflow).
    double eps = 1e-5;
    double momentum = 0.1; ///< running = (1 - momentum) * running + momentum * batch
    bool affine = true;    ///< learn gamma and beta (else y = xhat)
};

/// Views of caller-owned storage for a batch-norm layer's gamma, beta and their gradients
/// (batch_norm::parameter_spans), and what the layer does with the values gamma and beta
/// already hold (`values`).
template <class Param>
struct batch_norm_spans {
    std::span<Param> gamma, beta, dgamma, dbeta;
    initial_values values = initial_values::fresh;
};

} // namespace lockstep::nn

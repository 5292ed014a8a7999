// Must not compile: bn::group over a communicator without identity() (its split is kept per
// communicator, keyed by identity). SPDX-License-Identifier: Apache-2.0
#include "fake_collective_communicator.hpp"
#include "lockstep/nn/batch_norm.hpp"

#include <span>
#include <vector>

int main() {
    collective_only_communicator comm;
    lockstep::nn::batch_norm<float, lockstep::bn::group<2>, lockstep::nn::nc> layer(2);
    std::vector<float> x(8), y(8);
    layer.forward_train(comm, std::span<const float>(x), lockstep::nn::tensor_shape{4, 2},
                        std::span<float>(y));
}

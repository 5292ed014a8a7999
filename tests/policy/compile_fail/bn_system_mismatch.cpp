// Must not compile: a host batch-norm layer driven through a communicator of another system (its
// collectives would be handed host memory as the other system's).
// SPDX-License-Identifier: Apache-2.0
#include "fake_collective_communicator.hpp"
#include "lockstep/nn/batch_norm.hpp"

#include <span>
#include <vector>

// A system that is not the host's (as cuda_system is not), for a build without CUDA.
struct other_system {
    static constexpr bool is_host = false;
};

struct other_system_communicator : collective_only_communicator {
    using system_type = other_system;
    system_type system() const { return {}; }
    other_system_communicator split(int, int) { return {}; }
};
static_assert(lockstep::communicator<other_system_communicator>);

int main() {
    other_system_communicator comm;
    lockstep::nn::batch_norm<float, lockstep::bn::local, lockstep::nn::nc> layer(2);
    std::vector<float> x(8), y(8);
    layer.forward_train(comm, std::span<const float>(x), lockstep::nn::tensor_shape{4, 2},
                        std::span<float>(y));
}

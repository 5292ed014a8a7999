// Must not compile: data_parallel itself rejects a network with bn::global under local SGD.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <tuple>

struct net_with_sync_bn {
    using bn_policies = std::tuple<lockstep::bn::local, lockstep::bn::global>;
    explicit net_with_sync_bn(
        lockstep::replica_context<float, lockstep::thread_communicator>& ctx) {
        ctx.registry().add("w", {1});
    }
};
using trainer = lockstep::data_parallel<net_with_sync_bn, lockstep::optim::sgd<float>,
                                        lockstep::sync::local_sgd<8>>;
int main() {
    return sizeof(trainer);
}

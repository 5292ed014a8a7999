// Must not compile: a ReducePolicy tag with no lockstep::detail::collective specialisation.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"

#include <string>

struct tag_only : lockstep::reduce::policy_traits {
    static std::string name() { return "my::tag_only"; }
};
struct net {
    using bn_policies = std::tuple<>;
    explicit net(lockstep::replica_context<float, lockstep::thread_communicator>& ctx) {
        ctx.registry().add("w", {1});
    }
};
using trainer = lockstep::data_parallel<net, lockstep::optim::sgd<float>,
                                        lockstep::sync::synchronous, tag_only>;
int main() {
    return sizeof(trainer);
}

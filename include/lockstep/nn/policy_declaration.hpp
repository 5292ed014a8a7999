// lockstep/nn/policy_declaration.hpp: nn::policy_declaration, what a trainer tells the layers of
// its policies and of the BN policies the network declared, so a layer refuses a policy the
// compile-time check never saw. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/policy/compat.hpp"

#include <charconv>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep::nn {

/// A trainer's sync and reduce policies (as facts) and the names of the BN policies its network
/// declared (network_bn_policies). Every trainer makes one at construction and hands it to the
/// layers through replica_context::policies().
class policy_declaration {
public:
    policy_declaration() = default;
    policy_declaration(trainer_policy_facts trainer, std::vector<std::string> declared)
        : trainer_(trainer), declared_(std::move(declared)) {}

    /// A layer's check at each training call with the trainer's context, before its first
    /// collective: its BN policy (named `name`, with the facts `mine`) must be among the
    /// declared ones, by name: a policy that merely acts alike (bn::group<2> for bn::global)
    /// would still make the trainer compare, record and check the wrong statistics. Else
    /// lockstep::error (invalid_argument) naming the replica, `operation`, the policy, the
    /// declared ones, the fix and, where the combination cannot train at all, the sentence the
    /// compile-time check gives (bn_rule_broken). Depends on types only: every replica throws
    /// at the same call.
    void check(const bn_policy_facts& mine, const std::string& name, int replica,
               std::string_view operation) const {
        for (const std::string& d : declared_)
            if (d == name)
                return;
        const char* rule = bn_rule_broken(trainer_, mine);
        lockstep::fail(
            errc::invalid_argument, replica, std::string(operation), "a layer of policy ", name,
            " is not in the network's bn_policies (", joined_bn_policy_names(declared_),
            "): declare every BN policy the network uses, `using bn_policies = std::tuple<...>;`, "
            "so the trainer checks them at compile time",
            rule != nullptr ? std::string(". This one cannot train here: ") + rule : std::string());
    }

    /// For the asynchronous trainers: the momentum their server updates the running statistics
    /// with (async_params::bn_momentum); none (0) elsewhere.
    void set_server_momentum(double m) noexcept { server_momentum_ = m; }

    /// A layer's check of its running statistics' momentum at each training call: where a
    /// server momentum is set, `mine` must equal it. The server folds a worker's update of the
    /// running statistics (made with `mine`) into its own with its momentum: unequal, a stale
    /// gradient's statistics would mix in the worker's old ones. Else lockstep::error
    /// (invalid_argument) naming the replica, `operation`, both values and the fix.
    void check_momentum(double mine, int replica, std::string_view operation) const {
        if (server_momentum_ == 0 || mine == server_momentum_)
            return;
        lockstep::fail(errc::invalid_argument, replica, std::string(operation),
                       "this layer's momentum is ", shortest(mine),
                       " but the asynchronous trainer's server updates the running statistics "
                       "with async_params::bn_momentum = ",
                       shortest(server_momentum_),
                       ": set bn_momentum to the layers' momentum (one value for every BN layer)");
    }

private:
    static std::string shortest(double v) {
        char buf[32];
        return {buf, std::to_chars(buf, buf + sizeof buf, v).ptr};
    }

    trainer_policy_facts trainer_{};
    std::vector<std::string> declared_;
    double server_momentum_ = 0;
};

} // namespace lockstep::nn

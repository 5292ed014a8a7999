// lockstep/nn/policy_declaration.hpp: nn::policy_declaration, what a trainer tells the layers of
// its policies and of the BN policies the network declared, so a layer refuses a policy the
// compile-time check never saw. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/policy/compat.hpp"

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

private:
    trainer_policy_facts trainer_{};
    std::vector<std::string> declared_;
};

} // namespace lockstep::nn

// lockstep/train/detail/visit_check.hpp: visit_check, which holds one pass of a network's
// for_each_parameter / for_each_state to the tensors it declared. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstddef>
#include <span>
#include <string_view>
#include <unordered_map>

namespace lockstep::detail {

/// One pass of a visitor (`what`: "for_each_parameter" or "for_each_state") checked against the
/// tensors it declared at construction: the k-th call must name the k-th tensor with its size,
/// and the pass must visit them all. A visitor that skipped, reordered or resized a tensor would
/// otherwise pack a wrong gradient or leave a value behind, and only this replica would differ.
/// Every failure is lockstep::error (errc::shape_mismatch) naming the replica, the tensor and
/// both values; it is thrown where the trainer packs or unpacks, so inside a step the peers get
/// errc::peer_failure.
class visit_check {
public:
    visit_check(std::span<const tensor_info> declared, int replica, const char* what)
        : declared_(declared), replica_(replica), what_(what) {}

    /// The declared tensor the next call must be. requires: it exists and has `name` and `size`.
    const tensor_info& next(std::string_view name, std::size_t size) {
        LOCKSTEP_REQUIRE(seen_ < declared_.size(), errc::shape_mismatch, replica_, "data_parallel",
                         what_, " visited '", name, "' after the ", declared_.size(),
                         " tensors it declared at construction: ", what_, rule);
        const tensor_info& t = declared_[seen_];
        LOCKSTEP_REQUIRE(t.name == name && t.size == size, errc::shape_mismatch, replica_,
                         "data_parallel", what_, " visited '", name, "' of ", size,
                         " elements as tensor ", seen_, ", declared at construction as '", t.name,
                         "' of ", t.size, " elements: ", what_, rule);
        ++seen_;
        return t;
    }
    /// requires: every declared tensor was visited.
    void done() const {
        LOCKSTEP_REQUIRE(seen_ == declared_.size(), errc::shape_mismatch, replica_, "data_parallel",
                         what_, " visited ", seen_, " tensors, declared ", declared_.size(),
                         " at construction ('", declared_[seen_].name,
                         "' and after are missing): ", what_, rule);
    }

private:
    static constexpr const char* rule =
        " must visit the same tensors, in the same order, with the same sizes, every time";
    std::span<const tensor_info> declared_;
    int replica_;
    const char* what_;
    std::size_t seen_ = 0;
};

/// requires: the state tensors' names, the registry's (add_state) and then those for_each_state
/// visits, are distinct. A checkpoint keeps each under its name ("state.<name>"), so of two with
/// one name only one could be restored: a save would fail long after the mistake, and a network
/// that saves only later would learn of it late. Else lockstep::error (errc::invalid_argument),
/// at construction, naming the replica, the name, where each of the two comes from and the fix.
inline void check_state_names(std::span<const tensor_info> state, std::size_t registered,
                              int replica) {
    const auto source = [&](std::size_t i) {
        return i < registered ? "registry().add_state" : "for_each_state";
    };
    std::unordered_map<std::string_view, std::size_t> first;
    for (std::size_t i = 0; i < state.size(); ++i) {
        const auto [at, fresh] = first.emplace(state[i].name, i);
        LOCKSTEP_REQUIRE(fresh, errc::invalid_argument, replica, "data_parallel", "state '",
                         state[i].name, "' is declared twice (state tensors ", at->second, " from ",
                         source(at->second), " and ", i, " from ", source(i),
                         "): a checkpoint keeps each state tensor under its name; give each its "
                         "own name (e.g. prefix a layer's running statistics with the layer's "
                         "name)");
    }
}

} // namespace lockstep::detail

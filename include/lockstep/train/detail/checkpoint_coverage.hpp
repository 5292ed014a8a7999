// lockstep/train/detail/checkpoint_coverage.hpp: check_layer_state_saved, which refuses a save
// that would leave out state a layer keeps in memory of its own (batch-norm running statistics
// the network does not expose). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/train/detail/checkpoint_access.hpp"
#include "lockstep/train/detail/visitor.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep::detail::ckpt {

/// Whether the bytes [begin, end) lie in the union of `ranges` (sorted by their begin).
inline bool covered(std::uintptr_t begin, std::uintptr_t end,
                    const std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& ranges) {
    for (const auto& [b, e] : ranges) {
        if (b > begin)
            break;
        if (e > begin)
            begin = e;
        if (begin >= end)
            return true;
    }
    return begin >= end;
}

/// requires: the state every layer of dp's last step keeps in memory of its own
/// (nn::layer_step::kept: batch-norm running statistics) is among what a checkpoint of dp writes,
/// the registry's state or what the network's for_each_state visits. A layer whose running
/// statistics are not exposed would be saved without them, and a resumed run would normalize
/// with fresh ones, unnoticed. Else lockstep::error (errc::invalid_argument, operation `op`)
/// naming the replica, the layer (its number in forward order, kind and channels) and the fix,
/// which the save turns into its agreed failure (errc::checkpoint on every replica). Only the
/// trainers with a step (synchronous, local SGD) know their layers; state of another element size
/// than the trainer's values cannot be visited and is not checked.
template <class DP>
void check_layer_state_saved(DP& dp, const char* op) {
    using T = typename DP::value_type;
    auto& core = checkpoint_access::core(dp);
    const std::span<const nn::layer_state> kept = checkpoint_access::layer_states(dp);
    if (kept.empty())
        return;
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> saved;
    const auto add = [&](std::span<const T> s) {
        const auto b = reinterpret_cast<std::uintptr_t>(s.data());
        saved.emplace_back(b, b + s.size_bytes());
    };
    add(core.registry().states());
    visit_state<T>(core.network(), [&](std::string_view, std::span<T> s) { add(s); });
    std::sort(saved.begin(), saved.end());
    for (const nn::layer_state& st : kept) {
        const auto b = reinterpret_cast<std::uintptr_t>(st.data);
        LOCKSTEP_REQUIRE(st.element_bytes != sizeof(T) || covered(b, b + st.bytes, saved),
                         errc::invalid_argument, core.comm().rank(), op, "layer ", st.layer,
                         " in forward order (batch_norm, ", st.kind(), ", ", st.channels,
                         " channels) keeps running statistics that the checkpoint would leave "
                         "out: neither the network's for_each_state visits them nor the registry "
                         "holds them, and a resumed run would normalize with fresh ones; expose "
                         "them, f(\"<layer>.running_mean\", layer.running_mean()) and "
                         "f(\"<layer>.running_var\", layer.running_var()) in for_each_state");
    }
}

} // namespace lockstep::detail::ckpt

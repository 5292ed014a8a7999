// tests/train/verify_cases.hpp: the fault injection of train_params::verify_every, written once
// for the thread group and MPI: one bit of one value flipped on one replica between steps (a
// parameter, an optimizer moment, a BN running statistic), and what the error must then say.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "train_runner.hpp"

#include <bit>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>

namespace lockstep_test {

/// Where the bit is flipped.
enum class flip_target {
    parameter,       ///< fc2.weight element 4
    optimizer_state, ///< the optimizer's first state slot, element 7
    running_stat     ///< bn1.running_var element 2
};

/// The tensor and element the error must name for `t` (the optimizer slot's name is passed).
struct flip_site {
    std::string tensor;
    std::size_t element = 0;
};

/// Flips one mantissa bit (relative weight 2^-8, so that later arithmetic cannot round the
/// difference away) of the value `t` names in dp (host memory), returns the site. The optimizer
/// slot's element 7 belongs to fc1.weight, which the caller freezes: nothing else then moves.
template <class DP>
flip_site flip_one_bit(DP& dp, flip_target t) {
    using T = typename DP::value_type;
    using U = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
    constexpr U bit = U{1} << (sizeof(T) == 8 ? 44 : 15);
    const auto flip = [](T& x) { x = std::bit_cast<T>(std::bit_cast<U>(x) ^ bit); };
    switch (t) {
    case flip_target::parameter:
        for (const tensor_info& info : dp.registry().parameters())
            if (info.name == "fc2.weight") {
                flip(dp.registry().values()[info.offset + 4]);
                return {"param.fc2.weight", 4};
            }
        break;
    case flip_target::optimizer_state: {
        auto view = dp.optimizer().state();
        flip(view.slots.at(0).data[7]);
        return {"optimizer." + std::string(view.slots.at(0).name), 7};
    }
    case flip_target::running_stat:
        flip(dp.network().batch_norm().running_var()[2]);
        return {"state.bn1.running_var", 2};
    }
    return {};
}

/// "after step 3 replica 2 holds other values than replicas 0, 1: first in tensor 'X'", and
/// " at element E: " — the parts of the error every replica must throw (n replicas, the flip on
/// replica `odd`).
inline std::string expected_divergence(std::int64_t step, int odd, int n, const flip_site& s) {
    std::string others;
    for (int r = 0; r < n; ++r)
        if (r != odd)
            others += (others.empty() ? "" : ", ") + std::to_string(r);
    return "after step " + std::to_string(step) + " replica " + std::to_string(odd) +
           " holds other values than replica" + (n > 2 ? "s " : " ") + others +
           ": first in tensor '" + s.tensor + "'";
}

} // namespace lockstep_test

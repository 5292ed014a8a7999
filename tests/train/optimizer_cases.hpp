// tests/train/optimizer_cases.hpp: the optimizers of the train tests, each with settings that move
// the test network's weights visibly within 20 steps. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/sgd.hpp"

namespace lockstep_test {

/// A case: `type` is the optimizer, params() its settings.
template <class T>
struct sgd_case {
    using type = lockstep::optim::sgd<T>;
    static lockstep::optim::sgd_params params() {
        return {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true};
    }
};
template <class T>
struct adam_case {
    using type = lockstep::optim::adam<T>;
    static lockstep::optim::adam_params params() { return {.lr = 1e-2, .weight_decay = 1e-3}; }
};
template <class T>
struct adamw_case {
    using type = lockstep::optim::adamw<T>;
    static lockstep::optim::adamw_params params() { return {.lr = 1e-2, .weight_decay = 1e-2}; }
};
template <class T>
struct lars_case {
    using type = lockstep::optim::lars<T>;
    static lockstep::optim::lars_params params() {
        return {.lr = 1.0, .momentum = 0.9, .eta = 0.02, .weight_decay = 1e-4};
    }
};
template <class T>
struct lamb_case {
    using type = lockstep::optim::lamb<T>;
    static lockstep::optim::lamb_params params() { return {.lr = 1e-2, .weight_decay = 1e-2}; }
};

} // namespace lockstep_test

// lockstep/kernels/layer_report.hpp: what a layer's device-side checks write when they find an
// error (a layer_error, the layer, a detail) and where: a layer_report.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

namespace lockstep {

/// The layer errors found on the device (layer_error_record::code).
enum class layer_error { none = 0, peer_invalid_input = 1, single_value = 2 };

namespace kernels {

/// The first error a layer found, in device memory: its layer_error, the layer (in forward
/// order from 0) and a detail (a replica, or -1). Doubles, so that it can sit in a block of
/// doubles that a collective moves.
struct layer_error_record {
    double code = 0;
    double layer = 0;
    double value = 0;
};

/// Where a layer's device-side checks report, as device pointers:
/// - `errors` null: the layer's own record; `first` is overwritten by every check (code 0,
///   layer_error::none, when all is well; layer and value are written too), and its owner
///   reads it back.
/// - `errors` given (a step shared by several layers): an error adds 1 to *errors and fills
///   *first when it is still empty (code 0); a check that finds nothing writes nothing.
struct layer_report {
    layer_error_record* first = nullptr;
    double* errors = nullptr;
    double layer = 0;

    LOCKSTEP_HOST_DEVICE void write(layer_error code, double value) const {
        const layer_error_record found{static_cast<double>(code), layer, value};
        if (errors == nullptr) {
            *first = found;
            return;
        }
        if (code == layer_error::none)
            return;
        *errors += 1;
        if (first->code == 0)
            *first = found;
    }
};

} // namespace kernels
} // namespace lockstep

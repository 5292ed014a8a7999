// lockstep/comm/detail/nccl_types.hpp: which element types NCCL carries (ncclDataType_t) and the
// mapping of lockstep::reduce_op to ncclRedOp_t. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/float16.hpp"

#if LOCKSTEP_HAS_NCCL

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

namespace lockstep::detail {

/// The NCCL data type of T, or ncclNumTypes when NCCL cannot carry T. Integers map by size and
/// signedness (so int, long and long long all work); __half / __nv_bfloat16 and their
/// layout-compatible portable twins lockstep::half / lockstep::bfloat16 (core/float16.hpp,
/// the wire types of reduce::compressed) are the 16-bit floating-point types.
template <class T>
constexpr ncclDataType_t nccl_data_type() noexcept {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_same_v<U, float>)
        return ncclFloat32;
    else if constexpr (std::is_same_v<U, double>)
        return ncclFloat64;
    else if constexpr (std::is_same_v<U, __half> || std::is_same_v<U, half>)
        return ncclFloat16;
    else if constexpr (std::is_same_v<U, __nv_bfloat16> || std::is_same_v<U, bfloat16>)
        return ncclBfloat16;
    else if constexpr (std::is_integral_v<U> && !std::is_same_v<U, bool>) {
        constexpr bool s = std::is_signed_v<U>;
        if constexpr (sizeof(U) == 1)
            return s ? ncclInt8 : ncclUint8;
        else if constexpr (sizeof(U) == 4)
            return s ? ncclInt32 : ncclUint32;
        else if constexpr (sizeof(U) == 8)
            return s ? ncclInt64 : ncclUint64;
        else
            return ncclNumTypes;
    } else {
        return ncclNumTypes;
    }
}

/// The NCCL reduction of a lockstep reduction.
constexpr ncclRedOp_t nccl_reduce_op(reduce_op op) noexcept {
    switch (op) {
    case reduce_op::sum:
        return ncclSum;
    case reduce_op::max:
        return ncclMax;
    case reduce_op::min:
        return ncclMin;
    }
    return ncclSum;
}

} // namespace lockstep::detail

namespace lockstep {

/// Element types an nccl_communicator carries: float, double, __half, __nv_bfloat16,
/// lockstep::half, lockstep::bfloat16 and the 8-, 32- and 64-bit integers (int, int64_t, ...).
template <class T>
concept nccl_element = detail::nccl_data_type<T>()
!= ncclNumTypes;

} // namespace lockstep

#endif // LOCKSTEP_HAS_NCCL

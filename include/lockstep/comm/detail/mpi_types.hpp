// lockstep/comm/detail/mpi_types.hpp: element types and reductions mapped to MPI datatypes and
// operators (with workarounds for MPI library bugs). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/float16.hpp"

#if !LOCKSTEP_HAS_MPI
#error                                                                                             \
    "lockstep's MPI communicator needs MPI: link lockstep::mpi (or define LOCKSTEP_HAS_MPI=1 and add MPI's include path)."
#endif

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include <mpi.h>

namespace lockstep::detail {

/// The MPI datatype of an element type, a small id for signatures, and a name for messages.
/// Only the specialisations below exist: mpi_type<T>::id is the test for "MPI can carry T".
template <class T>
struct mpi_type;
template <>
struct mpi_type<float> {
    static MPI_Datatype datatype() noexcept { return MPI_FLOAT; }
    static constexpr std::int64_t id = 1;
    static constexpr std::string_view name = "float";
};
template <>
struct mpi_type<double> {
    static MPI_Datatype datatype() noexcept { return MPI_DOUBLE; }
    static constexpr std::int64_t id = 2;
    static constexpr std::string_view name = "double";
};
template <>
struct mpi_type<int> {
    static MPI_Datatype datatype() noexcept { return MPI_INT; }
    static constexpr std::int64_t id = 3;
    static constexpr std::string_view name = "int";
};
template <>
struct mpi_type<std::int64_t> {
    static MPI_Datatype datatype() noexcept { return MPI_INT64_T; }
    static constexpr std::int64_t id = 4;
    static constexpr std::string_view name = "int64_t";
};
template <>
struct mpi_type<std::uint8_t> {
    static MPI_Datatype datatype() noexcept { return MPI_UINT8_T; }
    static constexpr std::int64_t id = 5;
    static constexpr std::string_view name = "uint8_t";
};

/// The 16-bit floats travel as their bits (MPI has no such standard type); the communicator
/// reduces them itself (detail/mpi_float16.hpp), never with an MPI_Op.
template <>
struct mpi_type<half> {
    static MPI_Datatype datatype() noexcept { return MPI_UINT16_T; }
    static constexpr std::int64_t id = 6;
    static constexpr std::string_view name = "half";
};
template <>
struct mpi_type<bfloat16> {
    static MPI_Datatype datatype() noexcept { return MPI_UINT16_T; }
    static constexpr std::int64_t id = 7;
    static constexpr std::string_view name = "bfloat16";
};

/// True for the element types the MPI communicator carries.
template <class T>
inline constexpr bool is_mpi_element = requires {
    mpi_type<std::remove_cv_t<T>>::id;
};

/// The name of the element type with signature id `id` (for error messages).
constexpr std::string_view mpi_type_name(std::int64_t id) noexcept {
    switch (id) {
    case 0:
        return "none";
    case 1:
        return "float";
    case 2:
        return "double";
    case 3:
        return "int";
    case 4:
        return "int64_t";
    case 5:
        return "uint8_t";
    case 6:
        return "half";
    case 7:
        return "bfloat16";
    }
    return "unknown";
}

inline MPI_Op create_op(MPI_User_function* f) {
    MPI_Op op = MPI_OP_NULL;
    LOCKSTEP_MPI_CHECK(MPI_Op_create(f, /*commute=*/1, &op));
    return op;
}

/// Element-wise max (Max) or min of unsigned T, as an MPI user function.
template <class T, bool Max>
void mpi_unsigned_extremum(void* in, void* inout, int* len, MPI_Datatype*) {
    const T* a = static_cast<const T*>(in);
    T* b = static_cast<T*>(inout);
    for (int i = 0; i < *len; ++i)
        if (Max ? a[i] > b[i] : a[i] < b[i])
            b[i] = a[i];
}

/// The MPI operator of a reduction over T. MPI_MAX and MPI_MIN on unsigned types compare them as
/// signed in MPICH 4.0.2 (pmodels/mpich#6083; Debian 12's MPICH: max(5, 200) over MPI_UINT8_T
/// gives 5) and in Open MPI 4.1.4 (open-mpi/ompi#10648), so unsigned types use lockstep's own
/// commutative operators, created once per process (MPI_Finalize releases them).
template <class T>
MPI_Op to_mpi_op(reduce_op op) {
    if constexpr (std::is_unsigned_v<T>) {
        if (op != reduce_op::sum) {
            static const MPI_Op max = create_op(&mpi_unsigned_extremum<T, true>);
            static const MPI_Op min = create_op(&mpi_unsigned_extremum<T, false>);
            return op == reduce_op::max ? max : min;
        }
    }
    switch (op) {
    case reduce_op::sum:
        return MPI_SUM;
    case reduce_op::max:
        return MPI_MAX;
    case reduce_op::min:
        return MPI_MIN;
    }
    return MPI_OP_NULL;
}

/// True for MPI libraries whose MPI_Reduce crashes on MPI_IN_PLACE at a root other than 0
/// (MPICH 4.0 and 4.1, pmodels/mpich#6540).
#if defined(MPICH_NUMVERSION) && MPICH_NUMVERSION >= 40000000 && MPICH_NUMVERSION < 40200000
inline constexpr bool mpi_in_place_reduce_broken = true;
#else
inline constexpr bool mpi_in_place_reduce_broken = false;
#endif

/// MPI's text for an error code, with the code.
inline std::string mpi_error_text(int rc) {
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
        len = 0;
    return std::string(text, static_cast<std::size_t>(len)) + " (MPI code " + std::to_string(rc) +
           ")";
}

} // namespace lockstep::detail

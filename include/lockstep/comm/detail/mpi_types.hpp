// lockstep/comm/detail/mpi_types.hpp: element types and reductions mapped to MPI datatypes and
// operators, and the signature a verified collective exchanges. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"

#if !LOCKSTEP_HAS_MPI
#error                                                                                             \
    "lockstep's MPI communicator needs MPI: link lockstep::mpi (or define LOCKSTEP_HAS_MPI=1 and add MPI's include path)."
#endif

#include <array>
#include <cstdint>
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

/// The collectives a signature can name.
enum class mpi_collective : std::int64_t {
    none = 0,
    all_reduce,
    broadcast,
    all_gather,
    reduce,
    barrier,
    split
};

constexpr std::string_view to_string(mpi_collective c) noexcept {
    switch (c) {
    case mpi_collective::none:
        return "none";
    case mpi_collective::all_reduce:
        return "all_reduce";
    case mpi_collective::broadcast:
        return "broadcast";
    case mpi_collective::all_gather:
        return "all_gather";
    case mpi_collective::reduce:
        return "reduce";
    case mpi_collective::barrier:
        return "barrier";
    case mpi_collective::split:
        return "split";
    }
    return "unknown";
}

/// What every replica must agree on before a collective runs. Fields that do not apply are 0
/// (root and op of an all_gather); `arguments_ok` is 0 on a replica whose own arguments failed
/// a local check, so the others are released with an error instead of waiting for it.
struct mpi_signature {
    enum field : std::size_t { kind, sequence, count, type, root, op, arguments_ok, fields };
    std::array<std::int64_t, fields> value{};
};

/// The element-wise minimum and maximum of every replica's signature, from one MPI_Allreduce
/// with MPI_MAX over {v, -v}: max(-v) = -min(v), so one call of 2 * fields int64 gives both.
struct mpi_signature_range {
    mpi_signature min, max;
    bool agree(mpi_signature::field f) const noexcept { return min.value[f] == max.value[f]; }
};

inline int mpi_signature_range_exchange(const mpi_signature& mine, MPI_Comm comm,
                                        mpi_signature_range& out) noexcept {
    std::array<std::int64_t, 2 * mpi_signature::fields> v{};
    for (std::size_t i = 0; i < mpi_signature::fields; ++i) {
        v[i] = mine.value[i];
        v[mpi_signature::fields + i] = -mine.value[i];
    }
    const int rc = MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_INT64_T,
                                 MPI_MAX, comm);
    for (std::size_t i = 0; i < mpi_signature::fields; ++i) {
        out.max.value[i] = v[i];
        out.min.value[i] = -v[mpi_signature::fields + i];
    }
    return rc;
}

} // namespace lockstep::detail

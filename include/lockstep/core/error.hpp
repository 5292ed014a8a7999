// lockstep/core/error.hpp: lockstep::error (code + message naming replica, operation, values)
// and checked wrappers for CUDA, NCCL and MPI calls. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#if LOCKSTEP_HAS_CUDA
#include <cuda_runtime_api.h>
#endif
#if LOCKSTEP_HAS_NCCL
#include <nccl.h>
#endif
#if LOCKSTEP_HAS_MPI
#include <mpi.h>
#endif

namespace lockstep {

/// What went wrong, coarsely; the message has the details.
enum class errc {
    invalid_argument, ///< a precondition on an argument does not hold
    shape_mismatch,   ///< tensors or parameters disagree in shape, count or type
    count_mismatch,   ///< replicas passed different element counts to one collective
    timeout,          ///< a participant did not arrive at a collective in time
    peer_failure,     ///< another replica failed; this one was released with an error
    communication,    ///< a transport failed (MPI, NCCL, shared memory)
    cuda,             ///< a CUDA runtime call failed
    nccl,             ///< an NCCL call failed
    mpi,              ///< an MPI call failed
    non_finite,       ///< a NaN or infinity where a finite value is required
    checkpoint,       ///< a checkpoint is truncated, corrupted or does not match
    unsupported,      ///< the operation is not available on this backend or build
    divergence,       ///< replicas that must hold identical values do not (verify_every)
    internal          ///< a broken invariant inside lockstep (a bug)
};

/// The name of an error code, e.g. "count_mismatch".
constexpr std::string_view to_string(errc c) noexcept {
    switch (c) {
    case errc::invalid_argument:
        return "invalid_argument";
    case errc::shape_mismatch:
        return "shape_mismatch";
    case errc::count_mismatch:
        return "count_mismatch";
    case errc::timeout:
        return "timeout";
    case errc::peer_failure:
        return "peer_failure";
    case errc::communication:
        return "communication";
    case errc::cuda:
        return "cuda";
    case errc::nccl:
        return "nccl";
    case errc::mpi:
        return "mpi";
    case errc::non_finite:
        return "non_finite";
    case errc::checkpoint:
        return "checkpoint";
    case errc::unsupported:
        return "unsupported";
    case errc::divergence:
        return "divergence";
    case errc::internal:
        return "internal";
    }
    return "unknown";
}

/// The one exception type lockstep throws from host code.
/// ensures: what() reads "lockstep error [code] replica R: operation: details" (the replica
/// part is left out when no replica is known, replica() == -1).
class error : public std::runtime_error {
public:
    error(errc code, int replica, std::string operation, const std::string& details)
        : std::runtime_error(compose(code, replica, operation, details)), code_(code),
          replica_(replica), operation_(std::move(operation)), details_(details) {}

    /// The error code.
    errc code() const noexcept { return code_; }
    /// The replica (rank) that raised the error, or -1 when unknown.
    int replica() const noexcept { return replica_; }
    /// The operation that failed, e.g. "all_reduce #12" or "batch_norm.forward".
    const std::string& operation() const noexcept { return operation_; }
    /// What failed, as passed: what() without the code, replica and operation (so a handler can
    /// rethrow with a cause added, keeping the rest).
    const std::string& details() const noexcept { return details_; }

private:
    static std::string compose(errc code, int replica, const std::string& op,
                               const std::string& details) {
        std::string s = "lockstep error [";
        s += to_string(code);
        s += "] ";
        if (replica >= 0)
            s += "replica " + std::to_string(replica) + ": ";
        if (!op.empty())
            s += op + ": ";
        s += details;
        return s;
    }

    errc code_;
    int replica_;
    std::string operation_;
    std::string details_;
};

namespace detail {
/// Streams every argument into one string (the message builder of every check).
template <class... Args>
std::string concat(Args&&... args) {
    std::ostringstream os;
    (os << ... << std::forward<Args>(args));
    return os.str();
}
} // namespace detail

/// Throws lockstep::error(code, replica, operation, concat(details...)).
template <class... Args>
[[noreturn]] void fail(errc code, int replica, std::string operation, Args&&... details) {
    throw error(code, replica, std::move(operation),
                detail::concat(std::forward<Args>(details)...));
}

/// The exit status for a process that ends on `e`, as a launcher that relaunches failed jobs
/// reads it (tools/lockstep-run, docs/fault_tolerance.md): 75 (EX_TEMPFAIL, "try again") when a
/// participant did not arrive in time or a transport failed (errc::timeout, errc::communication):
/// a replica hung or became unreachable, and a relaunch may succeed; 1 for any other error
/// (a rerun would meet it again).
inline int exit_status(const std::exception& e) noexcept {
    const auto* le = dynamic_cast<const error*>(&e);
    const bool try_again =
        le != nullptr && (le->code() == errc::timeout || le->code() == errc::communication);
    return try_again ? 75 : 1;
}

} // namespace lockstep

/// Throws lockstep::error when cond is false; the remaining arguments are streamed into the
/// message. Usage: LOCKSTEP_REQUIRE(n > 0, errc::invalid_argument, rank, "shard", "n = ", n);
#define LOCKSTEP_REQUIRE(cond, code, replica, operation, ...)                                      \
    do {                                                                                           \
        if (!(cond))                                                                               \
            ::lockstep::fail((code), (replica), (operation), __VA_ARGS__);                         \
    } while (0)

#if LOCKSTEP_HAS_CUDA
namespace lockstep::detail {
[[noreturn]] inline void throw_cuda(cudaError_t e, const char* expr, const char* file, int line) {
    fail(errc::cuda, -1, expr, cudaGetErrorName(e), " (", cudaGetErrorString(e), ") at ", file, ":",
         line);
}
} // namespace lockstep::detail
/// Checks a CUDA runtime call; a failure throws lockstep::error with code errc::cuda.
#define LOCKSTEP_CUDA_CHECK(expr)                                                                  \
    do {                                                                                           \
        const cudaError_t lockstep_cuda_status_ = (expr);                                          \
        if (lockstep_cuda_status_ != cudaSuccess)                                                  \
            ::lockstep::detail::throw_cuda(lockstep_cuda_status_, #expr, __FILE__, __LINE__);      \
    } while (0)
#endif

#if LOCKSTEP_HAS_NCCL
namespace lockstep::detail {
[[noreturn]] inline void throw_nccl(ncclResult_t r, const char* expr, const char* file, int line) {
    fail(errc::nccl, -1, expr, ncclGetErrorString(r), " (ncclResult_t ", static_cast<int>(r),
         ") at ", file, ":", line);
}
} // namespace lockstep::detail
/// Checks an NCCL call; a failure throws lockstep::error with code errc::nccl.
#define LOCKSTEP_NCCL_CHECK(expr)                                                                  \
    do {                                                                                           \
        const ncclResult_t lockstep_nccl_status_ = (expr);                                         \
        if (lockstep_nccl_status_ != ncclSuccess)                                                  \
            ::lockstep::detail::throw_nccl(lockstep_nccl_status_, #expr, __FILE__, __LINE__);      \
    } while (0)
#endif

#if LOCKSTEP_HAS_MPI
namespace lockstep::detail {
[[noreturn]] inline void throw_mpi(int code, const char* expr, const char* file, int line) {
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    if (MPI_Error_string(code, text, &len) != MPI_SUCCESS)
        len = 0;
    int rank = -1;
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized)
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    fail(errc::mpi, rank, expr, std::string(text, static_cast<std::size_t>(len)), " (MPI code ",
         code, ") at ", file, ":", line);
}
} // namespace lockstep::detail
/// Checks an MPI call (the communicator must use MPI_ERRORS_RETURN); a failure throws
/// lockstep::error with code errc::mpi.
#define LOCKSTEP_MPI_CHECK(expr)                                                                   \
    do {                                                                                           \
        const int lockstep_mpi_status_ = (expr);                                                   \
        if (lockstep_mpi_status_ != MPI_SUCCESS)                                                   \
            ::lockstep::detail::throw_mpi(lockstep_mpi_status_, #expr, __FILE__, __LINE__);        \
    } while (0)
#endif

// What the multi-rank NCCL tests (test_nccl_ranks_*.cu, one process per rank started by the rank
// launcher) share: this rank's communicator from one NCCL id, comparisons with rank 0 through
// the launcher (not through the communicator under test), bit hashes. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "support/rank_process.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <nccl.h>

namespace lockstep_test::nccl_ranks {

namespace launcher = lockstep_test::ranks;

/// The device this rank drives: its rank modulo the devices it sees (one GPU: every rank on
/// device 0, as separate NCCL "hosts"; several: one rank per GPU while there are enough).
/// requires: a CUDA device (the rank main launches no rank without one).
inline int rank_device() {
    const int devices = lockstep::cuda_device_count();
    LOCKSTEP_REQUIRE(devices > 0, lockstep::errc::cuda, launcher::rank(), "rank_device",
                     "no CUDA device in a rank process");
    return launcher::rank() % devices;
}

/// This rank's communicator over every rank the launcher started: rank 0 makes the NCCL id
/// (ncclGetUniqueId), the launcher hands it to every rank, each joins with its rank on
/// rank_device() (ncclCommInitRank; returns once every rank joined). `options`: the timeout of
/// its waits (default: LOCKSTEP_TIMEOUT, else 10 minutes); `stream`: a stream to adopt.
/// ensures: rank() and size() are the launcher's.
inline lockstep::nccl_communicator rank_communicator(lockstep::nccl_options options = {},
                                                     cudaStream_t stream = nullptr) {
    const int rank = launcher::rank();
    const int device = rank_device();
    ncclUniqueId id{};
    std::vector<std::byte> mine;
    if (rank == 0) {
        LOCKSTEP_CUDA_CHECK(cudaSetDevice(device));
        LOCKSTEP_NCCL_CHECK(ncclGetUniqueId(&id));
        mine.resize(sizeof id);
        std::memcpy(mine.data(), &id, sizeof id);
    }
    const std::vector<std::byte> shared = launcher::share_from_rank0(mine);
    LOCKSTEP_REQUIRE(shared.size() == sizeof id, lockstep::errc::internal, rank,
                     "rank_communicator", "the launcher handed out ", shared.size(),
                     " bytes of NCCL id, expected ", sizeof id);
    std::memcpy(&id, shared.data(), sizeof id);
    return lockstep::nccl_communicator(id, launcher::size(), rank, device, options, stream);
}

/// Rank 0's `mine` on every rank (each passes its own; rank 0's travels through the launcher).
/// requires: T trivially copyable; at most 1 MiB.
template <class T>
std::vector<T> rank0_values(const std::vector<T>& mine) {
    static_assert(std::is_trivially_copyable_v<T>);
    const std::span<const std::byte> bytes = launcher::rank() == 0
                                                 ? std::as_bytes(std::span<const T>(mine))
                                                 : std::span<const std::byte>();
    const std::vector<std::byte> got = launcher::share_from_rank0(bytes);
    std::vector<T> out(got.size() / sizeof(T));
    if (!out.empty())
        std::memcpy(out.data(), got.data(), out.size() * sizeof(T));
    return out;
}

/// FNV-1a over the values' bits, one element at a time (equal hashes: equal bits).
template <class T>
std::uint64_t hash_bits(const std::vector<T>& v) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8);
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (const T& x : v)
        h = (h ^ static_cast<std::uint64_t>(std::bit_cast<U>(x))) * 0x100000001b3ull;
    return h;
}

/// Runs f(); when it throws (a lockstep::error, a failed REQUIRE), aborts comm first, so the
/// other ranks' waits end in errc::peer_failure instead of their timeout, then rethrows.
template <class F>
decltype(auto) aborting_on_failure(lockstep::nccl_communicator& comm, F&& f) {
    try {
        return f();
    } catch (...) {
        comm.abort();
        throw;
    }
}

} // namespace lockstep_test::nccl_ranks

// lockstep/comm/detail/mpi_request_buffer.hpp: the buffers and arrays an MPI request of a
// failed operation may still use, kept forever (mpi_request_buffer, mpi_request_arrays).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// Keeps a block that an MPI request left outstanding by a failed operation may still read or
/// write (a timeout cannot cancel a collective: MPI completes it when the peers arrive): never
/// freed, and reachable, so leak checkers do not report it.
inline void keep_forever(const void* block) noexcept {
    if (block == nullptr)
        return;
    static std::mutex m;
    // Out of memory in this one first-use allocation ends the process (noexcept).
    // NOLINTNEXTLINE(bugprone-unhandled-exception-at-new)
    static auto* kept = new std::vector<const void*>();
    const std::lock_guard<std::mutex> lock(m);
    try {
        kept->push_back(block);
    } catch (...) { // out of memory: then merely unreachable, still never freed
    }
}

/// n value-initialised elements of T on the heap that the library hands to MPI as a request's
/// buffer (the signature, reduce's copy, the 16-bit exchange, ...): freed at the end of the
/// scope, unless `broken` was set meanwhile (the operation failed, so its request may be
/// outstanding): then kept forever (keep_forever), as the census keeps its buffers.
template <class T>
class mpi_request_buffer {
    static_assert(std::is_trivially_destructible_v<T>);

public:
    mpi_request_buffer(const std::optional<error>& broken, std::size_t n)
        : broken_(&broken), data_(n == 0 ? nullptr : new T[n]()), size_(n) {}
    mpi_request_buffer(const mpi_request_buffer&) = delete;
    mpi_request_buffer& operator=(const mpi_request_buffer&) = delete;
    ~mpi_request_buffer() {
        if (broken_->has_value())
            keep_forever(data_.release());
    }
    T* data() const noexcept { return data_.get(); }
    std::size_t size() const noexcept { return size_; }
    std::span<T> span() const noexcept { return {data_.get(), size_}; }

private:
    const std::optional<error>* broken_;
    std::unique_ptr<T[]> data_;
    std::size_t size_;
};

/// Guards objects whose storage an MPI request reads until it completes (the count and
/// displacement arrays of a vector collective: MPI may read them until then): declared after
/// them, it moves them to the heap and keeps them forever (keep_forever) when `broken` was set
/// meanwhile, so a timed-out request never reads freed arrays. A moved std::vector keeps its
/// buffer, which is what the request holds.
template <class... V>
class mpi_request_arrays {
public:
    explicit mpi_request_arrays(const std::optional<error>& broken, V&... v)
        : broken_(&broken), v_(v...) {}
    mpi_request_arrays(const mpi_request_arrays&) = delete;
    mpi_request_arrays& operator=(const mpi_request_arrays&) = delete;
    ~mpi_request_arrays() {
        if (!broken_->has_value())
            return;
        try {
            keep_forever(
                std::apply([](V&... v) { return new std::tuple<V...>(std::move(v)...); }, v_));
        } catch (...) { // out of memory: the arrays go with their owners
        }
    }

private:
    const std::optional<error>* broken_;
    std::tuple<V&...> v_;
};

} // namespace lockstep::detail

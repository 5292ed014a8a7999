// lockstep/comm/detail/hierarchical_staging.hpp: hierarchical_staging, where a
// hierarchical_communicator keeps its scratch and how its inter-node calls reach the intra-node
// memory (directly, or through pinned host memory). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#if LOCKSTEP_HAS_CUDA
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <optional>
#endif

namespace lockstep::detail {

/// True for the pairs of systems hierarchical_communicator composes: one host system for both
/// parts, or (CUDA builds) a device intra-node part over a host inter-node part.
template <class IntraSystem, class InterSystem>
inline constexpr bool hierarchical_systems_supported =
    std::is_same_v<IntraSystem, InterSystem>&& IntraSystem::is_host;

/// The scratch and staging of a hierarchical_communicator whose parts share one host system:
/// scratch is host memory and the inter-node part reads and writes the intra-node spans
/// themselves. Every member takes the intra-node communicator (for the staged form's waits).
template <class IntraSystem, class InterSystem>
class hierarchical_staging {
public:
    /// Slot `slot` (0 or 1) of scratch in the intra-node memory, with room for n elements of T.
    /// ensures: kept between calls; a larger n may move it (earlier spans become invalid).
    template <class T, class Intra>
    std::span<T> scratch(Intra&, int slot, std::size_t n) {
        std::vector<std::uint64_t>& s = slot == 0 ? scratch0_ : scratch1_;
        const std::size_t words =
            (n * sizeof(T) + sizeof(std::uint64_t) - 1) / sizeof(std::uint64_t);
        if (s.size() < words)
            s.resize(words);
        return std::span<T>(reinterpret_cast<T*>(s.data()), n);
    }

    /// dst = src, both intra-node memory, in order with the intra-node part's work.
    /// requires: equal sizes, no overlap.
    template <class T, class Intra>
    void copy(Intra&, std::span<T> dst, std::span<const T> src) {
        if (!src.empty())
            std::memcpy(dst.data(), src.data(), src.size_bytes());
    }

    /// Makes room for the next inter() of `out_n` elements of T (and `in_n` more for an `in`
    /// disjoint from `out`; 0 when `in` lies inside `out`). Called before the intra-node part
    /// enqueues the collective that inter() then waits for, so nothing is allocated or freed
    /// between that enqueue and its wait. Here: nothing to reserve.
    template <class T, class Intra>
    void reserve(Intra&, std::size_t /*out_n*/, std::size_t /*in_n*/) {}

    /// Runs f(in, out), an inter-node collective, on intra-node spans: here the spans
    /// themselves. requires: `in` inside `out`, or disjoint from it; reserve() made room.
    template <class T, class Intra, class F>
    void inter(Intra&, std::span<const T> in, std::span<T> out, F&& f) {
        f(in, out);
    }

    /// Runs f(in, out), a collective in the intra-node memory, on host arrays: here the arrays
    /// themselves. requires: in == out (in place) or disjoint.
    template <class T, class Intra, class F>
    void on_host(Intra&, std::span<const T> in, std::span<T> out, F&& f) {
        f(in, out);
    }

private:
    // 8-byte words: aligned for every element type the communicators carry. Two members: nvcc
    // 13.0's front end crashed (internal error) on `std::vector<std::max_align_t> scratch_[2]`.
    std::vector<std::uint64_t> scratch0_;
    std::vector<std::uint64_t> scratch1_;
};

#if LOCKSTEP_HAS_CUDA
template <>
inline constexpr bool hierarchical_systems_supported<cuda_system, host_system> = true;

/// A device intra-node part (nccl_communicator) over a host inter-node part (mpi_communicator):
/// scratch is device memory of the replica's device, allocated on its stream; every inter-node
/// call goes through pinned host memory: an asynchronous device-to-host copy on the replica's
/// stream, a wait for it through the intra-node communicator (Intra::wait polls NCCL's errors,
/// the peers' failures and the timeout: never an unbounded stream wait), the inter-node
/// collective on the pinned memory, and an asynchronous host-to-device copy back on the stream
/// that later intra-node work is ordered after (no wait). The pinned slots grow only in
/// reserve(), before the intra-node enqueue: cudaMallocHost and cudaFreeHost between an NCCL
/// enqueue and its wait can deadlock with a peer thread's NCCL call (as in host_collective.hpp).
template <>
class hierarchical_staging<cuda_system, host_system> {
public:
    hierarchical_staging() = default;
    hierarchical_staging(hierarchical_staging&&) noexcept = default;
    hierarchical_staging& operator=(hierarchical_staging&& o) noexcept {
        if (this != &o) {
            settle();
            scratch0_ = std::move(o.scratch0_);
            scratch1_ = std::move(o.scratch1_);
            pinned0_ = std::move(o.pinned0_);
            pinned1_ = std::move(o.pinned1_);
            arrived_ = std::move(o.arrived_);
            returned_ = std::move(o.returned_);
            returning_ = std::exchange(o.returning_, false);
        }
        return *this;
    }
    /// Waits for the last copy back out of pinned memory before freeing it. That copy depends
    /// only on stream work the wait before the inter-node call already saw complete, so this
    /// wait is a memory copy long, even when peers have failed.
    ~hierarchical_staging() { settle(); }

    template <class T, class Intra>
    std::span<T> scratch(Intra& intra, int slot, std::size_t n) {
        buffer<std::uint64_t, cuda_system>& s = slot == 0 ? scratch0_ : scratch1_;
        const std::size_t words = words_for<T>(n);
        // The old buffer is freed on the stream, after the work queued on it.
        if (s.size() < words)
            s = buffer<std::uint64_t, cuda_system>(words, intra.system());
        return std::span<T>(reinterpret_cast<T*>(s.data()), n);
    }

    template <class T, class Intra>
    void copy(Intra& intra, std::span<T> dst, std::span<const T> src) {
        copy_async(intra.system(), src, dst);
    }

    /// Grows the pinned slots (0: out_n elements of T, 1: in_n) before the intra-node enqueue.
    template <class T, class Intra>
    void reserve(Intra& intra, std::size_t out_n, std::size_t in_n) {
        grow(intra, pinned0_, words_for<T>(out_n));
        grow(intra, pinned1_, words_for<T>(in_n));
    }

    template <class T, class Intra, class F>
    void inter(Intra& intra, std::span<const T> in, std::span<T> out, F&& f) {
        const auto in_at = reinterpret_cast<std::uintptr_t>(in.data());
        const auto out_at = reinterpret_cast<std::uintptr_t>(out.data());
        const bool nested =
            !in.empty() && in_at >= out_at && in_at + in.size_bytes() <= out_at + out.size_bytes();
        // `in` inside `out` (in place, or this replica's block of an all_gather): one pinned
        // span with the same layout, so the inter-node part sees the same aliasing.
        const std::span<T> host_out = pinned<T>(intra, 0, out.size());
        const std::span<T> host_in = nested
                                         ? host_out.subspan((in_at - out_at) / sizeof(T), in.size())
                                         : pinned<T>(intra, 1, in.size());
        const cuda_system sys = intra.system();
        cuda_device_guard guard(sys.device());
        if (!in.empty())
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(host_in.data(), in.data(), in.size_bytes(),
                                                cudaMemcpyDeviceToHost, sys.stream()));
        event(arrived_, sys).record(sys);
        intra.wait(arrived_->get(), "hierarchical staging (device to host)");
        f(std::span<const T>(host_in), host_out);
        if (!out.empty())
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(out.data(), host_out.data(), out.size_bytes(),
                                                cudaMemcpyHostToDevice, sys.stream()));
        event(returned_, sys).record(sys);
        returning_ = true;
    }

    template <class T, class Intra, class F>
    void on_host(Intra& intra, std::span<const T> in, std::span<T> out, F&& f) {
        // Own buffers, not the slots: f runs collectives that use the slots. Used for a few
        // integers at construction and split, so the allocations do not matter.
        const cuda_system sys = intra.system();
        const bool in_place = in.data() == out.data();
        buffer<T, cuda_system> dev_out(out.size(), sys);
        buffer<T, cuda_system> dev_in(in_place ? 0 : in.size(), sys);
        const std::span<T> d_in = in_place ? dev_out.span() : dev_in.span();
        pinned_array<T> host(std::max(in.size(), out.size()));
        cuda_device_guard guard(sys.device());
        if (!in.empty()) {
            std::memcpy(host.data(), in.data(), in.size_bytes());
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(d_in.data(), host.data(), in.size_bytes(),
                                                cudaMemcpyHostToDevice, sys.stream()));
        }
        f(std::span<const T>(d_in), dev_out.span());
        if (!out.empty())
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(host.data(), dev_out.data(), out.size_bytes(),
                                                cudaMemcpyDeviceToHost, sys.stream()));
        event(arrived_, sys).record(sys);
        intra.wait(arrived_->get(), "hierarchical staging (host values)");
        if (!out.empty())
            std::memcpy(out.data(), host.data(), out.size_bytes());
    }

private:
    template <class T>
    static std::size_t words_for(std::size_t n) {
        return (n * sizeof(T) + sizeof(std::uint64_t) - 1) / sizeof(std::uint64_t);
    }

    static cuda_event& event(std::optional<cuda_event>& e, const cuda_system& sys) {
        if (!e)
            e.emplace(sys.device());
        return *e;
    }

    /// Pinned slot `slot` with room for n elements of T, reserved before: never allocates (an
    /// NCCL collective of the intra-node part may be in flight).
    template <class T, class Intra>
    std::span<T> pinned(Intra& intra, int slot, std::size_t n) {
        pinned_array<std::uint64_t>& p = slot == 0 ? pinned0_ : pinned1_;
        LOCKSTEP_REQUIRE(p.size() >= words_for<T>(n), errc::internal, intra.rank(),
                         "hierarchical staging", "pinned slot ", slot, " holds ", p.size(),
                         " words, the call needs ", words_for<T>(n),
                         ": reserve() was not called before the intra-node enqueue");
        return std::span<T>(reinterpret_cast<T*>(p.data()), n);
    }

    /// Reallocates `p` to `words` when smaller, once the replica's stream is idle (a polled
    /// wait through the communicator): then no NCCL work of this replica is in flight while
    /// cudaFreeHost and cudaMallocHost run, and the copy back out of `p` has finished. Slots
    /// only grow, so this happens a few times per run.
    template <class Intra>
    void grow(Intra& intra, pinned_array<std::uint64_t>& p, std::size_t words) {
        if (p.size() >= words)
            return;
        intra.synchronize();
        returning_ = false;
        p = pinned_array<std::uint64_t>(words);
    }

    void settle() noexcept {
        if (returning_ && returned_ && returned_->get() != nullptr)
            (void)cudaEventSynchronize(returned_->get());
        returning_ = false;
    }

    buffer<std::uint64_t, cuda_system> scratch0_;
    buffer<std::uint64_t, cuda_system> scratch1_;
    pinned_array<std::uint64_t> pinned0_;
    pinned_array<std::uint64_t> pinned1_;
    std::optional<cuda_event> arrived_;  // recorded after a device-to-host copy
    std::optional<cuda_event> returned_; // recorded after the copy back to the device
    bool returning_ = false;             // returned_ recorded and not yet waited for
};
#endif

} // namespace lockstep::detail

// lockstep/comm/communicator_identity.hpp: communicator_identity, a process-unique serial number
// naming one communicator object, and the identified_communicator concept.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"

#include <atomic>
#include <concepts>
#include <cstdint>
#include <utility>

namespace lockstep {

/// A serial number that names one communicator object for as long as it lives, unique within the
/// process: what a cache of state derived from a communicator (bn::group's sub-communicator) is
/// keyed by, since an address outlives its object (a communicator destroyed and another
/// constructed in the same storage has the old one's address, never its identity).
/// - Construction draws a new number; no two objects are ever given the same one.
/// - A move hands the number to the destination (it holds the same group) and gives the
///   moved-from object a new one; a copy gets a new one (another object).
class communicator_identity {
public:
    communicator_identity() noexcept : value_(next()) {}
    communicator_identity(const communicator_identity&) noexcept : value_(next()) {}
    communicator_identity(communicator_identity&& o) noexcept
        : value_(std::exchange(o.value_, next())) {}
    communicator_identity& operator=(const communicator_identity& o) noexcept {
        if (this != &o)
            value_ = next();
        return *this;
    }
    communicator_identity& operator=(communicator_identity&& o) noexcept {
        if (this != &o)
            value_ = std::exchange(o.value_, next());
        return *this;
    }
    ~communicator_identity() = default;

    /// The number: never 0, never shared by two live objects or reused after one dies.
    std::uint64_t value() const noexcept { return value_; }

private:
    static std::uint64_t next() noexcept {
        static std::atomic<std::uint64_t> last{0};
        return last.fetch_add(1, std::memory_order_relaxed) + 1;
    }
    std::uint64_t value_;
};

/// A communicator that names itself: `identity()` returns its communicator_identity's value.
/// lockstep's communicators (thread, MPI, NCCL, hierarchical, simulated_link) all are; a
/// communicator of your own becomes one with a communicator_identity member and the accessor.
template <class C>
concept identified_communicator = communicator<C> && requires(const C& c) {
    { c.identity() } -> std::same_as<std::uint64_t>;
};

} // namespace lockstep

// lockstep/system/buffer.hpp: buffer<T, System>, the one owning array type, and copies between
// systems. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/system.hpp"

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace lockstep {

/// An owning, fixed-size array of trivially copyable T in the memory of System (host_system,
/// cuda_system or any other execution_system). Elements start uninitialized, as device memory does.
/// Views are std::span over the System's memory: device spans may be passed on, never dereferenced
/// on the host.
template <class T, execution_system System = host_system>
class buffer {
    static_assert(std::is_trivially_copyable_v<T>,
                  "lockstep::buffer holds trivially copyable elements only (they may live in "
                  "device memory and are copied as bytes).");

public:
    using value_type = T;
    using system_type = System;

    buffer() = default;
    /// Allocates n elements (uninitialized) in sys's memory. ensures: size() == n, or throws
    /// lockstep::error (errc::invalid_argument) when n * sizeof(T) overflows or exceeds the
    /// largest object size, before allocating anything.
    explicit buffer(std::size_t n, System sys = default_system<System>()) : sys_(std::move(sys)) {
        const std::size_t bytes =
            checked_bytes(n, sizeof(T), -1, "buffer(n)",
                          "n * sizeof(T) (sizeof(T) = " + std::to_string(sizeof(T)) + ")");
        data_ = static_cast<T*>(sys_.allocate(bytes));
        size_ = n;
    }
    buffer(const buffer&) = delete;
    buffer& operator=(const buffer&) = delete;
    buffer(buffer&& o) noexcept
        : sys_(o.sys_), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    buffer& operator=(buffer&& o) noexcept {
        if (this != &o) {
            release();
            sys_ = o.sys_;
            data_ = std::exchange(o.data_, nullptr);
            size_ = std::exchange(o.size_, 0);
        }
        return *this;
    }
    ~buffer() { release(); }

    T* data() noexcept { return data_; }
    const T* data() const noexcept { return data_; }
    std::size_t size() const noexcept { return size_; }
    std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
    bool empty() const noexcept { return size_ == 0; }
    const System& system() const noexcept { return sys_; }

    /// A non-owning view of the whole buffer.
    std::span<T> span() noexcept { return {data_, size_}; }
    std::span<const T> span() const noexcept { return {data_, size_}; }

    /// Host element access. requires: System::is_host, i < size().
    T& operator[](std::size_t i) noexcept requires System::is_host { return data_[i]; }
    const T& operator[](std::size_t i) const noexcept requires System::is_host { return data_[i]; }
    T* begin() noexcept requires System::is_host { return data_; }
    T* end() noexcept requires System::is_host { return data_ + size_; }
    const T* begin() const noexcept requires System::is_host { return data_; }
    const T* end() const noexcept requires System::is_host { return data_ + size_; }

private:
    void release() noexcept {
        if (data_ != nullptr)
            sys_.deallocate(data_, size_ * sizeof(T));
        data_ = nullptr;
        size_ = 0;
    }

    System sys_{};
    T* data_ = nullptr;
    std::size_t size_ = 0;
};

/// Copies src (in src_sys's memory) into dst (in dst_sys's memory); the spans may live in
/// different systems. requires: src.size() == dst.size(). ensures: dst holds src's bytes when
/// this returns (device copies are synchronized).
template <class T, execution_system SrcSystem, execution_system DstSystem>
void copy(std::span<const T> src, const SrcSystem& src_sys, std::span<T> dst,
          const DstSystem& dst_sys) {
    LOCKSTEP_REQUIRE(src.size() == dst.size(), errc::shape_mismatch, -1, "copy", "source has ",
                     src.size(), " elements, destination ", dst.size());
    // Unqualified: argument-dependent lookup at instantiation finds each system's copies
    // (host_system's in namespace lockstep::host, cuda_system's hidden friends), whatever the
    // include order.
    copy_bytes(dst.data(), dst_sys, src.data(), src_sys, src.size_bytes());
}

/// Copies src into dst, both in sys's memory, in order with sys's kernels and without waiting:
/// on CUDA an asynchronous copy on the system's stream, on the host at once.
/// requires: src.size() == dst.size(); the spans do not overlap.
template <class T, execution_system System>
void copy_async(const System& sys, std::span<const T> src, std::span<T> dst) {
    LOCKSTEP_REQUIRE(src.size() == dst.size(), errc::shape_mismatch, -1, "copy_async",
                     "source has ", src.size(), " elements, destination ", dst.size());
    copy_bytes_async(dst.data(), src.data(), src.size_bytes(), sys);
}

/// Copies one buffer into another of the same size, across systems.
template <class T, execution_system SrcSystem, execution_system DstSystem>
void copy(const buffer<T, SrcSystem>& src, buffer<T, DstSystem>& dst) {
    copy(src.span(), src.system(), dst.span(), dst.system());
}

} // namespace lockstep

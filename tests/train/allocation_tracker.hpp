// tests/train/allocation_tracker.hpp: replacement operator new/delete that record the largest
// allocation made while `tracking` is set, for the checkpoint fuzz programs' "no allocation larger
// than the file" checks. Include it in exactly one translation unit of an executable (it defines
// the program's replacement allocation functions). SPDX-License-Identifier: Apache-2.0
#pragma once

// The replacement operator new/delete below pair malloc with free; GCC's heuristic does not see
// through the replacement and warns at every inlined std::allocator call.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace {
std::atomic<bool> tracking{false};
std::atomic<std::size_t> largest{0};

void note(std::size_t n) {
    if (tracking.load(std::memory_order_relaxed)) {
        std::size_t cur = largest.load(std::memory_order_relaxed);
        while (n > cur && !largest.compare_exchange_weak(cur, n)) {
        }
    }
}
} // namespace

// Every allocation of this program goes through here, so the parser's are measured.
void* operator new(std::size_t n) {
    note(n);
    if (void* p = std::malloc(n == 0 ? 1 : n))
        return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
    note(n);
    if (void* p = std::malloc(n == 0 ? 1 : n))
        return p;
    throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    note(n);
    return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
    note(n);
    return std::malloc(n == 0 ? 1 : n);
}
void operator delete(void* p) noexcept {
    std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
void operator delete[](void* p) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
    std::free(p);
}

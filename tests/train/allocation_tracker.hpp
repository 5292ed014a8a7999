// tests/train/allocation_tracker.hpp: records the largest allocation made while `tracking` is
// set, for the checkpoint fuzz programs' "no allocation larger than the file" checks: through
// replacement operator new/delete, or under ASan or TSan, whose runtimes define those functions
// themselves (Clang links them statically), through the sanitizer allocator's malloc hook, which
// sees every allocation (operator new's and malloc's). Include it in exactly one translation unit
// of an executable (it defines the program's replacement allocation functions or installs the
// hook). SPDX-License-Identifier: Apache-2.0
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LOCKSTEP_TEST_SANITIZER_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define LOCKSTEP_TEST_SANITIZER_ALLOCATOR 1
#endif
#endif

// The replacement operator new/delete below pair malloc with free; GCC's heuristic does not see
// through the replacement and warns at every inlined std::allocator call.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

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

#ifdef LOCKSTEP_TEST_SANITIZER_ALLOCATOR
#include <sanitizer/allocator_interface.h>

namespace {
void on_malloc(const volatile void*, std::size_t n) {
    note(n);
}
void on_free(const volatile void*) {}
/// Installed before main (static initialization, one thread), as the interface asks.
const int hooks_installed = __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free);
} // namespace
#else
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
#endif

// Without this, a tracker that saw nothing (a hook the runtime refused) would pass every bound.
TEST_CASE("the allocation tracker sees an allocation", "[fuzz][allocation_tracker]") {
    static std::vector<char>* kept = nullptr; // escapes, so no allocation is elided
    largest = 0;
    tracking = true;
    kept = new std::vector<char>(12345);
    tracking = false;
    delete kept;
    CHECK(largest.load() >= 12345);
}

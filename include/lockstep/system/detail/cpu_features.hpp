// lockstep/system/detail/cpu_features.hpp: what the host's x86 CPU offers (CPUID), and
// on_widest_vectors, which runs a host loop compiled for the widest vector registers it has.
// SPDX-License-Identifier: Apache-2.0
#pragma once

// x86 host code of GCC or Clang (also the host pass of nvcc).
#if !defined(__CUDA_ARCH__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LOCKSTEP_HOST_X86 1
#include <cpuid.h>
#else
#define LOCKSTEP_HOST_X86 0
#endif

namespace lockstep::detail {

#if LOCKSTEP_HOST_X86
/// True when the CPU and the OS support AVX2 and F16C (CPUID, XGETBV), checked once.
inline bool cpu_has_f16c() noexcept {
    static const bool ok = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid(1, &a, &b, &c, &d))
            return false;
        const bool f16c = (c >> 29) & 1u, avx = (c >> 28) & 1u, osxsave = (c >> 27) & 1u;
        if (!(f16c && avx && osxsave))
            return false;
        unsigned lo = 0, hi = 0;
        __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0)); // XCR0: the OS saves XMM and YMM
        if ((lo & 6u) != 6u)
            return false;
        if (__get_cpuid_max(0, nullptr) < 7)
            return false;
        __cpuid_count(7, 0, a, b, c, d);
        return ((b >> 5) & 1u) != 0; // AVX2
    }();
    return ok;
}

/// The widest x86 vector registers the CPU and the OS support: 512 (AVX-512F), 256 (AVX2), else
/// 128, checked once.
inline int host_vector_bits() noexcept {
    static const int bits = __builtin_cpu_supports("avx512f") ? 512
                            : __builtin_cpu_supports("avx2")  ? 256
                                                              : 128;
    return bits;
}

template <class Loop>
[[gnu::target("avx512f")]] auto on_avx512(const Loop& loop) {
    return loop();
}
template <class Loop>
[[gnu::target("avx2")]] auto on_avx2(const Loop& loop) {
    return loop();
}
#endif

/// loop(), its body (an always_inline operator()) compiled for the widest vector registers the
/// host has (host_vector_bits), so that its loops vectorise to them without -march.
template <class Loop>
auto on_widest_vectors(const Loop& loop) {
#if LOCKSTEP_HOST_X86
    switch (host_vector_bits()) {
    case 512:
        return on_avx512(loop);
    case 256:
        return on_avx2(loop);
    default:
        break;
    }
#endif
    return loop();
}

} // namespace lockstep::detail

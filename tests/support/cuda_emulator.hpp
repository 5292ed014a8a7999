// A CUDA block emulator for host tests of kernel code: a __global__ function's body runs on the
// CPU, one block after another, each of its threads a fiber (ucontext) on the calling thread.
// A fiber runs until it reaches __syncthreads() or returns; a pass over the block's live fibers
// is one barrier phase, so a thread that returned no longer holds the others back (as on a
// device since Volta), and every live thread of a phase must wait at the same __syncthreads()
// in the source (file and line; else emulate() throws: divergent barriers are undefined
// behaviour on a device).
// __shared__ variables are statics: one copy, which is the block's since blocks run in turn.
// Warp-level intrinsics and floating-point atomics are not provided: code that uses them does
// not compile here. Launches through kernels/bn_cuda.cuh's launch_kernel run here
// (LOCKSTEP_KERNEL_LAUNCH_HOOK), so a test calls the library's own launchers. Include this header
// first in its translation unit, before any CUDA or lockstep header; it needs the CUDA toolkit's
// headers (vector types, cuda_fp16.h) and no device. Not for sanitizer builds (fibers switch stacks
// behind ASan's and TSan's backs). SPDX-License-Identifier: Apache-2.0
#pragma once

// The fibers jump between their stacks with _longjmp, which glibc's checked longjmp refuses.
#undef _FORTIFY_SOURCE

#if defined(__CUDACC__)
#error "cuda_emulator.hpp compiles kernel code as host code: include it in a .cpp file"
#endif

#define LOCKSTEP_HAS_CUDA 1
#define __shared__ static
#define __launch_bounds__(...)

#include <vector_functions.h>
#include <vector_types.h>

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep_emulator {

/// The order blocks, and the live threads of each barrier phase, run in: 0 (the default) index
/// order; any other value a pseudo-random permutation drawn from it, a new one for every phase.
/// A kernel whose results change with it races (a missing __syncthreads(), blocks reading what
/// other blocks write) or folds in arrival order; on a device the order varies run to run.
inline unsigned schedule_seed = 0;

/// schedule_seed = seed for the scope's lifetime, then the seed it had before (scopes nest).
struct scoped_schedule {
    explicit scoped_schedule(unsigned seed) : previous(schedule_seed) { schedule_seed = seed; }
    ~scoped_schedule() { schedule_seed = previous; }
    scoped_schedule(const scoped_schedule&) = delete;
    scoped_schedule& operator=(const scoped_schedule&) = delete;

private:
    unsigned previous;
};

inline uint3 thread_index{};
inline uint3 block_index{};
inline dim3 grid_size{};
inline dim3 block_size{};

/// A __syncthreads() in the source.
struct barrier_site {
    const char* file = nullptr;
    int line = 0;
    bool operator==(const barrier_site& o) const {
        return line == o.line && std::strcmp(file, o.file) == 0;
    }
};

/// One emulated thread: its start (makecontext) and, once started, where it waits.
struct fiber {
    ucontext_t start{};
    jmp_buf at{};
    bool started = false;
};

/// The block being run: where the scheduler waits, the running fiber, and where that fiber
/// last waited or whether it returned.
struct block_run {
    jmp_buf scheduler{};
    fiber* running = nullptr;
    barrier_site waited_at;
    const std::function<void()>* body = nullptr;
    bool returned = false;
};
inline block_run* current = nullptr;

// The fibers switch with _setjmp/_longjmp, which save no signal mask (swapcontext makes a system
// call per switch: a block of 256 threads switches thousands of times); makecontext and
// setcontext only start them.

[[noreturn]] inline void fiber_entry() {
    (*current->body)();
    current->returned = true;
    _longjmp(current->scheduler, 1);
}

/// A fresh fiber that runs fiber_entry on `stack`.
inline void make_fiber(fiber& f, char* stack, std::size_t bytes) {
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = stack;
    f.start.uc_stack.ss_size = bytes;
    f.start.uc_link = nullptr;
    makecontext(&f.start, fiber_entry, 0);
    f.started = false;
}

/// Runs the fiber until it waits at a barrier or returns.
[[gnu::noinline]] inline void resume(block_run& run, fiber& f) {
    if (_setjmp(run.scheduler) != 0)
        return;
    if (!f.started) {
        f.started = true;
        setcontext(&f.start);
    }
    _longjmp(f.at, 1);
}

/// The running fiber's barrier: back to the scheduler until every live thread has arrived.
[[gnu::noinline]] inline void sync_threads(const char* file, int line) {
    current->waited_at = barrier_site{file, line};
    if (_setjmp(current->running->at) == 0)
        _longjmp(current->scheduler, 1);
}

/// Runs body once per thread of every block of `grid` (block_threads threads, x only), blocks in
/// order of (y, x) and threads of a phase in order of x, or both permuted (schedule_seed). throws
/// std::runtime_error when the live threads of a phase wait at different __syncthreads calls.
inline void emulate(dim3 grid, unsigned block_threads, const std::function<void()>& body) {
    // the fibers' stacks, kept from call to call (fresh ones cost page faults every launch)
    constexpr std::size_t stack_bytes = 128 * 1024;
    static std::vector<std::unique_ptr<char[]>> stacks;
    while (stacks.size() < block_threads)
        stacks.push_back(std::make_unique<char[]>(stack_bytes));
    std::vector<fiber> fibers(block_threads);
    std::vector<char> live(block_threads);
    std::vector<unsigned> blocks(std::size_t{grid.x} * grid.y), threads(block_threads);
    std::iota(blocks.begin(), blocks.end(), 0u);
    std::iota(threads.begin(), threads.end(), 0u);
    std::mt19937 shuffle(schedule_seed);
    if (schedule_seed != 0)
        std::shuffle(blocks.begin(), blocks.end(), shuffle);
    block_run run;
    run.body = &body;
    grid_size = grid;
    block_size = dim3(block_threads);
    current = &run;
    struct clear_current {
        ~clear_current() { current = nullptr; }
    } const clear;
    for (const unsigned b : blocks) {
        const unsigned bx = b % grid.x, by = b / grid.x;
        block_index = uint3{bx, by, 0};
        for (unsigned t = 0; t < block_threads; ++t) {
            make_fiber(fibers[t], stacks[t].get(), stack_bytes);
            live[t] = 1;
        }
        for (unsigned alive = block_threads; alive > 0;) {
            if (schedule_seed != 0)
                std::shuffle(threads.begin(), threads.end(), shuffle);
            barrier_site first_site; // where this phase's first live thread waits
            for (const unsigned t : threads) {
                if (!live[t])
                    continue;
                thread_index = uint3{t, 0, 0};
                run.running = &fibers[t];
                run.returned = false;
                resume(run, fibers[t]);
                if (run.returned) {
                    live[t] = 0;
                    --alive;
                    continue;
                }
                if (first_site.file == nullptr) {
                    first_site = run.waited_at;
                } else if (!(first_site == run.waited_at)) {
                    throw std::runtime_error(
                        "cuda_emulator: threads of block (" + std::to_string(bx) + ", " +
                        std::to_string(by) + ") wait at different __syncthreads() calls (" +
                        first_site.file + ":" + std::to_string(first_site.line) + " and " +
                        run.waited_at.file + ":" + std::to_string(run.waited_at.line) + ")");
                }
            }
        }
    }
}

} // namespace lockstep_emulator

#define threadIdx (::lockstep_emulator::thread_index)
#define blockIdx (::lockstep_emulator::block_index)
#define gridDim (::lockstep_emulator::grid_size)
#define blockDim (::lockstep_emulator::block_size)

#define __syncthreads() ::lockstep_emulator::sync_threads(__FILE__, __LINE__)

// The library's kernel launches (kernels/bn_cuda.cuh's launch_kernel) run here instead.
#define LOCKSTEP_KERNEL_LAUNCH_HOOK(kernel, grid, threads, ...)                                    \
    ::lockstep_emulator::emulate(grid, threads, [&] { kernel(__VA_ARGS__); })
inline void __threadfence() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
    return std::atomic_ref<unsigned>(*p).exchange(v);
}
template <class T>
T __ldg(const T* p) {
    return *p;
}
template <class T>
T __ldcg(const T* p) {
    return *p;
}

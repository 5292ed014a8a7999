// cub::BlockReduce for kernel code run by tests/support/cuda_emulator.hpp (found before CCCL's
// cub on the emulated tests' include path): Reduce folds the block's inputs in thread order in
// thread 0 (cub's order differs: emulated results equal a device's within rounding, not
// bitwise). SPDX-License-Identifier: Apache-2.0
#pragma once

namespace cub {

template <class T, int BlockThreads>
class BlockReduce {
public:
    struct TempStorage {
        T inputs[BlockThreads];
    };
    explicit BlockReduce(TempStorage& storage) : storage_(storage) {}
    /// The fold of every thread's input, returned in thread 0 (others get T{}).
    template <class Op>
    T Reduce(const T& input, Op op) {
        storage_.inputs[threadIdx.x] = input;
        __syncthreads();
        T r{};
        if (threadIdx.x == 0) {
            r = storage_.inputs[0];
            for (int t = 1; t < BlockThreads; ++t)
                r = op(r, storage_.inputs[t]);
        }
        __syncthreads();
        return r;
    }

private:
    TempStorage& storage_;
};

} // namespace cub

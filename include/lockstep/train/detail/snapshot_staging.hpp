// lockstep/train/detail/snapshot_staging.hpp: how a checkpoint's snapshot copies a trainer's
// sections out of the system's memory: at once (immediate_snapshot: the blocking save, host
// systems), or, for save_checkpoint_async on CUDA, into reused page-locked host memory on a side
// stream that the host does not wait for (snapshot_staging<cuda_system>).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/system.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#if LOCKSTEP_HAS_CUDA
#include "lockstep/system/cuda_system.hpp"

#include <chrono>
#include <optional>
#include <thread>
#endif

namespace lockstep::detail::ckpt {

/// A snapshot's copies, made at once: begin() waits for the communicator's work (its
/// synchronize(), where it has one), section() copies into the section's own bytes, and wait()
/// has nothing to wait for. Protocol of every staging: begin(comm, bytes); section() for each
/// section of the shard (`bytes` in all); end(sys); then wait() before the builder is encoded
/// (on any thread).
struct immediate_snapshot {
    template <class Comm>
    void begin(Comm& comm, std::size_t /*bytes*/) {
        if constexpr (requires { comm.synchronize(); })
            comm.synchronize();
    }
    template <class T, class System>
    void section(file_builder& b, std::string name, std::vector<std::uint64_t> shape,
                 std::span<const T> data, const System& sys) {
        // One copy, from the system's memory into the section's bytes (little-endian: the
        // file's order, as file_builder::section asserts).
        std::vector<std::byte> bytes(data.size_bytes());
        copy(data, sys, std::span<T>(reinterpret_cast<T*>(bytes.data()), data.size()),
             host_system{1});
        b.raw_section(std::move(name), dtype_of<T>(), std::move(shape), std::move(bytes));
    }
    template <class System>
    void end(const System& /*sys*/) {}
    void wait() {}
};

/// The staging of save_checkpoint_async's snapshots of a trainer on System, kept by the trainer
/// between saves: immediate copies, except on CUDA.
template <class System>
struct snapshot_staging : immediate_snapshot {};

#if LOCKSTEP_HAS_CUDA
/// On CUDA: begin() records an event on the trainer's stream, and a side stream waits for it
/// and copies every section (cudaMemcpyAsync) into one page-locked buffer, which the sections
/// borrow (file_builder::borrowed_section); end() makes the trainer's stream wait for the copies,
/// so the next step's kernels cannot change what is copied, and the host waits for nothing. The
/// writer's wait() polls the copies' event (an error in the stream ends it as an exception). The
/// buffer (the shard's bytes, page-locked) and the stream stay for the next save: at most one
/// save is in flight, and the next begins after its writer has been joined.
template <>
class snapshot_staging<cuda_system> {
public:
    template <class Comm>
    void begin(Comm& comm, std::size_t bytes) {
        const cuda_system sys = comm.system();
        if (!side_ || side_->device() != sys.device()) {
            side_.emplace(sys.device());
            start_.emplace(sys.device());
            done_.emplace(sys.device());
        }
        if (bytes_.size() < bytes)
            bytes_ = pinned_array<std::byte>(bytes);
        used_ = 0;
        start_->record(sys);
        start_->make_wait(side_->system());
    }
    template <class T>
    void section(file_builder& b, std::string name, std::vector<std::uint64_t> shape,
                 std::span<const T> data, const cuda_system& /*sys*/) {
        std::byte* at = bytes_.data() + used_;
        if (!data.empty()) {
            cuda_device_guard guard(side_->device());
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(at, data.data(), data.size_bytes(),
                                                cudaMemcpyDefault, side_->get()));
        }
        used_ += data.size_bytes();
        b.borrowed_section(std::move(name), dtype_of<T>(), std::move(shape),
                           std::span<const std::byte>(at, data.size_bytes()));
    }
    void end(const cuda_system& sys) {
        done_->record(side_->system());
        done_->make_wait(sys);
    }
    void wait() {
        cuda_device_guard guard(side_->device());
        cudaError_t e = cudaEventQuery(done_->get());
        for (; e == cudaErrorNotReady; e = cudaEventQuery(done_->get()))
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        LOCKSTEP_CUDA_CHECK(e);
    }

private:
    std::optional<cuda_stream> side_;
    std::optional<cuda_event> start_;
    std::optional<cuda_event> done_; ///< the copies of the last snapshot
    pinned_array<std::byte> bytes_;
    std::size_t used_ = 0;
};
#endif

} // namespace lockstep::detail::ckpt

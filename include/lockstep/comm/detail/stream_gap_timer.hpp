// lockstep/comm/detail/stream_gap_timer.hpp: stream_gap_timer, the time a replica's stream
// spends between its communicator's collectives, measured on the device with CUDA events (what
// train_params::report_stragglers_every reads on a GPU). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/config.hpp"

#if LOCKSTEP_HAS_CUDA

#include "lockstep/core/error.hpp"
#include "lockstep/system/cuda_system.hpp"

#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace lockstep::detail {

/// The device time one stream spends between a communicator's collectives: an event recorded
/// on the stream after each collective (its completion there) and one before the next (the
/// stream's arrival at it, after everything enqueued in between); each pair's elapsed time is
/// the replica's own work between the two collectives, including the time its stream idled
/// for the host to enqueue that work. Host enqueue times cannot see a slow GPU; this can, and
/// it needs no clock shared between replicas.
///
/// Off until start() (nothing recorded, nothing allocated). Nothing is recorded while the stream
/// is being captured into a CUDA graph (a pair open across the capture is dropped). A pair is
/// read once its second event has completed (between_ns() reads every completed one, so after
/// the stream was waited for it holds every gap; each collective reads a few); its events are
/// reused. Collectives must be launched when enqueued (not inside an ncclGroupStart/End of the
/// caller, which launches them at its end). A CUDA error while recording turns the timer into
/// one that throws it from between_ns() (errc::cuda), so a collective never fails for a timer.
/// Used by one thread at a time, as its communicator; movable.
class stream_gap_timer {
public:
    /// Starts timing on `device` (the stream's). Idempotent.
    void start(int device) {
        if (!s_)
            s_ = std::make_unique<state>(device);
    }

    /// Before a collective is enqueued on `stream`: closes the open pair at the stream's arrival.
    void before(cudaStream_t stream) noexcept {
        if (s_)
            s_->guarded([&] { s_->before(stream); });
    }
    /// After a collective was enqueued on `stream`: opens a pair at its completion.
    void after(cudaStream_t stream) noexcept {
        if (s_)
            s_->guarded([&] { s_->after(stream); });
    }

    /// The summed gaps of every pair that has completed since start(), in ns (0 while off).
    /// Throws errc::cuda when recording or reading an event failed.
    std::int64_t between_ns() {
        if (!s_)
            return 0;
        s_->guarded([&] { s_->read(s_->pending.size()); });
        LOCKSTEP_REQUIRE(s_->failure.empty(), errc::cuda, -1, "stream_gap_timer", s_->failure,
                         " (the device timing of report_stragglers_every)");
        return s_->total_ns;
    }

private:
    struct state {
        explicit state(int d) : device(d) {}
        state(const state&) = delete;
        state& operator=(const state&) = delete;
        ~state() {
            cuda_device_guard_noexcept guard(device);
            for (cudaEvent_t e : all)
                (void)cudaEventDestroy(e);
        }

        /// Runs f on the device; a failure is kept (failure) and stops the recording.
        template <class F>
        void guarded(F f) noexcept {
            if (!failure.empty())
                return;
            try {
                cuda_device_guard guard(device);
                f();
            } catch (const std::exception& e) {
                failure = e.what();
            } catch (...) {
                failure = "an unknown exception";
            }
            if (!failure.empty())
                (void)cudaGetLastError();
        }
        bool capturing(cudaStream_t stream) const {
            return is_capturing(cuda_system(device, stream));
        }
        cudaEvent_t take() {
            if (!spare.empty()) {
                const cudaEvent_t e = spare.back();
                spare.pop_back();
                return e;
            }
            all.reserve(all.size() + 1);
            spare.reserve(all.size() + 1);
            cudaEvent_t e = nullptr;
            LOCKSTEP_CUDA_CHECK(cudaEventCreate(&e));
            all.push_back(e);
            return e;
        }
        void drop_open() {
            if (open != nullptr)
                spare.push_back(std::exchange(open, nullptr));
        }
        void before(cudaStream_t stream) {
            if (capturing(stream))
                return drop_open();
            read(4); // keeps the pairs in flight few
            if (open == nullptr)
                return;
            const cudaEvent_t arrival = take();
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(arrival, stream));
            pending.emplace_back(std::exchange(open, nullptr), arrival);
        }
        void after(cudaStream_t stream) {
            drop_open();
            if (capturing(stream))
                return;
            const cudaEvent_t done = take();
            open = done;
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(done, stream));
        }
        /// Adds up to `most` completed pairs, oldest first (a stream completes them in order).
        void read(std::size_t most) {
            for (; most > 0 && !pending.empty(); --most) {
                const auto [from, to] = pending.front();
                const cudaError_t q = cudaEventQuery(to);
                if (q == cudaErrorNotReady)
                    return;
                LOCKSTEP_CUDA_CHECK(q);
                float ms = 0.0f;
                LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, from, to));
                total_ns += std::llround(static_cast<double>(ms) * 1e6);
                pending.pop_front();
                spare.push_back(from);
                spare.push_back(to);
            }
        }

        int device;
        std::vector<cudaEvent_t> all;   ///< every event created (destroyed with the state)
        std::vector<cudaEvent_t> spare; ///< created, not in use
        std::deque<std::pair<cudaEvent_t, cudaEvent_t>> pending; ///< recorded, not yet read
        cudaEvent_t open = nullptr; ///< the last collective's completion, awaiting the next
        std::int64_t total_ns = 0;
        std::string failure; ///< the first CUDA error, else empty
    };
    std::unique_ptr<state> s_;
};

} // namespace lockstep::detail

#endif // LOCKSTEP_HAS_CUDA

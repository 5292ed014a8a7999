// lockstep/comm/comm_stream.hpp: comm_stream<Communicator>, a replica's communication stream:
// collectives that run in order beside the replica's compute, ordered with it by events.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <sys/resource.h>
#include <unistd.h>
#endif

#if LOCKSTEP_HAS_NCCL
#include "lockstep/comm/nccl_communicator.hpp"
#include "lockstep/system/cuda_system.hpp"
#endif

namespace lockstep {

/// The CPU scheduling priority of a host communication thread.
enum class comm_priority {
    /// The priority of the thread that made it.
    normal,
    /// Lower than the compute threads' (Linux: nice raised by detail::background_nice, at most
    /// 19; elsewhere normal). The thread then takes a core when the compute leaves one idle (a
    /// replica waiting for a slower one, the compute thread waiting in join) instead of
    /// competing with the compute for it. It also yields to the machine's other processes.
    /// data_parallel uses it for a forced overlap on single-node MPI (detail::use_overlap).
    background
};

namespace detail {

/// How much comm_priority::background raises a communication thread's nice value. (Measured,
/// single-node MPI, 2 ranks on 2 cores, ResNet-50-shaped step, docs/overlap.md: a forced
/// overlap at +10 took 0.91-1.06x the step without it over 7 runs, median 0.97, against
/// 0.96-1.02x at normal priority; +5 and +19 measured alike; +10 yields less to the machine's
/// other processes than +19.)
inline constexpr int background_nice = 10;

/// Lowers the calling thread's CPU priority by background_nice (Linux: nice is per thread).
/// Best effort: a failure leaves the priority as it was.
inline void lower_thread_priority() noexcept {
#if defined(__linux__)
    const auto tid = static_cast<id_t>(::gettid());
    errno = 0;
    const int now = ::getpriority(PRIO_PROCESS, tid);
    if (errno == 0)
        (void)::setpriority(PRIO_PROCESS, tid, std::min(now + background_nice, 19));
#endif
}

/// Runs work items in submission order on one thread of its own: submit(item) queues it,
/// join() waits until every queued item has run and rethrows the first failure (an item that
/// throws makes the worker skip the items after it, until join() reports it). `start` runs
/// first on the thread (e.g. to make a device current there); the thread runs at `priority`.
class ordered_worker {
public:
    explicit ordered_worker(std::function<void()> start = {},
                            comm_priority priority = comm_priority::normal) {
        worker_ = std::thread([this, s = std::move(start), priority] {
            if (priority == comm_priority::background)
                lower_thread_priority();
            if (s) {
                try {
                    s();
                } catch (...) {
                    std::lock_guard<std::mutex> lock(mutex_);
                    failure_ = std::current_exception(); // reported by the first join()
                }
            }
            run();
        });
    }
    ordered_worker(const ordered_worker&) = delete;
    ordered_worker& operator=(const ordered_worker&) = delete;
    /// Drains the queue and stops the thread.
    ~ordered_worker() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        wake_.notify_all();
        worker_.join();
    }

    /// Runs item() after the items submitted before it.
    void submit(std::function<void()> item) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.emplace_back(std::move(item));
            ++submitted_;
        }
        wake_.notify_all();
    }

    /// Waits until every submitted item has run; rethrows the first failure (then clears it).
    void join() {
        std::exception_ptr e;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, [&] { return completed_ == submitted_; });
            e = std::exchange(failure_, nullptr);
        }
        if (e)
            std::rethrow_exception(e);
    }

private:
    void run() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty())
                return;
            std::function<void()> item = std::move(queue_.front());
            queue_.pop_front();
            const bool skip = failure_ != nullptr;
            lock.unlock();
            std::exception_ptr failed;
            if (!skip) {
                try {
                    item();
                } catch (...) {
                    failed = std::current_exception();
                }
            }
            lock.lock();
            if (failed)
                failure_ = failed;
            ++completed_;
            done_.notify_all();
        }
    }

    std::thread worker_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::condition_variable done_;
    std::deque<std::function<void()>> queue_;
    std::uint64_t submitted_ = 0;
    std::uint64_t completed_ = 0;
    bool stopping_ = false;
    std::exception_ptr failure_; // guarded by mutex_
};

} // namespace detail

/// A replica's communication stream: work items (collectives) submitted by the replica's compute
/// run in submission order on their own communicator, `comm()`, a split of the replica's
/// communicator (so its collectives never interleave with the collectives the compute side
/// issues meanwhile, such as batch norm's: each of the two communicators sees the same calls in
/// the same order on every replica, and the only waits between them are local).
/// - submit(work): the work may start once everything the compute side enqueued before is done
///   (on the host: at once, the compute thread wrote the data before submitting; on CUDA: the
///   side stream waits on an event recorded on the compute stream);
/// - join(): the compute side continues only after every submitted item (on the host the calling
///   thread waits; on CUDA the compute stream waits on an event, the host does not).
/// A failed item (an error of its collective) makes the stream skip the items after it and
/// join() rethrow that error on the compute side.
/// Host communicators run the items on one communication thread per replica
/// (detail::ordered_worker) at the given comm_priority, so the communicator must allow calls
/// from two threads at once on different communicators (the thread group does; MPI needs
/// MPI_THREAD_MULTIPLE).
template <communicator Communicator>
class comm_stream {
public:
    using communicator_type = Communicator;

    /// Splits comm (collective: every replica constructs its stream at the same point) and
    /// starts the communication thread at `priority`.
    explicit comm_stream(Communicator& comm, comm_priority priority = comm_priority::normal)
        : comm_(comm.split(0, comm.rank())), worker_({}, priority) {}
    comm_stream(const comm_stream&) = delete;
    comm_stream& operator=(const comm_stream&) = delete;

    /// The stream's communicator.
    Communicator& comm() noexcept { return comm_; }

    /// Runs work(comm()) after the items submitted before it.
    template <class Work>
    void submit(Work&& work) {
        worker_.submit([this, w = std::forward<Work>(work)]() mutable { w(comm_); });
    }

    /// Waits until every submitted item has run; rethrows the first failure (then clears it:
    /// the stream stays usable only if the communicator does).
    void join() { worker_.join(); }

private:
    Communicator comm_;
    detail::ordered_worker worker_; // after comm_: stopped (queue drained) before comm_ goes
};

#if LOCKSTEP_HAS_NCCL
/// nccl_communicator: a side stream. The stream's communicator is a split of the replica's onto
/// a CUDA stream the comm_stream owns (ncclCommSplit: its own NCCL communicator, in the
/// replica's family, so an abort of the replica's communicator stops its collectives too);
/// submit() records an event on the compute stream and makes the side stream wait on it before
/// the work is enqueued, and join() makes the compute stream wait on an event recorded on the
/// side stream (nccl_communicator::device_wait, so the replica's device timing counts that wait
/// as time in collectives). No host wait and no thread (the comm_priority is accepted for a
/// uniform interface and has no effect): an item runs inside submit(), so its error comes out
/// of submit() (the family is aborted, so later items throw too) and join() rethrows nothing.
/// requires: comm outlives the comm_stream.
template <>
class comm_stream<nccl_communicator> {
public:
    using communicator_type = nccl_communicator;

    explicit comm_stream(nccl_communicator& comm, comm_priority = comm_priority::normal)
        : compute_(comm.system()), parent_(&comm), side_(comm.device()),
          comm_(comm.split(0, comm.rank(), side_.get())), ready_(comm.device()),
          done_(comm.device()) {}

    nccl_communicator& comm() noexcept { return comm_; }

    /// Enqueues work(comm()) on the side stream behind the compute stream's work so far.
    template <class Work>
    void submit(Work&& work) {
        ready_.record(compute_);
        ready_.make_wait(comm_.system());
        std::forward<Work>(work)(comm_);
    }
    /// Orders the compute stream after every submitted item (device-side wait).
    void join() {
        done_.record(comm_.system());
        parent_->device_wait(done_.get());
    }

private:
    cuda_system compute_;
    nccl_communicator* parent_; // the compute stream's communicator
    cuda_stream side_;          // before comm_: outlives it
    nccl_communicator comm_;
    cuda_event ready_;
    cuda_event done_;
};
#endif

} // namespace lockstep

// tests/support/shared_gpu_communicator.cuh: shared_gpu_communicator, one replica's handle on a
// group of replica threads sharing ONE GPU, each on its own stream, whose device collectives equal
// the thread group's bit for bit. Test support, not public API. SPDX-License-Identifier: Apache-2.0
#pragma once

// NCCL refuses two ranks on one device, so a machine with one GPU could only ever test one
// replica of the GPU path. This communicator lets 2..16 replicas share the device: the host
// rendezvous, the agreement checks, the failure and timeout handling are a thread_group's (each
// collective is two thread_communicator calls), the data moves on the replicas' own streams.
//
// The stream/event contract of one collective on replica r (stream S_r, run-wide events
// ready[r] and done[r], one pair per replica, shared by the group and all its splits):
//   1. r records ready[r] on S_r: its inputs are complete once S_r gets there.
//   2. Rendezvous 1 (thread_communicator::all_gather of a call_desc): every replica has
//      recorded its ready event and published its spans; every replica checks the same
//      descriptors, so a disagreement throws on all of them and nothing is enqueued.
//   3. S_r waits (cudaStreamWaitEvent) for ready[j] of every peer j.
//   4. The data phase on S_r reads the peers' send spans: reductions run one kernel that folds
//      the N inputs in rank order with lockstep::detail::shm::sum_fn/max_fn/min_fn into r's own
//      scratch (the thread group's functors and order, hence its bits); copies write r's recv
//      directly.
//   5. r records done[r]; rendezvous 2 (thread_communicator::barrier): every peer has recorded
//      its done event, so every peer's reads of r's buffers are enqueued before it.
//   6. S_r waits for done[j] of every peer j, then copies its scratch into recv. Only now may
//      r's stream overwrite its send span (in-place recv, or the caller's later work).
// Every wait of step 3 and 6 names an event whose record was enqueued before the wait (the
// rendezvous orders them), and a later re-record only makes a wait stricter, so the device
// never waits for work that was not enqueued: a failed replica cannot hang the GPU. Host waits
// are the thread group's (timeout, errc::peer_failure) and wait()/synchronize() poll
// cudaEventQuery/cudaStreamQuery with the same timeout and failure checks.
// Not covered: a replica whose CUDA launch fails inside step 4 may free its buffers while a
// peer's kernel still reads them (that peer throws errc::peer_failure at step 5 anyway).
// A replica may use its handle and a split of it from two threads (comm_stream's worker): both
// record the same two events on the same stream, which again only makes the peers' waits stricter.
// CUDA graph capture works when every replica's stream is in the same capture (one stream begins
// it, the others join through an event: test_shared_gpu.cu's graph case); a capturing stream may
// not wait for an event recorded outside its capture.

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/cuda_system.hpp"

#include "support/shared_gpu_detail.cuh"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace lockstep::testing {

/// One replica's handle (made by shared_gpu_group::run or split). Models
/// all_to_all_communicator on cuda_system(device, this replica's stream); reductions combine
/// replicas in rank order with the thread group's functors, so results equal
/// lockstep::thread_communicator's bit for bit. Also offers nccl_communicator's wait(),
/// synchronize(), abort() and aborted(), which the trainer and wait_for use.
class shared_gpu_communicator {
public:
    using system_type = cuda_system;

    /// requires: host outlives this handle; sys is a stream of run->device.
    shared_gpu_communicator(thread_communicator& host,
                            std::shared_ptr<shared_gpu_detail::run_state> run, cuda_system sys)
        : host_(&host), run_(std::move(run)), sys_(sys) {
        LOCKSTEP_REQUIRE(host.size() <= shared_gpu_detail::max_replicas, errc::invalid_argument,
                         host.replica(), "shared_gpu_communicator", host.size(),
                         " replicas, at most ", shared_gpu_detail::max_replicas);
    }
    shared_gpu_communicator(shared_gpu_communicator&& o) noexcept
        : host_(o.host_), owned_(std::move(o.owned_)), run_(std::move(o.run_)), sys_(o.sys_),
          scratch_(std::exchange(o.scratch_, nullptr)),
          scratch_bytes_(std::exchange(o.scratch_bytes_, 0)), seq_(o.seq_), aborted_(o.aborted_),
          identity_(std::move(o.identity_)) {}
    shared_gpu_communicator& operator=(shared_gpu_communicator&&) = delete;
    shared_gpu_communicator(const shared_gpu_communicator&) = delete;
    ~shared_gpu_communicator() { sys_.deallocate(scratch_, scratch_bytes_); }

    int rank() const noexcept { return host_->rank(); }
    int size() const noexcept { return host_->size(); }
    /// The index of this replica in the whole run.
    int replica() const noexcept { return host_->replica(); }
    cuda_system system() const noexcept { return sys_; }
    int device() const noexcept { return sys_.device(); }

    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                    reduce_op op) {
        static_assert(lockstep::detail::shm::reducible<T>,
                      "all_reduce reduces arithmetic types only.");
        auto d = desc<T>(shared_gpu_detail::all_reduce, send.data(), send.size(), recv.data(),
                         recv.size(), op, 0);
        T* out = scratch<T>(send.size());
        collective(
            d, [&](const auto& all) { fold<T>(all, 0, out, send.size(), op); },
            [&](const auto&) { copy_async(recv.data(), out, send.size()); });
    }

    template <class T>
    void broadcast(std::span<T> data, int root) {
        auto d = desc<T>(shared_gpu_detail::broadcast, data.data(), data.size(), data.data(),
                         data.size(), reduce_op::sum, root);
        collective(
            d,
            [&](const auto& all) {
                if (rank() != root)
                    copy_async(data.data(), static_cast<const T*>(all[root].send), data.size());
            },
            [](const auto&) {});
    }

    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
        auto d = desc<T>(shared_gpu_detail::all_gather, send.data(), send.size(), recv.data(),
                         recv.size(), reduce_op::sum, 0);
        collective(
            d,
            [&](const auto& all) {
                for (int j = 0; j < size(); ++j) {
                    T* to = recv.data() + static_cast<std::size_t>(j) * send.size();
                    const auto* from = static_cast<const T*>(all[j].send);
                    if (to != from) // in place: this replica's send is its own slot of recv
                        copy_async(to, from, send.size());
                }
            },
            [](const auto&) {});
    }

    /// Block j of recv = block rank() of replica j's send.
    template <class T>
    void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
        auto d = desc<T>(shared_gpu_detail::all_to_all, send.data(), send.size(), recv.data(),
                         recv.size(), reduce_op::sum, 0);
        collective(
            d,
            [&](const auto& all) {
                const std::size_t b = send.size() / static_cast<std::size_t>(size());
                for (int j = 0; j < size(); ++j)
                    copy_async(recv.data() + static_cast<std::size_t>(j) * b,
                               static_cast<const T*>(all[j].send) +
                                   static_cast<std::size_t>(rank()) * b,
                               b);
            },
            [](const auto&) {});
    }

    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int root) {
        static_assert(lockstep::detail::shm::reducible<T>, "reduce reduces arithmetic types only.");
        auto d = desc<T>(shared_gpu_detail::reduce, send.data(), send.size(), recv.data(),
                         recv.size(), op, root);
        T* out = rank() == root ? scratch<T>(send.size()) : nullptr;
        collective(
            d,
            [&](const auto& all) {
                if (rank() == root)
                    fold<T>(all, 0, out, send.size(), op);
            },
            [&](const auto&) {
                if (rank() == root)
                    copy_async(recv.data(), out, send.size());
            });
    }

    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t> counts, reduce_op op) {
        static_assert(lockstep::detail::shm::reducible<T>,
                      "reduce_scatter reduces arithmetic types only.");
        auto d = desc<T>(shared_gpu_detail::reduce_scatter, send.data(), send.size(), recv.data(),
                         recv.size(), op, 0);
        d.counts_hash = hash_counts(counts);
        const auto at = lockstep::detail::scatter_layout_of(counts, rank());
        T* out = scratch<T>(at.mine);
        collective(
            d, [&](const auto& all) { fold<T>(all, at.offset, out, at.mine, op); },
            [&](const auto&) { copy_async(recv.data(), out, at.mine); }, counts);
    }

    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op) {
        const std::vector<std::size_t> counts(static_cast<std::size_t>(size()), recv.size());
        reduce_scatter<T>(send, recv, std::span<const std::size_t>(counts), op);
    }

    /// Returns once every replica has entered it; later work on every stream is ordered after
    /// the work each replica enqueued before it. No host wait on the device.
    void barrier() {
        collective(
            desc<char>(shared_gpu_detail::barrier, nullptr, 0, nullptr, 0, reduce_op::sum, 0),
            [](const auto&) {}, [](const auto&) {});
    }

    /// The replicas passing `color`, ranked by (key, rank), on this replica's stream (so the
    /// sub-group's collectives stay ordered with this replica's kernels).
    shared_gpu_communicator split(int color, int key) {
        auto child = std::make_unique<thread_communicator>(host_->split(color, key));
        shared_gpu_communicator c(*child, run_, sys_);
        c.owned_ = std::move(child);
        return c;
    }

    /// Polls until this replica's stream is idle; throws errc::peer_failure once the run failed
    /// and errc::timeout (failing the run) after the group's timeout.
    void synchronize() {
        poll("synchronize", "the stream", [&] { return cudaStreamQuery(sys_.stream()); });
    }
    /// Polls until `event` completed, with synchronize()'s checks.
    void wait(cudaEvent_t event, const char* what) {
        poll(std::string("wait (") + (what != nullptr ? what : "event") + ")", "the event",
             [&] { return cudaEventQuery(event); });
    }
    /// Fails the run (thread_group::abort): every peer's next or current collective throws
    /// errc::peer_failure. Idempotent, never throws.
    void abort() noexcept {
        if (aborted_)
            return;
        aborted_ = true;
        try {
            run_->group->abort("replica " + std::to_string(replica()) +
                               " aborted its shared_gpu_communicator");
        } catch (...) {
        }
    }
    bool aborted() const noexcept { return aborted_ || host_->run_failed(); }

    /// This object's communicator_identity (what bn::group keys its split by).
    std::uint64_t identity() const noexcept { return identity_.value(); }

private:
    using descs = std::vector<shared_gpu_detail::call_desc>;

    template <class T>
    shared_gpu_detail::call_desc desc(int kind, const void* send, std::size_t count, void* recv,
                                      std::size_t recv_count, reduce_op op, int root) const {
        shared_gpu_detail::call_desc d;
        d.kind = kind;
        d.op = static_cast<int>(op);
        d.root = root;
        d.replica = replica();
        d.elem_size = sizeof(T);
        d.count = count;
        d.recv_count = recv_count;
        d.send = send;
        d.recv = recv;
        return d;
    }

    /// Steps 1-6 of the contract at the top of this file.
    /// counts: reduce_scatter's per-rank counts (validated on every replica).
    template <class DataPhase, class Finish>
    void collective(const shared_gpu_detail::call_desc& mine, DataPhase&& data_phase,
                    Finish&& finish, std::span<const std::size_t> counts = {}) {
        const std::string op =
            std::string(shared_gpu_detail::kind_names[mine.kind]) + " #" + std::to_string(seq_++);
        LOCKSTEP_REQUIRE(!aborted_, errc::peer_failure, replica(), op,
                         "this communicator was aborted");
        cuda_device_guard guard(sys_.device());
        run_->ready[static_cast<std::size_t>(replica())].record(sys_);
        descs all(static_cast<std::size_t>(size()));
        host_->all_gather(std::span<const shared_gpu_detail::call_desc>(&mine, 1),
                          std::span<shared_gpu_detail::call_desc>(all));
        validate(op, all, counts);
        for (int j = 0; j < size(); ++j)
            if (j != rank())
                run_->ready[static_cast<std::size_t>(all[j].replica)].make_wait(sys_);
        data_phase(all);
        run_->done[static_cast<std::size_t>(replica())].record(sys_);
        host_->barrier();
        for (int j = 0; j < size(); ++j)
            if (j != rank())
                run_->done[static_cast<std::size_t>(all[j].replica)].make_wait(sys_);
        finish(all);
    }

    /// Checks the gathered descriptors; every replica reads the same ones, so every replica
    /// throws the same error or none does.
    void validate(const std::string& op, const descs& all,
                  std::span<const std::size_t> counts) const {
        const auto& c0 = all[0];
        const int n = size();
        for (int j = 0; j < n; ++j) {
            const auto& c = all[static_cast<std::size_t>(j)];
            LOCKSTEP_REQUIRE(c.kind == c0.kind, errc::shape_mismatch, replica(), op, "replica ",
                             c.replica, " called ", shared_gpu_detail::kind_names[c.kind],
                             ", replica ", c0.replica, " ", shared_gpu_detail::kind_names[c0.kind]);
            LOCKSTEP_REQUIRE(c.elem_size == c0.elem_size, errc::shape_mismatch, replica(), op,
                             "replica ", c.replica, " passed ", c.elem_size,
                             "-byte elements, replica ", c0.replica, " ", c0.elem_size);
            LOCKSTEP_REQUIRE(c.count == c0.count, errc::count_mismatch, replica(), op, "replica ",
                             c.replica, " passed ", c.count, " elements, replica ", c0.replica, " ",
                             c0.count);
            LOCKSTEP_REQUIRE(c.op == c0.op && c.root == c0.root && c.counts_hash == c0.counts_hash,
                             errc::shape_mismatch, replica(), op, "replica ", c.replica,
                             " passed reduction ", c.op, ", root ", c.root,
                             " or per-rank counts unlike replica ", c0.replica, "'s (", c0.op, ", ",
                             c0.root, ")");
            LOCKSTEP_REQUIRE((c.send != nullptr || c.count == 0) &&
                                 (c.recv != nullptr || c.recv_count == 0),
                             errc::invalid_argument, replica(), op, "replica ", c.replica,
                             " passed a null span with a non-zero count");
            std::size_t want = c.count;
            if (c.kind == shared_gpu_detail::all_gather)
                want = c.count * static_cast<std::size_t>(n);
            if (c.kind == shared_gpu_detail::reduce && j != c.root)
                want = c.recv_count; // non-roots' recv is not touched
            if (c.kind == shared_gpu_detail::reduce_scatter)
                want = j < static_cast<int>(counts.size()) ? counts[static_cast<std::size_t>(j)]
                                                           : c.recv_count;
            LOCKSTEP_REQUIRE(c.recv_count == want, errc::count_mismatch, replica(), op, "replica ",
                             c.replica, " passed a receive span of ", c.recv_count,
                             " elements for ", want);
        }
        if (c0.kind == shared_gpu_detail::reduce_scatter) {
            // Equal on every replica (their hashes agree), so every replica throws alike.
            const auto at = lockstep::detail::scatter_layout_of(counts, 0);
            LOCKSTEP_REQUIRE(counts.size() == static_cast<std::size_t>(n) && !at.overflow &&
                                 at.total == c0.count,
                             errc::count_mismatch, replica(), op, "counts ",
                             lockstep::detail::describe_counts(counts), " for ", n,
                             " replicas sending ", c0.count, " elements");
        }
        const bool rooted =
            c0.kind == shared_gpu_detail::broadcast || c0.kind == shared_gpu_detail::reduce;
        LOCKSTEP_REQUIRE(!rooted || (c0.root >= 0 && c0.root < n), errc::invalid_argument,
                         replica(), op, "root ", c0.root, " is not a rank of this group of ", n);
        LOCKSTEP_REQUIRE(c0.kind != shared_gpu_detail::all_to_all ||
                             c0.count % static_cast<std::size_t>(n) == 0,
                         errc::count_mismatch, replica(), op, c0.count,
                         " elements are not a whole number of blocks for ", n, " replicas");
    }

    static std::uint64_t hash_counts(std::span<const std::size_t> counts) {
        std::uint64_t h = 0xcbf29ce484222325ull ^ counts.size();
        for (std::size_t c : counts)
            h = (h ^ c) * 0x100000001b3ull;
        return h;
    }

    /// out[i] = op over ranks (in order) of peer j's send[offset + i], on this replica's stream.
    template <class T>
    void fold(const descs& all, std::size_t offset, T* out, std::size_t count, reduce_op op) {
        if (count == 0)
            return;
        shared_gpu_detail::source_table<T> s{};
        for (int j = 0; j < size(); ++j)
            s.at[j] = static_cast<const T*>(all[static_cast<std::size_t>(j)].send) + offset;
        const unsigned threads = 256;
        const auto blocks =
            static_cast<unsigned>(std::min<std::size_t>((count + threads - 1) / threads, 4096));
        const cudaStream_t st = sys_.stream();
        switch (op) {
        case reduce_op::sum:
            shared_gpu_detail::fold_kernel<T, lockstep::detail::shm::sum_fn>
                <<<blocks, threads, 0, st>>>(s, size(), out, count);
            break;
        case reduce_op::max:
            shared_gpu_detail::fold_kernel<T, lockstep::detail::shm::max_fn>
                <<<blocks, threads, 0, st>>>(s, size(), out, count);
            break;
        case reduce_op::min:
            shared_gpu_detail::fold_kernel<T, lockstep::detail::shm::min_fn>
                <<<blocks, threads, 0, st>>>(s, size(), out, count);
            break;
        }
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
    }

    template <class T>
    void copy_async(T* dst, const T* src, std::size_t n) {
        if (n != 0 && dst != src)
            LOCKSTEP_CUDA_CHECK(
                cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, sys_.stream()));
    }

    /// This replica's scratch for n elements of T, grown on its own stream (stream-ordered
    /// free and allocation: no host wait, and earlier users of the old block finish first).
    template <class T>
    T* scratch(std::size_t n) {
        const std::size_t bytes = n * sizeof(T);
        if (bytes > scratch_bytes_) {
            sys_.deallocate(scratch_, scratch_bytes_);
            scratch_ = nullptr;
            scratch_bytes_ = 0;
            scratch_ = sys_.allocate(bytes);
            scratch_bytes_ = bytes;
        }
        return static_cast<T*>(scratch_);
    }

    template <class Query>
    void poll(const std::string& op, const char* what, Query query) {
        using clock = std::chrono::steady_clock;
        const auto start = clock::now();
        cuda_device_guard guard(sys_.device());
        for (;;) {
            LOCKSTEP_REQUIRE(!aborted(), errc::peer_failure, replica(), op,
                             "the run failed (a replica threw or aborted) while waiting for ",
                             what);
            const cudaError_t e = query();
            if (e == cudaSuccess)
                return;
            if (e != cudaErrorNotReady) {
                (void)cudaGetLastError();
                fail(errc::cuda, replica(), op, "waiting for ", what, ": ", cudaGetErrorName(e));
            }
            const auto waited = clock::now() - start;
            if (waited > run_->timeout) {
                abort();
                fail(errc::timeout, replica(), op, what, " did not complete within ",
                     run_->timeout.count(), " ms");
            }
            if (waited < std::chrono::milliseconds(1))
                std::this_thread::yield();
            else
                std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
    }

    thread_communicator* host_;
    std::unique_ptr<thread_communicator> owned_; ///< split: the handle host_ points to
    std::shared_ptr<shared_gpu_detail::run_state> run_;
    cuda_system sys_;
    void* scratch_ = nullptr;
    std::size_t scratch_bytes_ = 0;
    std::uint64_t seq_ = 0;
    bool aborted_ = false;
    communicator_identity identity_;
};

static_assert(all_to_all_communicator<shared_gpu_communicator>,
              "shared_gpu_communicator must model lockstep::all_to_all_communicator.");

} // namespace lockstep::testing

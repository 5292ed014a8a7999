// lockstep/comm/hierarchical_group.hpp: hierarchical_group, thread replicas inside every MPI
// process composed into one hierarchical_communicator. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/detail/mpi_job_failure.hpp"
#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/core/error.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {

/// Runtime options of hierarchical_group.
struct hierarchical_group_params {
    thread_group_params threads = {}; ///< the replica threads inside each process
    mpi_communicator_params mpi = {}; ///< each local rank's inter-process communicator
    /// A replica whose function throws (anything, or fails in a collective) ends the whole job
    /// with MPI_Abort after printing the error, so no process is left waiting for it (true), or
    /// run() rethrows it in this process only (false: the other processes find out when their
    /// MPI operations time out). errc::peer_failure only echoes another replica's failure,
    /// which ends the job itself: such a replica leaves without aborting. A failure no replica
    /// ended the job for (a replica thread that returned while the others of its process waited
    /// for it in a collective) ends it when run() would rethrow it.
    bool abort_on_failure = true;
};

/// The point-to-point routes of one hierarchical_group replica (global rank = process x L +
/// local rank, L threads per process). The group holds an L x L grid of duplicates of its MPI
/// communicator, the mailboxes: mailbox [a][b] carries the messages from local rank a to local
/// rank b, between any two processes (a process and itself included). A replica sends on its
/// row and receives on its column through its own handles (mpi_communicator::message_view), so
/// the threads of a process never share a handle, and it is the only receiver on its column in
/// its process. Messages are matched by (source, tag), in order; the element types, tags and
/// errors are mpi_communicator's (its errors name process ranks), and each operation waits at
/// most params::mpi.timeout.
class hierarchical_group_routes {
public:
    /// This replica's handles on the grid (row-major, L x L; mailbox [a][b] at a * L + b).
    /// requires: grid.size() == L * L, 0 <= local < L; the grid outlives these routes.
    hierarchical_group_routes(std::span<const mpi_communicator> grid, int local,
                              const mpi_communicator_params& p)
        : threads_(local_size(grid.size())), local_(local), params_(p) {
        const auto L = static_cast<std::size_t>(threads_);
        const auto me = static_cast<std::size_t>(local);
        for (std::size_t x = 0; x < L; ++x) {
            to_.push_back(grid[me * L + x].message_view());
            from_.push_back(grid[x * L + me].message_view());
        }
        node_ = to_.front().rank();
        nodes_ = to_.front().size();
    }
    hierarchical_group_routes(hierarchical_group_routes&&) noexcept = default;
    hierarchical_group_routes& operator=(hierarchical_group_routes&&) noexcept = default;

    /// Sends data to replica dest on mailbox [local][dest's local rank].
    /// requires: 0 <= dest < processes x L (else errc::invalid_argument).
    template <class T>
    void send(std::span<const T> data, int dest, int tag) {
        require_replica(dest, "send");
        in_group_terms("send", dest, tag, [&] {
            to_[static_cast<std::size_t>(dest % threads_)].send(data, dest / threads_, tag);
        });
    }
    /// Receives the next message from replica source with tag (mailbox [source's local rank]
    /// [local]). ensures: the message held data.size() elements, else errc::count_mismatch.
    template <class T>
    void recv(std::span<T> data, int source, int tag) {
        require_replica(source, "recv");
        in_group_terms("recv", source, tag, [&] {
            from_[static_cast<std::size_t>(source % threads_)].recv(data, source / threads_, tag);
        });
    }
    /// As recv(data, source, tag), except that its timeout fails with on_timeout(e) in place of
    /// its own error e (in group terms), printed and ending the job as e would be
    /// (named_timeout_communicator).
    template <class T, class OnTimeout>
    void recv(std::span<T> data, int source, int tag, OnTimeout&& on_timeout) {
        require_replica(source, "recv");
        bool named = false; // the mailbox failed with on_timeout's error: pass it on as it is
        const auto in_group = patient(detail::timeout_periods(on_timeout), [&](const error& e) {
            error named_error = on_timeout(group_error("recv", source, tag, e));
            named = true;
            return named_error;
        });
        try {
            from_[static_cast<std::size_t>(source % threads_)].recv(data, source / threads_, tag,
                                                                    in_group);
        } catch (const error& e) {
            if (named)
                throw;
            throw group_error("recv", source, tag, e);
        }
    }
    /// Receives the next message with tag from any replica and returns its sender: polls the
    /// mailboxes of this replica's column in turn (a non-blocking probe each), then receives the
    /// message found. Waits at most params::mpi.timeout, then fails with errc::timeout naming
    /// this replica and the tag (printing it and ending the job when params::mpi.on_failure is
    /// mpi_failure_action::abort).
    template <class T>
    int recv_any(std::span<T> data, int tag) {
        return recv_any(data, tag, detail::same_error{});
    }
    /// As recv_any(data, tag), except that its timeout fails with on_timeout(e) in place of its
    /// own error e, printed and ending the job as e would be (named_timeout_communicator).
    template <class T, class OnTimeout>
    int recv_any(std::span<T> data, int tag, OnTimeout&& on_timeout) {
        using clock = std::chrono::steady_clock;
        const auto start = clock::now();
        const auto deadline = start + params_.timeout * detail::timeout_periods(on_timeout);
        auto nap = std::chrono::microseconds(10);
        for (std::uint64_t i = 0;; ++i) {
            for (int k = 0; k < threads_; ++k) {
                const int a = (next_ + k) % threads_;
                auto& box = from_[static_cast<std::size_t>(a)];
                if (const std::optional<int> node = box.probe(mpi_communicator::any_source, tag)) {
                    next_ = (a + 1) % threads_; // the other mailboxes first next time
                    const int source = *node * threads_ + a;
                    in_group_terms("recv_any", source, tag, [&] { box.recv(data, *node, tag); });
                    return source;
                }
            }
            if ((i & 15) != 15)
                continue;
            const auto now = clock::now();
            if (now >= deadline)
                timed_out(tag, on_timeout);
            if (now - start < std::chrono::microseconds(20))
                continue;
            std::this_thread::sleep_for(nap);
            nap = std::min(nap * 2, std::chrono::microseconds(100));
            i = 14; // probe once per sleep from now on
        }
    }
    /// Routes of the same replica on the same mailboxes (for a split group).
    hierarchical_group_routes share() const { return hierarchical_group_routes(*this); }

private:
    hierarchical_group_routes(const hierarchical_group_routes& o)
        : threads_(o.threads_), local_(o.local_), node_(o.node_), nodes_(o.nodes_),
          params_(o.params_) {
        for (std::size_t x = 0; x < o.to_.size(); ++x) {
            to_.push_back(o.to_[x].message_view());
            from_.push_back(o.from_[x].message_view());
        }
    }
    static int local_size(std::size_t cells) {
        std::size_t L = 1;
        while (L * L < cells)
            ++L;
        LOCKSTEP_REQUIRE(cells != 0 && L * L == cells, errc::invalid_argument, -1,
                         "hierarchical_group_routes", "the mailbox grid has ", cells,
                         " cells, not L x L");
        return static_cast<int>(L);
    }
    int rank() const noexcept { return node_ * threads_ + local_; }
    void require_replica(int r, const char* op) const {
        LOCKSTEP_REQUIRE(r >= 0 && r < nodes_ * threads_, errc::invalid_argument, rank(), op,
                         "replica ", r, " is not in this group of ", nodes_ * threads_);
    }
    // Runs a mailbox operation; its lockstep::error (which names MPI process ranks of the
    // mailbox) is rethrown with this replica's group rank, the operation and the peer's group
    // rank, keeping its code.
    template <class F>
    void in_group_terms(const char* op, int peer, int tag, F&& f) const {
        try {
            f();
        } catch (const error& e) {
            throw group_error(op, peer, tag, e);
        }
    }
    error group_error(const char* op, int peer, int tag, const error& e) const {
        return error(e.code(), rank(), op,
                     detail::concat("with replica ", peer, " (process ", peer / threads_,
                                    ", thread ", peer % threads_, "), tag ", tag, ": ", e.what()));
    }
    template <class OnTimeout>
    [[noreturn]] void timed_out(int tag, OnTimeout&& on_timeout) const {
        const error e = detail::named_timeout_error(
            on_timeout,
            error(errc::timeout, rank(), "recv_any",
                  detail::concat("timed out after ",
                                 params_.timeout.count() * detail::timeout_periods(on_timeout),
                                 " ms waiting for a message with tag ", tag,
                                 " from any replica (group of ", nodes_ * threads_, ")")));
        if (params_.on_failure == mpi_failure_action::abort)
            from_.front().abort(e, exit_status(e)); // 75: tools/lockstep-run relaunches
        throw e;
    }

    int threads_ = 1;
    int local_ = 0;
    int node_ = 0;
    int nodes_ = 1;
    int next_ = 0; // the mailbox recv_any probes first
    mpi_communicator_params params_;
    std::vector<mpi_communicator> to_;   // to_[b]: mailbox [local][b]
    std::vector<mpi_communicator> from_; // from_[a]: mailbox [a][local]
};

/// Every process of an MPI communicator runs `threads` replicas as threads; together they form
/// one group of size() = processes x threads replicas, with global rank = process rank x
/// threads + thread index. Each replica gets a hierarchical_communicator whose intra-node part
/// is a thread_communicator over its process's threads and whose inter-node part is an
/// mpi_communicator over the threads of the same index in every process:
///
///     lockstep::mpi_environment env(argc, argv, {.requested = MPI_THREAD_MULTIPLE,
///                                                .required = MPI_THREAD_MULTIPLE});
///     lockstep::hierarchical_group group(MPI_COMM_WORLD, 2);
///     group.run([&](lockstep::hierarchical_group::communicator_type& comm) { ... });
///
/// The threads of a process call MPI at the same time, each on its own communicator, so MPI
/// must provide MPI_THREAD_MULTIPLE (the constructor throws errc::unsupported otherwise).
///
/// The communicators have point-to-point messages between any two replicas (send, recv,
/// recv_any; see hierarchical_group_routes), so the asynchronous trainers run over them.
class hierarchical_group {
public:
    using communicator_type =
        hierarchical_communicator<thread_communicator, mpi_communicator, hierarchical_group_routes>;
    using params = hierarchical_group_params;

    /// Collective over comm: the processes agree on the thread count through one all_gather
    /// over a duplicate of comm made for it; when any process failed (MPI without
    /// MPI_THREAD_MULTIPLE, threads < 1) or the processes give different counts, every process
    /// throws (its own error, else errc::peer_failure, or errc::invalid_argument naming each
    /// process's count), so none is left waiting. Then it makes one duplicate of comm per
    /// thread index and threads x threads more for the point-to-point mailboxes.
    /// requires: MPI initialised with MPI_THREAD_MULTIPLE; threads >= 1, equal in every process.
    hierarchical_group(MPI_Comm comm, int threads, const params& p = {})
        : threads_(agreed_threads(comm, threads, p.mpi), p.threads), params_(p) {
        inter_.reserve(static_cast<std::size_t>(threads));
        for (int l = 0; l < threads; ++l)
            inter_.emplace_back(comm, p.mpi);
        mailboxes_.reserve(static_cast<std::size_t>(threads) * static_cast<std::size_t>(threads));
        for (int k = 0; k < threads * threads; ++k)
            mailboxes_.emplace_back(comm, p.mpi);
    }

    /// Replicas per process.
    int threads() const noexcept { return threads_.size(); }
    /// Processes.
    int processes() const noexcept { return inter_.empty() ? 0 : inter_.front().size(); }

    /// Calls f(comm) on threads() new threads of this process, each with its replica's
    /// communicator, and joins them. Every process calls run() with the same number of threads.
    /// ensures: returns when every replica of this process has returned; a failure of any
    /// replica, a replica thread that returned while the others waited for it in a collective
    /// included, ends the job (params::abort_on_failure) or is rethrown here.
    template <class F>
    requires std::invocable<F&, communicator_type&>
    void run(F&& f) {
        detail::run_or_end_job("hierarchical_group", params_.abort_on_failure, [&] {
            threads_.run([&](thread_communicator& intra) { replica_main(f, intra); });
        });
    }

private:
    // threads, once every process has checked its own setup and all give the same count
    // (detail::agree_replica_counts); otherwise every process throws. Without this, a process
    // with more threads would wait for duplicates the others never make.
    static int agreed_threads(MPI_Comm comm, int threads, const mpi_communicator_params& p) {
        int process = -1;
        LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm, &process));
        std::exception_ptr failure;
        try {
            detail::require_thread_multiple("hierarchical_group", process);
            LOCKSTEP_REQUIRE(threads >= 1, errc::invalid_argument, process, "hierarchical_group",
                             "threads ", threads, " must be at least 1");
        } catch (...) {
            failure = std::current_exception();
        }
        detail::agree_replica_counts(comm, threads, failure, p, "hierarchical_group",
                                     "replica threads",
                                     "pass the same thread count in every process");
        return threads;
    }

    // One replica: its communicator from this thread's handle and its local rank's MPI
    // communicator, which returns to the group for the next run(), after a failure too (an MPI
    // communicator stays usable after a refused call; one that timed out throws its failure
    // again). The communicator outlives the handlers: they record the failure while it still
    // holds the thread handle, so the peers report this failure rather than the handle's
    // departure.
    template <class F>
    void replica_main(F& f, thread_communicator& intra) {
        const auto l = static_cast<std::size_t>(intra.rank());
        std::optional<communicator_type> comm;
        const auto record_failure = [&] {
            (comm ? comm->intra() : intra).record_failure(std::current_exception());
            if (comm)
                inter_[l] = std::move(comm->inter());
        };
        try {
            comm.emplace(std::move(intra), std::move(inter_[l]),
                         hierarchical_group_routes(mailboxes_, static_cast<int>(l), params_.mpi));
            std::invoke(f, *comm);
            inter_[l] = std::move(comm->inter());
        } catch (const std::exception& e) {
            record_failure();
            if (params_.abort_on_failure && !detail::echoes_peer(e))
                detail::abort_mpi_job("hierarchical_group", "thread", static_cast<int>(l), e);
            throw;
        } catch (...) {
            record_failure();
            if (params_.abort_on_failure)
                detail::abort_mpi_job("hierarchical_group", "thread", static_cast<int>(l),
                                      detail::non_standard_exception());
            throw;
        }
    }

    thread_group threads_;
    params params_;
    std::vector<mpi_communicator> inter_;
    std::vector<mpi_communicator> mailboxes_; // [a * threads + b]: local rank a to b
};

static_assert(point_to_point_communicator<hierarchical_group::communicator_type>,
              "hierarchical_group's communicators must have point-to-point messages.");
static_assert(named_timeout_communicator<hierarchical_group::communicator_type>,
              "hierarchical_group's communicators must take on_timeout in recv and recv_any.");
static_assert(
    !point_to_point_communicator<hierarchical_communicator<thread_communicator, mpi_communicator>>,
    "a hierarchical_communicator without routes must not claim point-to-point.");

} // namespace lockstep

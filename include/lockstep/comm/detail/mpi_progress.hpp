// lockstep/comm/detail/mpi_progress.hpp: polling MPI operations against a deadline without
// burning a core, and the census a timed-out replica takes of its peers. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/detail/adaptive_spin.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <mpi.h>

namespace lockstep::detail {

using mpi_clock = std::chrono::steady_clock;

/// How a waiting replica polls. MPICH's blocking calls spin on the CPU for as long as they wait,
/// which on a machine with few cores takes the core a compute thread of the same process needs.
/// So: test in a tight loop for `spin` (short operations finish within it and keep their
/// latency), then test between sleeps that grow from `min_sleep` to `max_sleep`. MPI makes
/// progress only inside MPI calls, so a sleep also delays the next round of a multi-round
/// algorithm by at most one sleep.
///
/// MPI also moves data only inside MPI calls (MPICH copies large shared-memory messages in
/// pieces, one per progress call), so an operation of many bytes spins for about as long as its
/// transfer takes (1 ns per byte, at most 20 ms) before it sleeps: sleeping between the pieces
/// of a transfer under way stretched a 4 MiB all-reduce between 2 local ranks about 3x.
///
/// A collective's wait with a core per process spins longer still: about twice as long as the
/// communicator's recent collectives waited (wait_estimate, at most max_adaptive_spin). A peer
/// that arrives late by about as much every step then finds this replica testing, not asleep:
/// each sleep delays the collective by up to a nap, since MPI makes no progress while this
/// process sleeps.
struct mpi_poll_schedule {
    std::chrono::nanoseconds spin = std::chrono::microseconds(20);
    std::chrono::microseconds min_sleep{10};
    std::chrono::microseconds max_sleep{100};
    static constexpr std::chrono::nanoseconds max_adaptive_spin = std::chrono::milliseconds(1);

    /// The schedule of an operation that moves `bytes` bytes per replica.
    static mpi_poll_schedule for_bytes(std::size_t bytes) noexcept {
        mpi_poll_schedule s;
        const auto transfer = std::chrono::nanoseconds(
            static_cast<std::int64_t>(std::min<std::size_t>(bytes, std::size_t(20'000'000))));
        s.spin = std::max(s.spin, transfer);
        return s;
    }
};

/// What a census learned about one peer at the collective the asking replica waits in.
struct mpi_peer_report {
    enum class state { self, arrived, behind, silent } where = state::silent;
    std::int64_t sequence = -1; ///< the peer's count of started collectives (-1 when silent)
    bool inside = false;        ///< the peer was waiting inside a communication call
};

/// The control channel of one mpi_communicator (its own duplicate MPI communicator, so control
/// messages never match user messages): while a replica waits it answers peers' inquiries with
/// its sequence number; a replica that timed out asks every peer where it is.
class mpi_control {
public:
    static constexpr int inquiry_tag = 1;
    static constexpr int reply_tag = 2;

    mpi_control() = default;
    mpi_control(const mpi_control&) = delete;
    mpi_control& operator=(const mpi_control&) = delete;
    ~mpi_control() { release(); }

    /// requires: comm is a fresh communicator this object now owns (or MPI_COMM_NULL).
    void adopt(MPI_Comm comm) noexcept {
        release();
        comm_ = comm;
    }
    MPI_Comm comm() const noexcept { return comm_; }
    /// Moves o's channel into this one.
    void take(mpi_control& o) noexcept {
        release();
        comm_ = o.comm_;
        o.comm_ = MPI_COMM_NULL;
        replies_ = std::move(o.replies_);
        census_.swap(o.census_);
    }

    /// Answers every inquiry that has arrived with {sequence, inside}. Returns an MPI error code
    /// (MPI_SUCCESS when all went well).
    int serve(std::int64_t sequence, bool inside) noexcept {
        if (comm_ == MPI_COMM_NULL)
            return MPI_SUCCESS;
        for (;;) {
            int flag = 0;
            MPI_Message msg = MPI_MESSAGE_NULL;
            MPI_Status st;
            int rc = MPI_Improbe(MPI_ANY_SOURCE, inquiry_tag, comm_, &flag, &msg, &st);
            if (rc != MPI_SUCCESS)
                return rc;
            if (!flag)
                break;
            std::int64_t asked = 0;
            rc = MPI_Mrecv(&asked, 1, MPI_INT64_T, &msg, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS)
                return rc;
            auto r = std::make_unique<reply>();
            r->value[0] = sequence;
            r->value[1] = inside ? 1 : 0;
            rc = MPI_Isend(r->value, 2, MPI_INT64_T, st.MPI_SOURCE, reply_tag, comm_, &r->request);
            if (rc != MPI_SUCCESS)
                return rc;
            replies_.push_back(std::move(r));
        }
        std::erase_if(replies_, [](const std::unique_ptr<reply>& r) {
            int done = 0;
            return MPI_Test(&r->request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done != 0;
        });
        return MPI_SUCCESS;
    }

    /// Asks every peer where it is and waits up to `grace` for the answers (answering peers'
    /// inquiries meanwhile). A peer answers only while it waits inside a call of its
    /// mpi_communicator; one that computes, has exited or has finalised MPI stays silent.
    /// Runs at most once per channel (the communicator is broken afterwards): the buffers of
    /// unanswered messages stay allocated until the channel is destroyed.
    std::vector<mpi_peer_report> census(int rank, int size, std::int64_t sequence,
                                        std::chrono::milliseconds grace) noexcept {
        std::vector<mpi_peer_report> out(static_cast<std::size_t>(size));
        if (comm_ == MPI_COMM_NULL || census_)
            return out;
        census_ = std::make_unique<census_buffers>(size);
        census_->asked = sequence;
        auto& c = *census_;
        for (int j = 0; j < size; ++j) {
            auto& o = out[static_cast<std::size_t>(j)];
            if (j == rank) {
                o.where = mpi_peer_report::state::self;
                o.sequence = sequence;
                o.inside = true;
                continue;
            }
            const auto u = static_cast<std::size_t>(j);
            if (MPI_Irecv(c.answer[u].data(), 2, MPI_INT64_T, j, reply_tag, comm_, &c.recv[u]) !=
                MPI_SUCCESS)
                c.recv[u] = MPI_REQUEST_NULL;
            if (MPI_Isend(&c.asked, 1, MPI_INT64_T, j, inquiry_tag, comm_, &c.send[u]) !=
                MPI_SUCCESS)
                c.send[u] = MPI_REQUEST_NULL;
        }
        const auto deadline = mpi_clock::now() + grace;
        std::vector<bool> answered(static_cast<std::size_t>(size), false);
        for (;;) {
            bool all = true;
            for (int j = 0; j < size; ++j) {
                const auto u = static_cast<std::size_t>(j);
                if (j == rank || answered[u] || c.recv[u] == MPI_REQUEST_NULL)
                    continue;
                int done = 0;
                if (MPI_Test(&c.recv[u], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
                    c.recv[u] = MPI_REQUEST_NULL;
                    continue;
                }
                if (done) {
                    answered[u] = true;
                    auto& o = out[u];
                    o.sequence = c.answer[u][0];
                    o.inside = c.answer[u][1] != 0;
                    const bool arrived =
                        o.sequence > sequence || (o.sequence == sequence && o.inside);
                    o.where =
                        arrived ? mpi_peer_report::state::arrived : mpi_peer_report::state::behind;
                } else {
                    all = false;
                }
            }
            for (int j = 0; j < size; ++j) {
                const auto u = static_cast<std::size_t>(j);
                int done = 0;
                if (c.send[u] != MPI_REQUEST_NULL &&
                    MPI_Test(&c.send[u], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
                    c.send[u] = MPI_REQUEST_NULL;
            }
            serve(sequence, true);
            if (all || mpi_clock::now() >= deadline)
                break;
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        return out;
    }

private:
    struct reply {
        std::int64_t value[2] = {0, 0};
        MPI_Request request = MPI_REQUEST_NULL;
    };
    struct census_buffers {
        explicit census_buffers(int n)
            : answer(static_cast<std::size_t>(n)),
              send(static_cast<std::size_t>(n), MPI_REQUEST_NULL),
              recv(static_cast<std::size_t>(n), MPI_REQUEST_NULL) {}
        std::int64_t asked = 0;
        std::vector<std::array<std::int64_t, 2>> answer;
        std::vector<MPI_Request> send, recv;
    };

    void release() noexcept {
        int finalized = 1;
        MPI_Finalized(&finalized);
        // After a census or with replies in flight MPI may still write the buffers: keep them
        // (the communicator is broken and the job is about to end anyway).
        if (census_ || !replies_.empty()) {
            (void)census_.release();
            for (auto& r : replies_)
                (void)r.release();
        }
        replies_.clear();
        if (comm_ != MPI_COMM_NULL && !finalized)
            MPI_Comm_free(&comm_);
        comm_ = MPI_COMM_NULL;
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    std::vector<std::unique_ptr<reply>> replies_;
    std::unique_ptr<census_buffers> census_;
};

/// Polls `test(done, status)` (an MPI_Test-like call returning an MPI error code) until it
/// reports done, fails, or `deadline` passes, following `schedule`; while sleeping it answers
/// census inquiries on `control` with {sequence, inside = true}. ensures: returns the first
/// non-success MPI code, else MPI_SUCCESS with `done` true, or MPI_SUCCESS with `done` false
/// once the deadline has passed.
template <class Test>
int mpi_poll(Test&& test, mpi_clock::time_point deadline, mpi_control& control,
             std::int64_t sequence, bool& done, const mpi_poll_schedule& schedule = {}) {
    done = false;
    const auto start = mpi_clock::now();
    auto nap = schedule.min_sleep;
    for (std::uint64_t i = 0;; ++i) {
        int flag = 0;
        const int rc = test(flag);
        if (rc != MPI_SUCCESS)
            return rc;
        if (flag) {
            done = true;
            return MPI_SUCCESS;
        }
        if ((i & 15) != 15)
            continue;
        const auto now = mpi_clock::now();
        if (now >= deadline)
            return MPI_SUCCESS;
        if (now - start < schedule.spin)
            continue;
        const int served = control.serve(sequence, true);
        if (served != MPI_SUCCESS)
            return served;
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, schedule.max_sleep);
        i = 14; // test once per sleep from now on
    }
}

} // namespace lockstep::detail

// tests/support/rank_launcher_detail.hpp: the launcher's side of the rank protocol: starting
// the ranks, relaying their collectives, judging deaths and timeouts (used by rank_launcher.hpp).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "support/rank_spawn.hpp"
#include "support/rank_wire.hpp"

#include <csignal>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace lockstep_test::ranks::detail {

/// "ranks 0, 2" / "rank 1".
inline std::string rank_list(const std::vector<int>& ranks) {
    std::string s = ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i)
        s += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
    return s;
}

/// While alive, SIGTERM and SIGINT set stop_signal() instead of ending the process: the
/// launcher then kills its ranks at once and still returns its verdict (which ranks waited in
/// which collective, which had not arrived), so a caller's timeout (CTest, scripts/gpu_run.py)
/// gets a diagnosis instead of a silent death. The old handlers come back at the end.
class stop_signals {
public:
    stop_signals() {
        flag() = 0;
        struct sigaction sa {};
        sa.sa_handler = &on_signal;
        sigemptyset(&sa.sa_mask);
        ::sigaction(SIGTERM, &sa, &old_term_);
        ::sigaction(SIGINT, &sa, &old_int_);
    }
    ~stop_signals() {
        ::sigaction(SIGTERM, &old_term_, nullptr);
        ::sigaction(SIGINT, &old_int_, nullptr);
    }
    stop_signals(const stop_signals&) = delete;
    stop_signals& operator=(const stop_signals&) = delete;

    /// The signal received since construction, or 0.
    static int stop_signal() { return flag(); }

private:
    static volatile std::sig_atomic_t& flag() {
        static volatile std::sig_atomic_t f = 0;
        return f;
    }
    static void on_signal(int sig) { flag() = sig; }
    struct sigaction old_term_ {};
    struct sigaction old_int_ {};
};

/// The launcher's state machine; launch() runs one.
class launcher {
public:
    launcher(const std::vector<std::string>& argv, int ranks, std::chrono::seconds case_timeout,
             std::chrono::seconds grace, bool distinct_host_ids)
        : case_timeout_(std::max(case_timeout, std::chrono::seconds(0))),
          grace_(std::max(grace, std::chrono::seconds(0))) {
        if (argv.empty() || argv[0].empty())
            throw std::invalid_argument("rank launcher: launch: argv names no program");
        if (ranks < 1 || ranks > 4096)
            throw std::invalid_argument("rank launcher: launch: " + std::to_string(ranks) +
                                        " ranks (need 1 to 4096)");
        ranks_.resize(static_cast<std::size_t>(ranks));
        for (int r = 0; r < ranks; ++r)
            ranks_[static_cast<std::size_t>(r)].rank = r;
        try {
            for (auto& r : ranks_)
                start(r, argv, distinct_host_ids);
        } catch (...) {
            end_all();
            throw;
        }
    }

    launcher(const launcher&) = delete;
    launcher& operator=(const launcher&) = delete;

    ~launcher() { end_all(); }

    /// Relays and judges until every rank is reaped (or, after SIGKILL, 10 s have passed).
    void run() {
        const stop_signals stop;
        const auto start = clock::now();
        case_deadline_ = start + case_timeout_;
        clock::time_point reap_deadline{};
        while (!all_reaped()) {
            auto now = clock::now();
            if (stopped_by_ == 0 && stop_signals::stop_signal() != 0) {
                stopped_by_ = stop_signals::stop_signal();
                fail_stopped(std::chrono::duration_cast<std::chrono::seconds>(now - start));
                kill_deadline_ = now; // no grace: whoever sent it waits for this process
            }
            if (!failed_ && now >= case_deadline_)
                fail_timeout();
            if (failed_ && !killed_all_ && now >= kill_deadline_) {
                kill_all();
                reap_deadline = now + std::chrono::seconds(10);
            }
            if (killed_all_ && now >= reap_deadline)
                break; // a process that survives SIGKILL this long is stuck in the kernel
            // Deaths show as end of stream on the socket; the short wait reaps a rank that
            // closed its socket early, or whose socket a forked grandchild still holds.
            auto wake = now + std::chrono::milliseconds(100);
            wake = std::min(wake, !failed_ ? case_deadline_
                                           : (killed_all_ ? reap_deadline : kill_deadline_));
            std::vector<pollfd> fds;
            std::vector<rank_state*> owners;
            for (auto& r : ranks_) {
                if (r.fd >= 0) {
                    fds.push_back(pollfd{r.fd, POLLIN, 0});
                    owners.push_back(&r);
                } else if (!r.reaped) {
                    wake = std::min(wake, now + std::chrono::milliseconds(5));
                }
            }
            const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(wake));
            if (n < 0 && errno != EINTR)
                throw std::runtime_error(std::string("rank launcher: poll: ") +
                                         std::strerror(errno));
            for (std::size_t i = 0; n > 0 && i < fds.size(); ++i)
                if (fds[i].revents != 0)
                    drain(*owners[i]);
            reap();
            progress();
        }
    }

    const std::vector<rank_state>& states() const { return ranks_; }
    /// Whether a rank failed, died unplanned or hung (then exit code 1), and the verdict.
    bool failed() const { return failed_; }
    const std::string& reason() const { return reason_; }
    /// The signal (SIGTERM, SIGINT) that stopped the launcher, or 0.
    int stopped_by() const { return stopped_by_; }
    /// False only when a rank survived SIGKILL for 10 s.
    bool all_reaped() const {
        return std::all_of(ranks_.begin(), ranks_.end(), [](auto& r) { return r.reaped; });
    }

private:
    void start(rank_state& r, const std::vector<std::string>& argv, bool distinct_host_ids) {
        const auto wait = case_timeout_ + grace_ + std::chrono::seconds(10);
        const spawned child =
            spawn_rank(argv, r.rank, static_cast<int>(ranks_.size()), wait, distinct_host_ids);
        r.pid = child.pid;
        r.fd = child.fd;
    }

    /// Only an exception leaves ranks behind: kill them and reap them (bounded).
    void end_all() noexcept {
        for (auto& r : ranks_)
            r.reaped = r.reaped || r.pid <= 0; // never started
        if (!all_reaped()) {
            failed_ = true;
            kill_all();
        }
        const auto deadline = clock::now() + std::chrono::seconds(5);
        while (!all_reaped() && clock::now() < deadline) {
            for (auto& r : ranks_) {
                int status = 0;
                if (!r.reaped && ::waitpid(r.pid, &status, WNOHANG) != 0)
                    r.reaped = true;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        for (auto& r : ranks_)
            close_fd(r);
    }

    static void close_fd(rank_state& r) {
        if (r.fd >= 0)
            ::close(r.fd);
        r.fd = -1;
    }

    /// Reads what the rank wrote (non-blocking) and handles each whole frame.
    void drain(rank_state& r) {
        std::byte buf[4096];
        while (r.fd >= 0) {
            const ssize_t n = ::recv(r.fd, buf, sizeof buf, MSG_DONTWAIT);
            if (n > 0) {
                r.inbox.insert(r.inbox.end(), buf, buf + n);
            } else if (n < 0 && errno == EINTR) {
                continue;
            } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                break;
            } else {
                close_fd(r); // end of stream (or reset): the rank is gone or going
            }
        }
        frame_header h{};
        while (r.inbox.size() >= sizeof h) {
            std::memcpy(&h, r.inbox.data(), sizeof h);
            if (h.size > max_payload + 4096) {
                r.culprit = true;
                fail("rank " + std::to_string(r.rank) + " sent a frame of " +
                     std::to_string(h.size) + " bytes (not the rank protocol)");
                r.inbox.clear();
                close_fd(r);
                return;
            }
            if (r.inbox.size() < sizeof h + h.size)
                return;
            const std::vector<std::byte> payload(r.inbox.begin() + sizeof h,
                                                 r.inbox.begin() + sizeof h + h.size);
            r.inbox.erase(r.inbox.begin(), r.inbox.begin() + sizeof h + h.size);
            handle(r, static_cast<frame_kind>(h.kind), payload);
        }
    }

    void handle(rank_state& r, frame_kind kind, const std::vector<std::byte>& payload) {
        const std::string who = "rank " + std::to_string(r.rank);
        switch (kind) {
        case frame_kind::exec_failed: {
            int err = 0;
            std::memcpy(&err, payload.data(), std::min(payload.size(), sizeof err));
            r.exec_error = std::strerror(err);
            return;
        }
        case frame_kind::planned_exit:
            r.planned = true;
            r.waiting = false;
            return;
        case frame_kind::share:
        case frame_kind::agree:
            break;
        default:
            r.culprit = true;
            return fail(who + " sent a frame of kind " +
                        std::to_string(static_cast<std::uint32_t>(kind)));
        }
        if (!failed_ && r.waiting) { // a second post before its answer: not the protocol
            r.culprit = true;
            fail(who + " posted a collective while waiting in another");
        }
        if (failed_ || r.planned)
            return answer(r, false, failed_ ? reason_ : who + " announced planned_exit");
        r.waiting = true;
        r.posted = kind;
        r.bytes.clear();
        if (kind == frame_kind::share && r.rank == 0)
            r.bytes = payload;
        if (kind == frame_kind::agree) {
            r.ok = !payload.empty() && payload[0] != std::byte{0};
            r.what = payload.size() > 1 ? std::string(reinterpret_cast<const char*>(&payload[1]),
                                                      payload.size() - 1)
                                        : std::string();
            if (!r.ok) { // the agreement is false already: answer now, whatever the others do
                r.culprit = true;
                fail(who + " failed '" + r.what + "'");
            }
        }
    }

    /// Sends one answer: status byte, then data.
    void answer(rank_state& r, bool ok, std::string_view data) {
        answer(r, ok, std::as_bytes(std::span(data.data(), data.size())));
    }
    void answer(rank_state& r, bool ok, std::span<const std::byte> data) {
        r.waiting = false;
        if (r.fd < 0)
            return;
        std::vector<std::byte> payload(1 + data.size());
        payload[0] = ok ? std::byte{0} : std::byte{1};
        if (!data.empty())
            std::memcpy(payload.data() + 1, data.data(), data.size());
        // A rank that waits reads at once; one that does not within the bound is stuck anyway.
        if (!send_frame(r.fd, frame_kind::answer, payload,
                        clock::now() + std::chrono::seconds(2)) &&
            !failed_) {
            r.culprit = true;
            fail("rank " + std::to_string(r.rank) + " did not take the launcher's answer");
        }
    }

    /// Reaps the ranks that died (non-blocking) and judges each death.
    void reap() {
        for (auto& r : ranks_) {
            if (r.reaped || r.pid <= 0)
                continue;
            int status = 0;
            pid_t p;
            do
                p = ::waitpid(r.pid, &status, WNOHANG);
            while (p < 0 && errno == EINTR);
            if (p == 0)
                continue;
            // Everything the rank wrote is in its socket now: its planned_exit counts.
            drain(r);
            close_fd(r);
            r.reaped = true;
            r.status = p < 0 ? (255 << 8) : status; // ECHILD: reaped by someone else
            if (!r.planned && !r.killed && !failed_ &&
                !(WIFEXITED(r.status) &&
                  (WEXITSTATUS(r.status) == 0 || WEXITSTATUS(r.status) == 77))) {
                r.culprit = true;
                fail("rank " + std::to_string(r.rank) + " " + death(r));
            }
        }
    }

    /// Completes the collective every member waits in, or fails when one left without it.
    void progress() {
        if (failed_)
            return;
        std::vector<rank_state*> members;
        for (auto& r : ranks_)
            if (r.member())
                members.push_back(&r);
        const auto waits = [](rank_state* r) { return r->waiting; };
        const auto first = std::find_if(members.begin(), members.end(), waits);
        if (first == members.end())
            return;
        for (auto* r : members) {
            if (r->reaped) {
                r->culprit = true;
                return fail("rank " + std::to_string(r->rank) + " " + death(*r) + " while " +
                            waiting_list(members) + " in " + collective_name((*first)->posted));
            }
        }
        if (!std::all_of(members.begin(), members.end(), waits))
            return;
        const frame_kind kind = (*first)->posted;
        std::vector<int> odd;
        for (auto* r : members)
            if (r->posted != kind)
                odd.push_back(r->rank);
        if (!odd.empty()) {
            for (auto* r : members)
                r->culprit = r->posted != kind;
            return fail(
                rank_list(odd) + " called " +
                collective_name(kind == frame_kind::share ? frame_kind::agree : frame_kind::share) +
                " while rank " + std::to_string((*first)->rank) + " called " +
                collective_name(kind));
        }
        if (kind == frame_kind::share) {
            if (!ranks_[0].member()) {
                for (auto* r : members)
                    r->culprit = true;
                return fail("share_from_rank0 after rank 0 left (planned_exit)");
            }
            const auto bytes = ranks_[0].bytes;
            for (auto* r : members)
                answer(*r, true, bytes);
        } else { // every vote is ok: a failed one ends the run when it arrives (handle)
            for (auto* r : members)
                answer(*r, true, std::span<const std::byte>{});
        }
        if (!failed_)
            case_deadline_ = clock::now() + case_timeout_;
    }

    /// Enters the failed state: every waiting rank gets "failed", the ranks get the grace.
    void fail(std::string reason) {
        if (failed_)
            return;
        failed_ = true;
        reason_ = std::move(reason);
        kill_deadline_ = clock::now() + grace_;
        for (auto& r : ranks_)
            if (r.waiting)
                answer(r, false, reason_);
    }

    void fail_timeout() {
        std::vector<rank_state*> members;
        for (auto& r : ranks_)
            if (r.member() && !r.reaped)
                members.push_back(&r);
        std::vector<int> stuck;
        for (auto* r : members) {
            if (!r->waiting) {
                r->culprit = r->hung = true;
                stuck.push_back(r->rank);
            }
        }
        const std::string limit = std::to_string(case_timeout_.count()) + " s";
        const auto w =
            std::find_if(members.begin(), members.end(), [](auto* r) { return r->waiting; });
        if (w == members.end())
            return fail("no collective completed within " + limit + " (" + rank_list(stuck) +
                        " hung)");
        fail(rank_list(stuck) + " hung past the timeout (" + limit + ") while " +
             waiting_list(members) + " in " + collective_name((*w)->posted));
    }

    /// A stop from outside (stop_signals): the verdict names the ranks that had not arrived
    /// where others wait (the likely hang) and where the others wait.
    void fail_stopped(std::chrono::seconds after) {
        std::vector<rank_state*> members;
        for (auto& r : ranks_)
            if (r.member() && !r.reaped)
                members.push_back(&r);
        std::vector<int> running;
        for (auto* r : members)
            if (!r->waiting)
                running.push_back(r->rank);
        const auto w =
            std::find_if(members.begin(), members.end(), [](auto* r) { return r->waiting; });
        std::string why = "stopped by " + signal_name(stopped_by_) + " from outside after " +
                          std::to_string(after.count()) + " s: ";
        if (w == members.end())
            return fail(why + "no rank in a collective (" + rank_list(running) + " running)");
        for (auto* r : members)
            r->culprit = !r->waiting;
        fail(why +
             (running.empty() ? std::string("no rank running")
                              : rank_list(running) + " had not arrived") +
             " while " + waiting_list(members) + " in " + collective_name((*w)->posted));
    }

    void kill_all() {
        for (auto& r : ranks_) {
            if (r.reaped || r.pid <= 0)
                continue;
            ::kill(-r.pid, SIGKILL); // its process group; ESRCH before its setpgid
            ::kill(r.pid, SIGKILL);
            r.killed = true;
        }
        killed_all_ = true;
    }

    static std::string collective_name(frame_kind k) {
        return k == frame_kind::share ? "share_from_rank0" : "agree";
    }

    static std::string waiting_list(const std::vector<rank_state*>& members) {
        std::vector<int> w;
        for (auto* r : members)
            if (r->waiting)
                w.push_back(r->rank);
        return rank_list(w) + (w.size() == 1 ? " waits" : " wait");
    }

    std::vector<rank_state> ranks_;
    std::chrono::seconds case_timeout_;
    std::chrono::seconds grace_;
    clock::time_point case_deadline_{};
    clock::time_point kill_deadline_{};
    bool failed_ = false;
    bool killed_all_ = false;
    int stopped_by_ = 0;
    std::string reason_;
};

} // namespace lockstep_test::ranks::detail

// tests/support/rank_process.hpp: the rank side of the rank launcher (rank_launcher.hpp): a
// process it started learns its rank and joins the collectives the launcher relays.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "support/rank_wire.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep_test::ranks {

namespace detail {

/// This process's connection to the launcher; fd < 0 outside a rank process.
struct rank_link {
    int fd = -1;
    int rank = 0;
    int size = 1;
    std::chrono::milliseconds wait{std::chrono::minutes(10)};
};

/// Collectives from several threads of a rank go out one at a time.
inline std::mutex& link_mutex() {
    static std::mutex m;
    return m;
}

/// The integer value of environment variable name, or fallback when it is unset.
/// ensures: throws std::runtime_error when it is set but not an integer in [lo, hi].
inline long env_integer(const char* name, long fallback, long lo, long hi) {
    const char* s = std::getenv(name);
    if (s == nullptr)
        return fallback;
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v < lo || v > hi)
        throw std::runtime_error(std::string("rank launcher: ") + name + "='" + s +
                                 "' is not an integer in [" + std::to_string(lo) + ", " +
                                 std::to_string(hi) + "]");
    return v;
}

/// Whether fd is a socket whose peer is the launcher (LOCKSTEP_LAUNCHER_PID; Linux checks the
/// peer's pid, elsewhere only that fd is a socket).
inline bool connected_to_launcher(int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode))
        return false;
#ifdef __linux__
    ucred peer{};
    socklen_t len = sizeof peer;
    return ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 &&
           peer.pid == env_integer(env_launcher_pid, -1, -1, 1L << 40);
#else
    return true;
#endif
}

/// This process's link to the launcher, read from the environment on first use.
inline const rank_link& link() {
    static const rank_link l = [] {
        rank_link out;
        if (std::getenv(env_rank) == nullptr || std::getenv(env_ranks) == nullptr ||
            std::getenv(env_rank_fd) == nullptr)
            return out;
        const int fd = static_cast<int>(env_integer(env_rank_fd, -1, 0, 1 << 20));
        // A program that a rank starts after its first call here inherits the variables but not
        // the fd, whose number may name another file there: it is no rank. (One started by a
        // wrapper such as `timeout`, before any call, holds the fd and is the rank.)
        if (!connected_to_launcher(fd))
            return out;
        out.size = static_cast<int>(env_integer(env_ranks, 1, 1, 4096));
        out.rank = static_cast<int>(env_integer(env_rank, 0, 0, out.size - 1));
        out.wait = std::chrono::milliseconds(env_integer(env_rank_wait_ms, 600'000, 1, 1L << 40));
        // The fd stays this process's own: a program it starts must not hold it, or the launcher
        // would not see this rank's end of stream when it dies.
        ::fcntl(fd, F_SETFD, FD_CLOEXEC);
        out.fd = fd;
        return out;
    }();
    return l;
}

/// Sends one request and waits for the launcher's answer.
/// ensures: the answer's payload (status byte first); an empty vector when the launcher is gone
/// or did not answer within the link's wait.
inline std::vector<std::byte> request(const rank_link& l, frame_kind kind,
                                      std::span<const std::byte> payload) {
    const auto deadline = clock::now() + l.wait;
    if (!send_frame(l.fd, kind, payload, deadline))
        return {};
    frame_header h{};
    if (!recv_all(l.fd, reinterpret_cast<std::byte*>(&h), sizeof h, deadline) ||
        h.kind != static_cast<std::uint32_t>(frame_kind::answer) || h.size == 0 ||
        h.size > max_payload + 1)
        return {};
    std::vector<std::byte> answer(h.size);
    if (!recv_all(l.fd, answer.data(), answer.size(), deadline))
        return {};
    return answer;
}

/// The failure text of an answer (empty answer: the launcher is gone or silent).
inline std::string failure_text(const std::vector<std::byte>& answer) {
    if (answer.empty())
        return "no answer from the launcher (it is gone, or did not answer in time)";
    return {reinterpret_cast<const char*>(answer.data()) + 1, answer.size() - 1};
}

} // namespace detail

/// True when this process was started by launch() (LOCKSTEP_RANK, LOCKSTEP_RANKS and
/// LOCKSTEP_RANK_FD are set). Throws std::runtime_error when they are set but malformed.
inline bool is_rank_process() {
    return detail::link().fd >= 0;
}

/// This process's rank: 0 outside a rank process.
inline int rank() {
    return detail::link().rank;
}

/// The number of ranks launch() started: 1 outside a rank process.
inline int size() {
    return detail::link().size;
}

/// Collective over every rank still in the protocol: each gets rank 0's bytes (the others pass
/// an empty span; their bytes are ignored). Outside a rank process it returns mine.
/// requires: mine.size() <= 1 MiB on rank 0.
/// ensures: throws std::runtime_error naming this rank and the cause when a peer failed or died,
/// rank 0 left, or the ranks timed out.
inline std::vector<std::byte> share_from_rank0(std::span<const std::byte> mine) {
    const auto& l = detail::link();
    if (l.fd < 0)
        return std::vector<std::byte>(mine.begin(), mine.end());
    if (l.rank == 0 && mine.size() > detail::max_payload)
        throw std::runtime_error("rank 0: share_from_rank0: " + std::to_string(mine.size()) +
                                 " bytes, more than the launcher relays (1 MiB)");
    const std::lock_guard lock(detail::link_mutex());
    const auto answer = detail::request(l, detail::frame_kind::share,
                                        l.rank == 0 ? mine : std::span<const std::byte>{});
    if (answer.empty() || answer[0] != std::byte{0})
        throw std::runtime_error("rank " + std::to_string(l.rank) +
                                 ": share_from_rank0: " + detail::failure_text(answer));
    return std::vector<std::byte>(answer.begin() + 1, answer.end());
}

/// Collective: true iff every rank still in the protocol passed ok. False, never a hang, when
/// another rank failed, died or timed out (the launcher answers; this rank prints its reason on
/// stderr). Outside a rank process it returns ok.
inline bool agree(bool ok, std::string_view what) {
    const auto& l = detail::link();
    if (l.fd < 0)
        return ok;
    std::vector<std::byte> payload(1 + what.size());
    payload[0] = ok ? std::byte{1} : std::byte{0};
    if (!what.empty())
        std::memcpy(payload.data() + 1, what.data(), what.size());
    const std::lock_guard lock(detail::link_mutex());
    const auto answer = detail::request(l, detail::frame_kind::agree, payload);
    if (!answer.empty() && answer[0] == std::byte{0})
        return true;
    std::fprintf(stderr, "rank %d: agreement on '%.*s' failed: %s\n", l.rank,
                 static_cast<int>(what.size()), what.data(), detail::failure_text(answer).c_str());
    std::fflush(stderr);
    return false;
}

/// Tells the launcher that this rank is about to die on purpose (a fault test's raise(SIGKILL)):
/// its death then counts as success, and later collectives go on among the other ranks. Outside
/// a rank process it does nothing.
/// requires: this rank joins no collective afterwards (one would be answered "failed").
inline void planned_exit() {
    const auto& l = detail::link();
    if (l.fd < 0)
        return;
    const std::lock_guard lock(detail::link_mutex());
    // No answer to wait for: the frame is in the socket before the rank dies, and the launcher
    // reads everything a rank wrote before it judges the rank's death.
    (void)detail::send_frame(l.fd, detail::frame_kind::planned_exit, {},
                             detail::clock::now() + l.wait);
}

} // namespace lockstep_test::ranks

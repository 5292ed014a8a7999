// tests/support/rank_wire.hpp: the frames the rank launcher and its rank processes exchange over
// one socket per rank, and reads and writes on it bounded by a deadline. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace lockstep_test::ranks::detail {

using clock = std::chrono::steady_clock;

/// The environment the launcher gives each rank (launch() sets them before execve).
inline constexpr const char* env_rank = "LOCKSTEP_RANK";
inline constexpr const char* env_ranks = "LOCKSTEP_RANKS";
inline constexpr const char* env_rank_fd = "LOCKSTEP_RANK_FD";
/// How long a rank waits for an answer: the launcher answers within its case timeout, so this
/// only ends the wait of a rank whose launcher is stuck (it would have died with the launcher).
inline constexpr const char* env_rank_wait_ms = "LOCKSTEP_RANK_WAIT_MS";
/// The launcher's pid: the peer a rank's fd must be connected to.
inline constexpr const char* env_launcher_pid = "LOCKSTEP_LAUNCHER_PID";

/// What a frame carries. A rank sends share, agree, planned_exit (and exec_failed, written by the
/// forked child when execve fails); the launcher answers share and agree with one answer frame:
/// a status byte (0: ok, 1: failed) then rank 0's bytes (share) or the failure's text.
enum class frame_kind : std::uint32_t {
    share = 1,
    agree = 2,
    planned_exit = 3,
    exec_failed = 4,
    answer = 16,
};

/// A frame is this header (native byte order: both ends run on one machine) then size bytes.
struct frame_header {
    std::uint32_t kind;
    std::uint32_t size;
};

/// The largest payload either end accepts (an ncclUniqueId is 128 bytes).
inline constexpr std::uint32_t max_payload = 1u << 20;

/// Milliseconds from now to deadline for poll(): 0 when it has passed, rounded up otherwise.
inline int poll_timeout_ms(clock::time_point deadline) {
    const auto left = deadline - clock::now();
    if (left <= clock::duration::zero())
        return 0;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    return ms > 60'000 ? 60'000 : static_cast<int>(ms);
}

/// Waits until fd is ready for events or deadline passes (EINTR retried).
/// ensures: true when ready (or in error/hang-up, which the next read or write reports).
inline bool wait_ready(int fd, short events, clock::time_point deadline) {
    for (;;) {
        pollfd p{fd, events, 0};
        const int n = ::poll(&p, 1, poll_timeout_ms(deadline));
        if (n > 0)
            return true;
        if (n < 0 && errno != EINTR)
            return false;
        if (n == 0 && clock::now() >= deadline)
            return false;
    }
}

/// Writes all n bytes to the socket fd before deadline. MSG_NOSIGNAL: a peer that is gone gives
/// EPIPE here instead of SIGPIPE to the writer.
/// ensures: true when everything was written; false on error, peer gone or timeout.
inline bool send_all(int fd, const std::byte* data, std::size_t n, clock::time_point deadline) {
    while (n > 0) {
        const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            data += w;
            n -= static_cast<std::size_t>(w);
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!wait_ready(fd, POLLOUT, deadline))
                return false;
        } else {
            return false;
        }
    }
    return true;
}

/// Reads exactly n bytes from the socket fd before deadline.
/// ensures: true when all arrived; false on end of stream, error or timeout.
inline bool recv_all(int fd, std::byte* data, std::size_t n, clock::time_point deadline) {
    while (n > 0) {
        const ssize_t r = ::recv(fd, data, n, MSG_DONTWAIT);
        if (r > 0) {
            data += r;
            n -= static_cast<std::size_t>(r);
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!wait_ready(fd, POLLIN, deadline))
                return false;
        } else {
            return false; // end of stream or error
        }
    }
    return true;
}

/// One frame as bytes: header then payload.
inline std::vector<std::byte> make_frame(frame_kind kind, std::span<const std::byte> payload) {
    const frame_header h{static_cast<std::uint32_t>(kind),
                         static_cast<std::uint32_t>(payload.size())};
    std::vector<std::byte> out(sizeof h + payload.size());
    std::memcpy(out.data(), &h, sizeof h);
    if (!payload.empty())
        std::memcpy(out.data() + sizeof h, payload.data(), payload.size());
    return out;
}

/// Sends one frame before deadline (see send_all).
inline bool send_frame(int fd, frame_kind kind, std::span<const std::byte> payload,
                       clock::time_point deadline) {
    const auto f = make_frame(kind, payload);
    return send_all(fd, f.data(), f.size(), deadline);
}

} // namespace lockstep_test::ranks::detail

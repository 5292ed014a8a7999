// lockstep/comm/timeout.hpp: the default communicator timeout, overridable for every communicator
// kind by the environment variable LOCKSTEP_TIMEOUT (seconds). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>

namespace lockstep {

/// Parses a LOCKSTEP_TIMEOUT value: a positive, finite number of seconds ("30", "2.5").
/// ensures: the duration rounded up to whole milliseconds (at least 1 ms), or throws
/// lockstep::error (errc::invalid_argument) quoting the text when it is not such a number.
inline std::chrono::milliseconds parse_timeout_seconds(const char* text) {
    const std::string s = text == nullptr ? "" : text;
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    bool ok = !s.empty() && end != s.c_str() && errno == 0 && is_finite(v) && v > 0;
    for (const char* p = end; ok && p != nullptr && *p != '\0'; ++p)
        ok = *p == ' ' || *p == '\t' || *p == '\n';
    constexpr double max_seconds = 1e9; // ~31 years: beyond that milliseconds would overflow
    LOCKSTEP_REQUIRE(ok && v <= max_seconds, errc::invalid_argument, -1, "LOCKSTEP_TIMEOUT", "'", s,
                     "' is not a positive number of seconds <= ", max_seconds,
                     " (e.g. LOCKSTEP_TIMEOUT=30 or 2.5)");
    return std::chrono::milliseconds(static_cast<long long>(std::ceil(v * 1000.0)));
}

/// The timeout a communicator uses when none is passed: LOCKSTEP_TIMEOUT (seconds) when that
/// environment variable is set, else `fallback`. Every communicator kind (thread_group,
/// mpi_communicator, nccl_communicator, gpu_group) takes its default from here.
/// ensures: a positive duration; throws lockstep::error (errc::invalid_argument) when
/// LOCKSTEP_TIMEOUT is set to anything but a positive number of seconds.
inline std::chrono::milliseconds default_timeout(std::chrono::milliseconds fallback) {
    const char* env = std::getenv("LOCKSTEP_TIMEOUT");
    if (env == nullptr)
        return fallback;
    return parse_timeout_seconds(env);
}

/// The longest wait a communicator counts: 1e9 s, LOCKSTEP_TIMEOUT's limit. A longer timeout
/// (std::chrono::milliseconds::max() included, a natural "no timeout") waits this long, so that
/// now + timeout cannot overflow into the past.
inline constexpr std::chrono::milliseconds max_wait = std::chrono::seconds(1000000000);

/// The deadline of a wait of `timeout` that starts now: Clock::now() + min(timeout, max_wait).
template <class Clock = std::chrono::steady_clock>
typename Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
    return Clock::now() + std::min(timeout, max_wait);
}

} // namespace lockstep
